"""The node credential, attacked: a trainer holds the cluster token (it is in
every training job's environment) and tries what only daemons may do, against
a real two-node cluster whose servers hold the node token besides.

Each attack is what any code in a trainer's process could do with the
cluster token alone: push bytes into a peer's cache over Exchange, register
a node or renew a lease at the directory, open the bulk data port, sign a
heartbeat datagram. Each is refused, and changes nothing: the cache still
serves the file's own bytes, the node list is the same.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import encode_value
from dataquay.client.wire.security import Credentials, read_token
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import NODE_METHODS, new_token_file
from dataquay.server.cli import main as cli_main
from dataquay.server.directory.beats import HeartbeatSender, beat_datagram
from dataquay.server.node.peers.bulk.frames import HELLO, MAC_BYTES, client_proof
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

SAMPLES = 120
SIZE = 2000
JOB = "attacked"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two daemons and a directory with both tokens, dataset "imgs" staged for
    a partial job whose epochs nobody reports (no exchange of its own runs)."""
    base = tmp_path_factory.mktemp("node-credential")
    root = make_files_dataset(base / "pfs" / "imgs", SAMPLES, sizes=(SIZE,))
    with LocalCluster(
        base / "cluster",
        2,
        (),
        ("--lease-seconds", "3", "--heartbeat-seconds", "0.5"),
        token_file=new_token_file(base / "token"),
        dataset_roots=(base,),
    ) as local:
        env = {**os.environ, **local.node_env(0)}
        for args in (
            ["dataset", "add", "imgs", str(root)],
            ["stage", "imgs", "--job", JOB, "--mode", "partial", "--q", "0.5", "--ranks-per-node", "1", "--quiet"],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "dataquay.server.cli", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
        yield local


def trainer(local: LocalCluster, address: str) -> grpc.Channel:
    """A channel with what a trainer holds: cluster.env's credentials."""
    return local.credentials().channel(address, channel_options())


def plan(local: LocalCluster) -> tuple[Manifest, np.ndarray, np.ndarray]:
    """The manifest and the job's owner of each sample in epochs 0 and 1."""
    with trainer(local, local.daemons[0].address) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        manifest = Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
    first = owners(job_plan(job, manifest), 0)
    return manifest, first, owners(job_plan(job, manifest), 1, first)


def pfs_bytes(manifest: Manifest, ids: list[int]) -> list[bytes]:
    """The samples' bytes as read from their files on the PFS."""
    out = []
    for i in ids:
        where = manifest.location(i)
        with open(Path(manifest.root) / where.path, "rb") as f:
            f.seek(where.offset)
            out.append(f.read(where.length))
    return out


def test_the_trainers_env_names_the_cluster_token_only(secured: LocalCluster) -> None:
    node_token = secured.node_credentials().token
    assert node_token and node_token != secured.credentials().token
    env = secured.node_env(0)
    assert env["DATAQUAY_TOKEN_FILE"] == str(secured.token_file)
    assert str(secured.node_token_file) not in env.values()
    for path in (secured.env_path(), secured.env_path(0)):
        assert node_token not in path.read_text() and str(secured.node_token_file) not in path.read_text()


def test_a_trainer_token_cannot_push_samples_into_a_peers_cache(secured: LocalCluster) -> None:
    manifest, first, second = plan(secured)
    # Node 0 owns these from epoch 1 on and does not hold them: a valid offer.
    target = np.flatnonzero((second == 0) & (first != 0))[:4].tolist()
    assert target
    offer = pb.ExchangeOffer(job=JOB, dataset="imgs", epoch=1, sender="node-1", ids=target)
    poison = [pb.Sample(id=i, value=encode_value(b"P" * SIZE)) for i in target]  # the length the manifest lists
    ready = secured.daemons[0].ready
    assert ready is not None
    for address in (str(ready["tcp"]), secured.daemons[0].address):  # over TCP and over the unix socket
        with trainer(secured, address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(
                    cache_pb2_grpc.CacheStub(channel).Exchange(
                        iter([pb.ExchangeMessage(offer=offer), pb.ExchangeMessage(samples=poison)]), timeout=10
                    )
                )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
        assert "Exchange needs the node credential" in (refused.value.details() or "")
    with trainer(secured, secured.daemons[0].address) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        held = [s for c in stub.Read(pb.ReadRequest(dataset="imgs", ids=target, peer=True)) for s in c.samples]
        assert all(s.missing for s in held)  # nothing committed
        read = [s.data for c in stub.Read(pb.ReadRequest(dataset="imgs", ids=target)) for s in c.samples]
    assert read == pfs_bytes(manifest, target)
    assert "refused a node-only call made with the cluster token" in secured.daemons[0].log_path.read_text()


def test_the_node_token_still_exchanges(secured: LocalCluster) -> None:
    """The legitimate path: a daemon's own stream, offer and samples, with the node token."""
    manifest, first, second = plan(secured)
    target = np.flatnonzero((second == 1) & (first != 1))[:2].tolist()
    assert target
    offer = pb.ExchangeOffer(job=JOB, dataset="imgs", epoch=1, sender="node-0", ids=target)
    samples = [pb.Sample(id=i, value=encode_value(b)) for i, b in zip(target, pfs_bytes(manifest, target))]
    with secured.node_credentials().channel(secured.daemons[1].address, channel_options()) as channel:
        replies = list(
            cache_pb2_grpc.CacheStub(channel).Exchange(
                iter([pb.ExchangeMessage(offer=offer), pb.ExchangeMessage(samples=samples)]), timeout=10
            )
        )
    assert sorted(replies[-1].held) == sorted(target)


def test_a_trainer_token_cannot_register_a_node_or_renew_a_lease(secured: LocalCluster) -> None:
    with trainer(secured, secured.directory_address) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        before = stub.ListNodes(dpb.ListNodesRequest(), timeout=10)
        fake = jpb.NodeInfo(name="node-9", tcp_address="127.0.0.1:1", cache_capacity=1 << 40, pid=1, version="x")
        calls = [
            ("RegisterNode", lambda: stub.RegisterNode(dpb.RegisterNodeRequest(node=fake), timeout=10)),
            ("Heartbeat", lambda: stub.Heartbeat(dpb.HeartbeatRequest(name="node-9"), timeout=10)),
            ("Heartbeat", lambda: stub.Heartbeat(dpb.HeartbeatRequest(name="node-1", cache_used_bytes=7), timeout=10)),
        ]
        for name, attempt in calls:
            with pytest.raises(grpc.RpcError) as refused:
                attempt()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"{name} needs the node credential" in (refused.value.details() or "")
        after = stub.ListNodes(dpb.ListNodesRequest(), timeout=10)
    assert [n.info.name for n in after.nodes] == [n.info.name for n in before.nodes] == ["node-0", "node-1"]
    assert all(n.cache_used_bytes != 7 for n in after.nodes)


def test_a_trainer_token_cannot_open_the_bulk_port(secured: LocalCluster) -> None:
    def refused() -> int:
        with trainer(secured, secured.daemons[1].address) as channel:
            return int(cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10).bulk.refused_connections)

    before = refused()
    ready = secured.daemons[1].ready
    assert ready is not None
    host, _, port = str(ready["bulk"]).rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        _magic, nonce = HELLO.unpack(sock.recv(HELLO.size, socket.MSG_WAITALL))
        mine = os.urandom(32)
        sock.sendall(mine + client_proof(secured.credentials().token, nonce, mine))
        try:
            answer = sock.recv(MAC_BYTES, socket.MSG_WAITALL)
        except ConnectionResetError:
            answer = b""
    assert answer == b""  # closed: no proof of the server, no request read
    wait_until(lambda: refused() == before + 1, "the connection is counted as refused")
    assert "the client does not hold the node token" in secured.daemons[1].log_path.read_text()


def refused_beats(local: LocalCluster) -> dict[str, int]:
    assert local.directory is not None
    with urllib.request.urlopen(local.directory.http_url + "/metrics", timeout=10) as page:
        metrics = page.read().decode()
    return {
        sample.labels["reason"]: int(sample.value)
        for family in text_string_to_metric_families(metrics)
        if family.name == "dataquay_directory_heartbeats_refused"
        for sample in family.samples
    }


def test_a_heartbeat_signed_with_the_cluster_token_is_ignored(secured: LocalCluster) -> None:
    host, _, port = secured.directory_address.rpartition(":")
    before = refused_beats(secured)["signature"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.connect((host, int(port)))
        udp.settimeout(2)
        now = time.time_ns()
        udp.send(beat_datagram(secured.credentials().token, dpb.HeartbeatRequest(name="stranger"), now, now))
        with pytest.raises(TimeoutError):
            udp.recv(65536)
        wait_until(lambda: refused_beats(secured)["signature"] == before + 1, "the beat is counted as refused")
        udp.settimeout(10)
        udp.send(HeartbeatSender(secured.node_credentials().token).datagram(dpb.HeartbeatRequest(name="stranger")))
        assert not dpb.HeartbeatReply.FromString(udp.recv(65536)).known  # a node's beat is answered


def test_the_cluster_token_still_reads_and_the_daemons_stay_up(secured: LocalCluster) -> None:
    manifest = plan(secured)[0]
    with trainer(secured, secured.daemons[1].address) as channel:  # node 0's cache stays as the attacks left it
        request = pb.ReadRequest(dataset="imgs", ids=list(range(10)), job=JOB)
        read = [s.data for c in cache_pb2_grpc.CacheStub(channel).Read(request) for s in c.samples]
    assert read == pfs_bytes(manifest, list(range(10)))
    time.sleep(3.5)  # past a lease: the daemons' beats, signed with the node token, count
    assert all(n.state == jpb.NODE_UP for n in secured.wait_for_nodes(up=["node-0", "node-1"], timeout=10))


def test_the_node_methods_are_the_cache_writers_and_membership() -> None:
    assert set(NODE_METHODS) == {
        "/dataquay.v1.Cache/Exchange",
        "/dataquay.v1.Cache/CodedPass",
        "/dataquay.v1.Directory/RegisterNode",
        "/dataquay.v1.Directory/Heartbeat",
    }


@pytest.mark.parametrize("command", ["serve", "directory"])
def test_a_server_with_a_cluster_token_and_no_node_token_refuses_to_start(tmp_path: Path, command: str) -> None:
    token = new_token_file(tmp_path / "token")
    common = ["--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
    extra = {
        "serve": ["--socket", str(tmp_path / "s.sock"), "--metrics-port", "0", "--cache-dir", str(tmp_path / "cache")],
        "directory": ["--http-port", "0"],
    }[command]
    env = {**os.environ, "DATAQUAY_CONFIG": "/dev/null"}
    for flags, message in [
        (["--token-file", str(token)], "--token-file needs --node-token-file"),
        (["--token-file", str(token), "--node-token-file", str(token)], "the node token must be a separate one"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "dataquay.server.cli", command, *common, *extra, *flags],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and message in lines[0], done.stderr
        assert "dataquay token new --node" in lines[0]


def test_token_new_node_writes_a_node_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["token", "new", "--node", str(tmp_path / "node-token")]) == 0
    assert "--node-token-file" in capsys.readouterr().out
    assert len(read_token(tmp_path / "node-token")) == 64
    assert Credentials.from_files(tmp_path / "node-token").token == read_token(tmp_path / "node-token")
