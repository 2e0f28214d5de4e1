"""The directory end to end: real `dataquay directory` processes, fake daemons
that are just gRPC calls, real dataset files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dataquay.client.manifest import Manifest
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.security import Credentials, read_token
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import new_token_file
from dataquay.server.cli import build_parser, stage
from dataquay.server.cli import main as cli_main
from dataquay.server.config import DaemonConfig, DirectoryConfig
from dataquay.server.directory.beats import HeartbeatSender, beat_datagram
from dataquay.server.manifest_build import build_manifest
from dataquay.server.tools.processes import DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

Stub = directory_pb2_grpc.DirectoryStub


@pytest.fixture
def imgs(tmp_path: Path) -> Path:
    return make_files_dataset(tmp_path / "pfs" / "imgs", 40, sizes=(100, 300), classes=2)


#: The session each node's last registration handed out, which its heartbeats carry.
sessions: dict[str, int] = {}


def node_key(name: str) -> bytes:
    """The identity key the daemon named ``name`` keeps: one per name."""
    return hashlib.sha256(name.encode()).digest()


def register_as(stub: Stub, node: jpb.NodeInfo) -> dpb.RegisterNodeReply:
    """Registers ``node`` with the key of its name, as its daemon would."""
    reply = stub.RegisterNode(dpb.RegisterNodeRequest(node=node, identity_key=node_key(node.name)))
    sessions[node.name] = reply.session
    return reply


def register(stub: Stub, name: str, port: int = 7000) -> dpb.RegisterNodeReply:
    return register_as(
        stub,
        jpb.NodeInfo(
            name=name,
            tcp_address=f"127.0.0.1:{port}",
            metrics_address=f"127.0.0.1:{port + 1000}",
            cache_capacity=1 << 30,
            pid=1234,
            version="test",
        ),
    )


def heartbeat(stub: Stub, name: str, **fields: int) -> dpb.HeartbeatReply:
    """A heartbeat by RPC for ``name``, with the session of its last registration."""
    return stub.Heartbeat(dpb.HeartbeatRequest(name=name, session=sessions.get(name, 0), **fields))


def nodes(stub: Stub) -> dict[str, int]:
    return {n.info.name: n.state for n in stub.ListNodes(dpb.ListNodesRequest()).nodes}


def join(stub: Stub, job: str = "j1", must_exist: bool = False, **fields: object) -> jpb.Job:
    return stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job, **fields), must_exist=must_exist))


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_nodes_register_heartbeat_and_are_listed_by_name(
    directory: DirectoryProcess, stub_for: Callable[..., Stub]
) -> None:
    stub = stub_for(directory)
    first = register(stub, "n1")
    assert first.lease_seconds == 10 and first.heartbeat_seconds == 2
    second = register(stub, "n0", port=7002)
    assert second.versions.nodes == first.versions.nodes  # one version per heartbeat period
    beat = heartbeat(stub, "n0", cache_used_bytes=5000, cache_entries=7)
    assert beat.known and beat.versions == second.versions
    assert not heartbeat(stub, "stranger").known
    listed = stub.ListNodes(dpb.ListNodesRequest())
    assert [n.info.name for n in listed.nodes] == ["n0", "n1"]
    n0 = listed.nodes[0]
    assert n0.state == jpb.NODE_UP and n0.cache_used_bytes == 5000 and n0.cache_entries == 7
    assert (n0.info.tcp_address, n0.info.metrics_address, n0.info.cache_capacity, n0.info.version) == (
        "127.0.0.1:7002",
        "127.0.0.1:8002",
        1 << 30,
        "test",
    )
    assert n0.last_heartbeat_unix >= n0.registered_unix > 0


def test_a_wildcard_address_becomes_the_address_the_node_called_from(
    directory: DirectoryProcess, stub_for: Callable[..., Stub]
) -> None:
    stub = stub_for(directory)
    node = jpb.NodeInfo(name="n0", tcp_address="0.0.0.0:7070", metrics_address="[::]:9470")
    register_as(stub, node)
    info = stub.ListNodes(dpb.ListNodesRequest()).nodes[0].info
    assert (info.tcp_address, info.metrics_address) == ("127.0.0.1:7070", "127.0.0.1:9470")


def test_a_silent_node_goes_down_in_service_discovery_and_comes_back_on_heartbeat(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub]
) -> None:
    directory = start_directory("--lease-seconds", "2", "--heartbeat-seconds", "0.2")
    stub = stub_for(directory)
    register(stub, "alive", port=7000)
    version = register(stub, "silent", port=7100).versions.nodes
    # Beats of their own, as a daemon's: however slowly the test's calls go,
    # "alive" never misses its lease.
    stop = threading.Event()

    def beat_alive() -> None:
        while not stop.wait(0.1):
            heartbeat(stub, "alive")

    beats = threading.Thread(target=beat_alive)
    beats.start()
    try:
        status, body = http_get(directory.http_url + "/sd")
        assert status == 200 and {g["labels"]["dataquay_node"] for g in json.loads(body)} == {"alive", "silent"}
        wait_until(lambda: nodes(stub)["silent"] == jpb.NODE_DOWN, "the silent node is listed down")
        assert nodes(stub) == {"alive": jpb.NODE_UP, "silent": jpb.NODE_DOWN}
        # Still a target, so that Prometheus scrapes it, its `up` turns 0 and an alert fires.
        assert json.loads(http_get(directory.http_url + "/sd")[1]) == [
            {"targets": ["127.0.0.1:8000"], "labels": {"dataquay_node": "alive", "dataquay_state": "up"}},
            {"targets": ["127.0.0.1:8100"], "labels": {"dataquay_node": "silent", "dataquay_state": "down"}},
        ]
        metrics = http_get(directory.http_url + "/metrics")[1].decode()
        assert 'dataquay_directory_nodes{state="up"} 1.0' in metrics
        assert 'dataquay_directory_nodes{state="down"} 1.0' in metrics

        beat = heartbeat(stub, "silent")
        assert beat.known and beat.versions.nodes > version
        assert nodes(stub) == {"alive": jpb.NODE_UP, "silent": jpb.NODE_UP}
        assert [g["labels"]["dataquay_state"] for g in json.loads(http_get(directory.http_url + "/sd")[1])] == [
            "up",
            "up",
        ]
    finally:
        stop.set()
        beats.join()
    assert directory.stop() == 0
    log = directory.log_path.read_text()
    assert log.count("node down node=silent") == 1 and log.count("node up node=silent") == 1
    assert "node down node=alive" not in log


def test_datasets_are_registered_once_at_the_directory(
    directory: DirectoryProcess, stub_for: Callable[..., Stub], imgs: Path
) -> None:
    stub = stub_for(directory)
    version = register(stub, "n0").versions.datasets
    info = stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    assert info.num_samples == 40 and info.format == pb.FORMAT_FILES
    assert info.cached_samples == 0 and info.cached_bytes == 0
    assert heartbeat(stub, "n0").versions.datasets == version + 1
    assert [d.name for d in stub.ListDatasets(pb.ListDatasetsRequest()).datasets] == ["imgs"]
    assert stub.GetDataset(pb.GetDatasetRequest(name="imgs")) == info

    built = io.BytesIO()
    build_manifest(imgs).write(built)
    local = Manifest(built.getvalue())
    fetched = Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
    assert fetched.manifest_id == info.manifest_id and len(fetched.data) == info.manifest_bytes
    # The two differ in their build time, and so in where the arrays begin.
    timeless = [{k: v for k, v in m.header.items() if k not in ("created", "arrays")} for m in (fetched, local)]
    assert timeless[0] == timeless[1]
    assert [fetched.path(i) for i in range(fetched.num_paths)] == [local.path(i) for i in range(local.num_paths)]
    assert (fetched.sample_offset.tolist(), fetched.sample_length.tolist()) == (
        local.sample_offset.tolist(),
        local.sample_length.tolist(),
    )

    again = rpc_error(lambda: stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs))))
    assert again.code() == grpc.StatusCode.ALREADY_EXISTS
    missing = rpc_error(lambda: stub.GetManifest(pb.GetDatasetRequest(name="nope")).next())
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in missing.details()

    assert stub.DropDataset(pb.DropDatasetRequest(name="imgs")).freed_samples == 0
    assert not stub.ListDatasets(pb.ListDatasetsRequest()).datasets
    assert rpc_error(lambda: stub.GetDataset(pb.GetDatasetRequest(name="imgs"))).code() == grpc.StatusCode.NOT_FOUND
    assert heartbeat(stub, "n0").versions.datasets == version + 2


def test_jobs_are_created_by_the_first_join_and_refuse_other_settings(
    directory: DirectoryProcess, stub_for: Callable[..., Stub], imgs: Path
) -> None:
    stub = stub_for(directory)
    for name in ("n2", "n0", "n1"):
        register(stub, name)
    info = stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    jobs_version = heartbeat(stub, "n0").versions.jobs

    created = join(stub, dataset="imgs", seed=5)
    assert list(created.spec.nodes) == ["n0", "n1", "n2"]
    assert (created.spec.mode, created.spec.q, created.spec.partition, created.spec.ranks_per_node) == (
        "global",
        0.0,
        "sample",
        0,
    )
    assert (created.manifest_id, created.num_samples, created.epoch) == (info.manifest_id, 40, 0)
    assert heartbeat(stub, "n0").versions.jobs == jobs_version + 1

    joined = join(stub, must_exist=True, ranks_per_node=4)
    assert joined.spec.seed == 5 and joined.spec.ranks_per_node == 4
    assert join(stub, dataset="imgs", seed=5, mode="global", drop_last=False).spec == joined.spec

    mismatch = rpc_error(lambda: join(stub, dataset="imgs", seed=6))
    assert mismatch.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert mismatch.details() == "job 'j1' exists with seed 5; this join asked for 6"
    assert "drop_last" in rpc_error(lambda: join(stub, drop_last=True)).details()
    assert "ranks_per_node 4" in rpc_error(lambda: join(stub, ranks_per_node=2)).details()

    for call, code, words in [
        (lambda: join(stub, "j2", must_exist=True), grpc.StatusCode.NOT_FOUND, "no job 'j2'"),
        (lambda: join(stub, "j2", dataset="nope"), grpc.StatusCode.NOT_FOUND, "unknown dataset 'nope'"),
        (
            lambda: join(stub, "j2", dataset="imgs", mode="shuffle"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "mode must be one of global, local, partial, locality, not 'shuffle'",
        ),
        (
            lambda: join(stub, "j2", dataset="imgs", nodes=["n0", "n7", "n9"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "n7, n9",
        ),
        (lambda: join(stub, "j 2", dataset="imgs"), grpc.StatusCode.INVALID_ARGUMENT, "bad job id 'j 2'"),
        (lambda: join(stub, "j2", dataset="imgs", q=2.0), grpc.StatusCode.INVALID_ARGUMENT, "q 2.0"),
        (
            lambda: join(stub, "j2", dataset="imgs", mode="partial"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "q must be in (0, 1] for mode partial",
        ),
        (
            lambda: join(stub, "j2", dataset="imgs", mode="locality"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch_size must be at least 1 for mode locality",
        ),
    ]:
        error = rpc_error(call)
        assert error.code() == code and words in error.details(), error.details()

    explicit = join(stub, "j2", dataset="imgs", nodes=["n2", "n0"])
    assert join(stub, "j3", dataset="imgs", mode="locality", batch_size=16).spec.batch_size == 16
    assert join(stub, "j3", batch_size=16).spec.mode == "locality"
    assert list(explicit.spec.nodes) == ["n2", "n0"]
    assert stub.ReportEpoch(jpb.ReportEpochRequest(job_id="j1", epoch=3, node="n1")).epoch == 3
    assert stub.ReportEpoch(jpb.ReportEpochRequest(job_id="j1", epoch=1, node="n0")).epoch == 3
    assert stub.GetJob(jpb.GetJobRequest(job_id="j1")).epoch == 3
    error = rpc_error(lambda: stub.ReportEpoch(jpb.ReportEpochRequest(job_id="j9", epoch=1)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert [j.spec.job_id for j in stub.ListJobs(jpb.ListJobsRequest()).jobs] == ["j1", "j2", "j3"]

    stub.DropJob(jpb.DropJobRequest(job_id="j1"))
    assert rpc_error(lambda: stub.GetJob(jpb.GetJobRequest(job_id="j1"))).code() == grpc.StatusCode.NOT_FOUND
    assert rpc_error(lambda: stub.DropJob(jpb.DropJobRequest(job_id="j1"))).code() == grpc.StatusCode.NOT_FOUND


def test_a_job_on_all_live_nodes_is_refused_while_none_is_up(
    directory: DirectoryProcess, stub_for: Callable[..., Stub], imgs: Path
) -> None:
    stub = stub_for(directory)
    stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    error = rpc_error(lambda: join(stub, dataset="imgs"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "none is up" in error.details()


def test_nodes_jobs_and_datasets_survive_a_kill_and_a_restart(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub], imgs: Path
) -> None:
    first = start_directory()
    stub = stub_for(first)
    register(stub, "n0")
    register(stub, "n1")
    stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    job = join(stub, dataset="imgs", seed=9, ranks_per_node=2)
    job = stub.ReportEpoch(jpb.ReportEpochRequest(job_id="j1", epoch=2))
    manifest = b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs")))
    versions = heartbeat(stub, "n0").versions
    first.kill()

    second = start_directory()
    stub = stub_for(second)
    assert nodes(stub) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_UP}
    assert stub.GetJob(jpb.GetJobRequest(job_id="j1")) == job
    assert b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs"))) == manifest
    beat = heartbeat(stub, "n1")
    assert beat.known
    assert (beat.versions.nodes, beat.versions.datasets, beat.versions.jobs) > (
        versions.nodes,
        versions.datasets,
        versions.jobs,
    )
    assert second.stop() == 0
    assert json.loads((second.state_dir / "directory.json").read_text())["jobs"][0]["epoch"] == 2


def test_daemons_restarted_with_their_directory_on_new_ports_raise_no_shared_name_warning(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub]
) -> None:
    first = start_directory()
    register(stub_for(first), "n0", port=7000)
    register(stub_for(first), "n1", port=7100)
    assert first.stop() == 0  # `cluster down`, then `cluster up` in the same base dir:
    second = start_directory()
    stub = stub_for(second)
    register(stub, "n0", port=8000)
    register(stub, "n1", port=8100)
    assert nodes(stub) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_UP}
    register(stub, "n1", port=8200)  # the same node, restarted on yet another address
    taken = jpb.NodeInfo(name="n1", tcp_address="127.0.0.1:8300")
    refused = rpc_error(lambda: stub.RegisterNode(dpb.RegisterNodeRequest(node=taken, identity_key=node_key("x"))))
    assert refused.code() == grpc.StatusCode.ALREADY_EXISTS
    assert second.stop() == 0
    log = second.log_path.read_text()
    assert "two daemons may share a node name" not in log and log.count("refused a live node's name") == 1


def test_bad_input_is_refused_and_the_directory_keeps_serving(
    directory: DirectoryProcess, stub_for: Callable[..., Stub], tmp_path: Path
) -> None:
    stub = stub_for(directory)
    bad_nodes = [
        jpb.NodeInfo(),
        jpb.NodeInfo(name="n0"),
        jpb.NodeInfo(name="../x", tcp_address="h:1"),
        jpb.NodeInfo(name="n0", tcp_address="h:1", metrics_address="h"),
        jpb.NodeInfo(name="x" * 100_000),
    ]
    for node in bad_nodes:
        error = rpc_error(lambda: stub.RegisterNode(dpb.RegisterNodeRequest(node=node, identity_key=node_key("n0"))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for request in [
        pb.AddDatasetRequest(),
        pb.AddDatasetRequest(name="../up", root=str(tmp_path)),
        pb.AddDatasetRequest(name="x", root=str(tmp_path / "missing")),
    ]:
        error = rpc_error(lambda: stub.AddDataset(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details()
    assert not stub.Heartbeat(dpb.HeartbeatRequest(name="")).known
    assert rpc_error(lambda: join(stub, "")).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_error(lambda: stub.DropDataset(pb.DropDatasetRequest())).code() == grpc.StatusCode.NOT_FOUND

    port = int(directory.address.rpartition(":")[2])
    for junk in (b"\x00" * 1000, b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(junk)
    http_port = int(directory.http_url.rpartition(":")[2])
    for junk, status in (
        (b"garbage\r\n\r\n", b"400"),
        (b"GET /sd HTTP/1.1\r\nX: " + b"y" * 100_000, b"431"),
        (b"POST /sd HTTP/1.1\r\n\r\n", b"405"),
    ):
        with socket.create_connection(("127.0.0.1", http_port), timeout=5) as sock:
            sock.sendall(junk)
            assert sock.recv(1024).split()[1] == status
    assert http_get(directory.http_url + "/nowhere")[0] == 404

    assert http_get(directory.http_url + "/healthz") == (200, b"ok\n")
    register(stub, "n0")
    assert nodes(stub) == {"n0": jpb.NODE_UP}


def test_job_commands_list_show_and_drop(
    directory: DirectoryProcess, stub_for: Callable[..., Stub], imgs: Path
) -> None:
    stub = stub_for(directory)
    register(stub, "n0")
    register(stub, "n1")
    stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    join(stub, dataset="imgs", seed=7, q=0.25, ranks_per_node=4)
    stub.ReportEpoch(jpb.ReportEpochRequest(job_id="j1", epoch=3))
    env = {"DATAQUAY_DIRECTORY": directory.address}

    listed = run_cli("job", "ls", env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["JOB", "DATASET", "MODE", "Q", "SEED", "NODES", "RANKS/NODE", "EPOCH", "IDLE"]
    assert row.split()[:-1] == ["j1", "imgs", "global", "0.25", "7", "2", "4", "3"]

    shown = run_cli("job", "show", "j1", "--directory", directory.address)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "seed         7" in lines and "samples      40" in lines and "epoch        3" in lines
    assert lines[-2:] == ["      0  n0", "      1  n1"]

    assert run_cli("job", "drop", "j1", env=env).stdout.strip() == "dropped job 'j1'"
    for args in (("show", "j1"), ("drop", "j1")):
        result = run_cli("job", *args, env=env)
        assert result.returncode == 1 and result.stderr.count("\n") == 1 and "no job 'j1'" in result.stderr
    assert run_cli("job", "ls", env=env).stdout.splitlines()[1:] == []

    nowhere = run_cli("job", "ls", env={"DATAQUAY_DIRECTORY": "127.0.0.1:1"})
    assert nowhere.returncode == 1 and "no directory answers at 127.0.0.1:1" in nowhere.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--lease-seconds", "2", "--heartbeat-seconds", "2"], {}, "--heartbeat-seconds (2) must be below"),
        ([], {"DATAQUAY_DIRECTORY_HTTP_PORT": "http"}, "DATAQUAY_DIRECTORY_HTTP_PORT: bad value 'http'"),
        (["--listen", "127.0.0.1:x", "--http-host", "127.0.0.1", "--http-port", "0"], {}, "bad listen address"),
    ],
)
def test_directory_config_errors_exit_nonzero_with_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    result = run_cli("directory", "--state-dir", str(tmp_path), *args, env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_directory_settings_come_from_their_own_environment_variables() -> None:
    env = {
        "DATAQUAY_LISTEN": "10.0.0.1:7070",
        "DATAQUAY_DIRECTORY_LISTEN": "10.0.0.2:7071",
        "DATAQUAY_DIRECTORY_LEASE_SECONDS": "30",
        "DATAQUAY_DIRECTORY": "10.0.0.2:7071",
    }
    directory = DirectoryConfig.from_sources({}, env)
    assert directory.listen == "10.0.0.2:7071" and directory.lease_seconds == 30.0
    assert directory.state_dir.name == "directory"
    daemon = DaemonConfig.from_sources({}, env)
    assert daemon.listen == "10.0.0.1:7070"


def test_sigterm_stops_the_directory_cleanly(directory: DirectoryProcess) -> None:
    assert http_get(directory.http_url + "/healthz")[0] == 200
    directory.signal(signal.SIGTERM)
    assert directory.stop() == 0
    assert "stopping" in directory.log_tail()


def test_heartbeat_datagrams_renew_the_lease_and_garbage_is_ignored(
    directory: DirectoryProcess, stub_for: Callable[..., Stub]
) -> None:
    stub = stub_for(directory)
    registered = register(stub, "n0")
    host, _, port = directory.address.rpartition(":")
    sender = HeartbeatSender()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(5)
        udp.connect((host, int(port)))
        udp.send(b"\xff not a heartbeat")
        udp.send(dpb.HeartbeatRequest(name="n0").SerializeToString())  # bare, without the header
        beat = dpb.HeartbeatRequest(name="n0", cache_used_bytes=123, cache_entries=4, session=registered.session)
        udp.send(sender.datagram(beat))
        reply = dpb.HeartbeatReply.FromString(udp.recv(65536))
        assert reply.known and reply.versions == registered.versions
        udp.send(sender.datagram(dpb.HeartbeatRequest(name="stranger")))
        assert not dpb.HeartbeatReply.FromString(udp.recv(65536)).known
    n0 = stub.ListNodes(dpb.ListNodesRequest()).nodes[0]
    assert n0.cache_used_bytes == 123 and n0.cache_entries == 4
    assert refused_beats(directory) == {
        "signature": 0,
        "format": 2,
        "malformed": 0,
        "stale": 0,
        "replayed": 0,
        "holder": 0,
    }


def refused_beats(directory: DirectoryProcess) -> dict[str, int]:
    """The directory's count of refused heartbeat datagrams, by reason."""
    metrics = http_get(directory.http_url + "/metrics")[1].decode()
    return {
        sample.labels["reason"]: int(sample.value)
        for family in text_string_to_metric_families(metrics)
        if family.name == "dataquay_directory_heartbeats_refused"
        for sample in family.samples
    }


