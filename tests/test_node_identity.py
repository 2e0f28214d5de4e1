"""A node name belongs to one node: a second daemon given a live node's
--node-name is refused, the node's own restarts are not, and heartbeats for
a name renew its lease only when they come from the daemon that holds it.

Real directory and daemon processes on loopback, real files as the PFS; the
attacker is a second daemon, and a client forging heartbeats by RPC and UDP.
"""

from __future__ import annotations

import signal
import socket
import stat
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import pytest
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.beats import HeartbeatSender
from dataquay.server.directory.records import NodeInfo
from dataquay.server.directory.state import DirectoryState, identity_of
from dataquay.server.errors import InvalidRequestError, NodeNameTakenError, StartupError
from dataquay.server.node.cluster.identity import IDENTITY_FILE, node_identity
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

N = 60
SIZE = 2000
LEASE = 10.0
#: The directory's settings for the processes' tests: a dead node is down within a second or so.
FAST_LEASE_SECONDS = 1.0
FAST_LEASES = ("--lease-seconds", str(FAST_LEASE_SECONDS), "--heartbeat-seconds", "0.2")
KEY_A, KEY_B = identity_of(b"a" * 32), identity_of(b"b" * 32)


# ------------------------------------------------------------- the state machine


def test_a_live_name_is_refused_to_another_identity_and_kept_by_its_own() -> None:
    state = DirectoryState(LEASE, sessions=iter(range(1, 100)).__next__)
    first = state.register(NodeInfo("n0", "10.0.0.1:7070"), 0.0, KEY_A)
    with pytest.raises(
        NodeNameTakenError,
        match=r"^node name n0 is held by a live node at 10.0.0.1:7070; "
        r"pick another --node-name or stop that daemon$",
    ):
        state.register(NodeInfo("n0", "10.0.0.2:7070"), 1.0, KEY_B)
    held = state.node("n0")
    assert held is not None and held.info.tcp_address == "10.0.0.1:7070" and held.session == first.session

    restarted = state.register(NodeInfo("n0", "10.0.0.1:7171"), 2.0, KEY_A)
    assert restarted.session not in (0, first.session)
    assert state.heartbeat("n0", 0, 0, 3.0, session=first.session).refused == "holder"
    assert state.heartbeat("n0", 0, 0, 3.0).refused == "holder"
    assert state.heartbeat("n0", 0, 0, 3.0, session=restarted.session) == (True, False, "")

    assert state.expire(3.0 + LEASE) == ["n0"]
    taken = state.register(NodeInfo("n0", "10.0.0.2:7070"), 4.0 + LEASE, KEY_B)
    assert taken.previous_identity == KEY_A and state.nodes()[0].info.tcp_address == "10.0.0.2:7070"


def test_the_holders_identity_and_session_survive_a_directory_restart() -> None:
    state = DirectoryState(LEASE)
    session = state.register(NodeInfo("n0", "10.0.0.1:7070"), 0.0, KEY_A).session
    restored = DirectoryState.from_json(state.to_json(), LEASE, now=100.0)
    assert restored.heartbeat("n0", 0, 0, 101.0, session=session).known
    assert restored.heartbeat("n0", 0, 0, 101.0, session=session + 1).refused == "holder"
    with pytest.raises(NodeNameTakenError):
        restored.register(NodeInfo("n0", "10.0.0.2:7070"), 101.0, KEY_B)


def test_a_key_of_another_length_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="identity key of 5 bytes, expected 32"):
        identity_of(b"short")


def test_the_key_is_made_once_owner_only_and_a_damaged_one_stops_the_start(tmp_path: Path) -> None:
    key = node_identity(tmp_path)
    path = tmp_path / IDENTITY_FILE
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert node_identity(tmp_path) == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("not a key\n")
    with pytest.raises(StartupError, match=f"the node identity key {path} is not 64 hex digits"):
        node_identity(tmp_path)


# ------------------------------------------------------------- real processes


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[DirectoryProcess]:
    started = DirectoryProcess(tmp_path / "directory", FAST_LEASES).start()
    yield started
    started.kill()


@pytest.fixture
def start_node(tmp_path: Path, directory: DirectoryProcess) -> Iterator[Callable[..., DaemonProcess]]:
    """Starts a daemon under tmp_path/HOME named NAME, of ``directory`` or
    another, and returns it once it is ready or has exited."""
    started: list[DaemonProcess] = []

    def start(home: str, name: str, of: DirectoryProcess = directory) -> DaemonProcess:
        daemon = DaemonProcess(
            tmp_path / home,
            ("--directory", of.address, "--node-name", name, "--peer-timeout", "2"),
            dataset_roots=(tmp_path,),
        )
        started.append(daemon)
        try:
            daemon.start()
        except StartupError:
            pass  # exited before it was ready: the caller looks at why
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


def listed(directory: DirectoryProcess) -> dict[str, jpb.NodeStatus]:
    with grpc.insecure_channel(directory.address, options=channel_options()) as channel:
        reply = directory_pb2_grpc.DirectoryStub(channel).ListNodes(dpb.ListNodesRequest(), timeout=10)
    return {n.info.name: n for n in reply.nodes}


def up_at(directory: DirectoryProcess, name: str, address: str) -> bool:
    node = listed(directory).get(name)
    return node is not None and node.state == jpb.NODE_UP and node.info.tcp_address == address


def cache_stub(daemon: DaemonProcess, channels: ExitStack) -> cache_pb2_grpc.CacheStub:
    channel = grpc.insecure_channel(grpc_target(daemon.address), options=channel_options())
    return cache_pb2_grpc.CacheStub(channels.enter_context(channel))


def exited_with(daemon: DaemonProcess) -> tuple[int, str]:
    assert daemon.process is not None
    return daemon.process.wait(timeout=60), daemon.log_path.read_text()