def test_a_replayed_signed_beat_does_not_bring_a_down_node_back_up(
    start_directory: Callable[..., DirectoryProcess], tmp_path: Path
) -> None:
    node_token_file = new_token_file(tmp_path / "node-token")
    token = read_token(node_token_file)  # the capture is of a daemon's beat, signed with the node token
    directory = start_directory(
        "--lease-seconds",
        "1",
        "--heartbeat-seconds",
        "0.2",
        "--token-file",
        str(new_token_file(tmp_path / "token")),
        "--node-token-file",
        str(node_token_file),
    )
    host, _, port = directory.address.rpartition(":")
    with (
        Credentials(token=token).channel(directory.address, channel_options()) as channel,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
    ):
        stub = Stub(channel)
        session = register(stub, "n0").session
        udp.settimeout(10)
        udp.connect((host, int(port)))
        sender = HeartbeatSender(token)
        captured = sender.datagram(dpb.HeartbeatRequest(name="n0", session=session))
        udp.send(captured)
        assert dpb.HeartbeatReply.FromString(udp.recv(65536)).known

        wait_until(lambda: nodes(stub)["n0"] == jpb.NODE_DOWN, "n0 is listed down")
        udp.send(captured)
        wait_until(lambda: refused_beats(directory)["replayed"] == 1, "the replay is counted")
        beat = dpb.HeartbeatRequest(name="n0", session=session)
        old = beat_datagram(token, beat, time.time_ns(), time.time_ns() - 3 * 10**9)
        udp.send(old)
        wait_until(lambda: refused_beats(directory)["stale"] == 1, "the beat sent 3 leases ago is counted")
        assert nodes(stub)["n0"] == jpb.NODE_DOWN

        udp.send(sender.datagram(beat))
        assert dpb.HeartbeatReply.FromString(udp.recv(65536)).known
        assert nodes(stub)["n0"] == jpb.NODE_UP
    assert refused_beats(directory) == {
        "signature": 0,
        "format": 0,
        "malformed": 0,
        "stale": 1,
        "replayed": 1,
        "holder": 0,
    }


def test_stage_passes_the_batch_size_only_with_a_job(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    spec = stage._job_spec(parse(["stage", "imgs", "--job", "j1", "--mode", "locality", "--batch-size", "32"]))
    assert (spec.mode, spec.batch_size) == ("locality", 32)
    assert not stage._job_spec(parse(["stage", "imgs", "--job", "j1"])).HasField("batch_size")
    assert cli_main(["stage", "imgs", "--batch-size", "32"]) == 1
    assert "--batch-size: only with --job JOB" in capsys.readouterr().err


def test_a_directory_whose_heartbeat_port_is_taken_says_so(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "dataquay.server.cli",
                "directory",
                "--listen",
                f"127.0.0.1:{port}",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                "0",
                "--state-dir",
                str(tmp_path / "state"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"cannot receive heartbeats on UDP 127.0.0.1:{port}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