def test_a_second_daemon_cannot_take_a_live_nodes_name_but_the_node_restarts_and_a_successor_takes_it_later(
    tmp_path: Path, directory: DirectoryProcess, start_node: Callable[..., DaemonProcess]
) -> None:
    make_files_dataset(tmp_path / "pfs" / "imgs", N, sizes=(SIZE,), classes=3)
    a, c = start_node("a", "n0"), start_node("c", "n1")
    assert a.ready is not None and c.ready is not None
    wait_until(
        lambda: up_at(directory, "n0", a.ready["tcp"]) and up_at(directory, "n1", c.ready["tcp"]), "both nodes up"
    )
    channels = ExitStack()
    a_stub, c_stub = cache_stub(a, channels), cache_stub(c, channels)
    a_stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(tmp_path / "pfs" / "imgs")))
    job = a_stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="j1", dataset="imgs")))
    assert list(job.spec.nodes) == ["n0", "n1"]
    *_, staged = a_stub.Stage(pb.StageRequest(dataset="imgs", job="j1"))
    assert not staged.error
    manifest = Manifest(b"".join(m.data for m in c_stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
    of_a = np.flatnonzero(owners(job_plan(job, manifest), 0) == 0).tolist()
    assert of_a and staged.done_samples == len(of_a)

    def read_through_c() -> list[pb.Sample]:
        request = pb.ReadRequest(dataset="imgs", ids=of_a, job="j1")
        return [s for chunk in c_stub.Read(request) for s in chunk.samples]

    # The attack: a daemon on another cache dir, given n0's name while n0 lives.
    b = start_node("b", "n0")
    code, log = exited_with(b)
    assert code == 1
    assert (
        f"dataquay: error: node name n0 is held by a live node at {a.ready['tcp']}; "
        "pick another --node-name or stop that daemon"
    ) in log.splitlines()
    assert up_at(directory, "n0", a.ready["tcp"])
    samples = read_through_c()
    assert [s.data for s in samples] == [sample_bytes(0, i, SIZE) for i in of_a]
    assert {s.tier for s in samples} == {pb.TIER_PEER}  # from n0's cache: it was n0 that answered

    # n0 itself restarts on its cache dir, on another port: still n0.
    key = (a.cache_dir / IDENTITY_FILE).read_bytes()
    assert stat.S_IMODE((a.cache_dir / IDENTITY_FILE).stat().st_mode) == 0o600
    assert a.stop() == 0
    a = start_node("a", "n0")
    assert a.ready is not None and (a.cache_dir / IDENTITY_FILE).read_bytes() == key
    wait_until(lambda: up_at(directory, "n0", a.ready["tcp"]), "n0 listed at its new address")
    assert [s.data for s in read_through_c()] == [sample_bytes(0, i, SIZE) for i in of_a]

    # n0 dies for good; once its lease ended a successor on a fresh disk takes the name.
    a.kill()
    wait_until(lambda: listed(directory)["n0"].state == jpb.NODE_DOWN, "n0 down after its lease")
    b = start_node("b", "n0")
    assert b.ready is not None and b.process is not None and b.process.poll() is None
    wait_until(lambda: up_at(directory, "n0", b.ready["tcp"]), "the successor listed as n0")
    assert "a node name passed to another identity after its holder's lease ended" in directory.log_path.read_text()
    channels.close()


def test_a_refusal_that_comes_after_the_daemon_reported_ready_still_stops_it(
    tmp_path: Path, start_node: Callable[..., DaemonProcess]
) -> None:
    slow = DirectoryProcess(tmp_path / "slow", ("--lease-seconds", "30", "--heartbeat-seconds", "1")).start()
    try:
        a = start_node("a", "n0", slow)
        assert a.ready is not None
        wait_until(lambda: up_at(slow, "n0", a.ready["tcp"]), "n0 up")
        slow.signal(signal.SIGSTOP)  # the directory takes longer to answer than a start waits
        try:
            b = start_node("b", "n0", slow)
            assert b.ready is not None, b.log_tail()
        finally:
            slow.signal(signal.SIGCONT)
        code, log = exited_with(b)
        assert (
            code == 1
            and f"dataquay: error: node name n0 is held by a live node at {a.ready['tcp']}; "
            "pick another --node-name or stop that daemon"
            in log.splitlines()
        )
        assert up_at(slow, "n0", a.ready["tcp"])
    finally:
        slow.kill()


def test_a_registration_without_an_identity_key_takes_no_name_and_no_lease(directory: DirectoryProcess) -> None:
    node = jpb.NodeInfo(name="n0", tcp_address="127.0.0.1:7070")
    with grpc.insecure_channel(directory.address, options=channel_options()) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterNode(dpb.RegisterNodeRequest(node=node), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            "a node registered without an identity key (a daemon keeps one in its cache dir)"
        )
        assert not stub.ListNodes(dpb.ListNodesRequest(), timeout=10).nodes
        assert not stub.Heartbeat(dpb.HeartbeatRequest(name="n0"), timeout=10).known
        held = stub.RegisterNode(dpb.RegisterNodeRequest(node=node, identity_key=b"a" * 32), timeout=10)
        assert held.session and stub.Heartbeat(dpb.HeartbeatRequest(name="n0", session=held.session), timeout=10).known
        assert not stub.Heartbeat(dpb.HeartbeatRequest(name="n0"), timeout=10).known  # no session: not its holder
        assert [n.info.name for n in stub.ListNodes(dpb.ListNodesRequest(), timeout=10).nodes] == ["n0"]


def refused_for_holder(directory: DirectoryProcess) -> int:
    with urllib.request.urlopen(directory.http_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return next(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "dataquay_directory_heartbeats_refused"
        for sample in family.samples
        if sample.labels["reason"] == "holder"
    )


def test_heartbeats_forged_for_a_dead_nodes_name_do_not_keep_it_up(
    directory: DirectoryProcess, start_node: Callable[..., DaemonProcess]
) -> None:
    a = start_node("a", "n0")
    assert a.ready is not None
    wait_until(lambda: up_at(directory, "n0", a.ready["tcp"]), "n0 up")
    a.kill()
    host, _, port = directory.address.rpartition(":")
    sender = HeartbeatSender()
    forged = [dpb.HeartbeatRequest(name="n0", cache_used_bytes=7), dpb.HeartbeatRequest(name="n0", session=1 << 40)]
    with (
        grpc.insecure_channel(directory.address, options=channel_options()) as channel,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
    ):
        stub = directory_pb2_grpc.DirectoryStub(channel)
        udp.connect((host, int(port)))
        rpcs = 0
        deadline = time.monotonic() + 4 * FAST_LEASE_SECONDS
        while time.monotonic() < deadline:
            for request in forged:
                assert not stub.Heartbeat(request, timeout=10).known
                udp.send(sender.datagram(request))
                rpcs += 1
            time.sleep(0.05)
    node = listed(directory)["n0"]
    assert node.state == jpb.NODE_DOWN and node.cache_used_bytes != 7
    assert refused_for_holder(directory) >= rpcs
