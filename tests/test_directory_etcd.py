"""The directory on etcd: a real 3-member etcd cluster on loopback and real
`dataquay directory` replicas, daemons played by gRPC calls.

Each test is a failure the embedded store cannot ride out: the directory
process that a node registered with, or that created a job, killed with
SIGKILL; an etcd member killed; all of etcd gone and back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from polling import wait_until

from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc, etcd_rpc_pb2, etcd_rpc_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.tools.etcd_cluster import EtcdCluster, etcd_binary
from dataquay.server.tools.processes import DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (the etcd-server package; make tools)")

Stub = directory_pb2_grpc.DirectoryStub
#: Short leases, so that failure detection is seen within a test.
LEASE = ("--lease-seconds", "2", "--heartbeat-seconds", "0.5")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", members=3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def replicas(tmp_path: Path, etcd: EtcdCluster) -> Iterator[Callable[..., DirectoryProcess]]:
    """Starts directory replicas on ``etcd``, each with its own state dir."""
    started: list[DirectoryProcess] = []

    def start(*extra: str) -> DirectoryProcess:
        replica = DirectoryProcess(
            tmp_path / f"replica{len(started)}", ("--store", etcd.store_url, *LEASE, *extra)
        ).start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.kill()


@pytest.fixture
def stub_of() -> Iterator[Callable[[DirectoryProcess], Stub]]:
    channels: list[grpc.Channel] = []

    def make(replica: DirectoryProcess) -> Stub:
        channels.append(grpc.insecure_channel(replica.address, options=channel_options()))
        return Stub(channels[-1])

    yield make
    for channel in channels:
        channel.close()


def register(stub: Stub, name: str, port: int = 7000) -> dpb.RegisterNodeReply:
    node = jpb.NodeInfo(name=name, tcp_address=f"127.0.0.1:{port}", cache_capacity=1 << 30, pid=1, version="t")
    return stub.RegisterNode(dpb.RegisterNodeRequest(node=node, identity_key=name.encode().ljust(32, b"k")))


def states(stub: Stub) -> dict[str, int]:
    return {n.info.name: n.state for n in stub.ListNodes(dpb.ListNodesRequest()).nodes}


def beat(stub: Stub, name: str, session: int) -> bool:
    return stub.Heartbeat(dpb.HeartbeatRequest(name=name, session=session)).known


def join(stub: Stub, job: str, dataset: str = "") -> jpb.Job:
    spec = jpb.JobSpec(job_id=job, dataset=dataset, nodes=["n0", "n1"], seed=7) if dataset else jpb.JobSpec(job_id=job)
    return stub.JoinJob(jpb.JoinJobRequest(spec=spec))


@needs_etcd
def test_a_replica_killed_mid_job_leaves_nodes_jobs_and_failure_detection_to_the_other(
    tmp_path: Path,
    replicas: Callable[..., DirectoryProcess],
    stub_of: Callable[[DirectoryProcess], Stub],
    etcd: EtcdCluster,
) -> None:
    a, b = replicas(), replicas()
    sa, sb = stub_of(a), stub_of(b)
    root = make_files_dataset(tmp_path / "pfs" / "imgs", 20, sizes=(100, 200), classes=2)
    sessions = {name: register(sa, name, 7000 + i).session for i, name in enumerate(("n0", "n1"))}
    info = sa.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)))
    created = join(sa, "train", "imgs")
    manifest = b"".join(c.data for c in sa.GetManifest(pb.GetDatasetRequest(name="imgs")))

    a.kill()
    # B answers everything A was told: nodes, the job, the dataset, byte for byte.
    wait_until(lambda: states(sb) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_UP}, "B lists both nodes up", timeout=5)
    assert sb.GetJob(jpb.GetJobRequest(job_id="train")) == created
    assert sb.GetDataset(pb.GetDatasetRequest(name="imgs")).manifest_id == info.manifest_id
    assert b"".join(c.data for c in sb.GetManifest(pb.GetDatasetRequest(name="imgs"))) == manifest
    # A node that beats at B keeps its lease, on the session A handed out; one that stops goes down.
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert beat(sb, "n0", sessions["n0"])
        time.sleep(0.3)
    assert states(sb) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_DOWN}
    # The stopped node comes back by beating; a beat of another session renews nothing.
    assert beat(sb, "n1", sessions["n1"])
    assert states(sb)["n1"] == jpb.NODE_UP
    # Epochs and joins go on at B, and an etcd member killed (any one) changes nothing.
    etcd.kill(0)
    assert sb.ReportEpoch(jpb.ReportEpochRequest(job_id="train", epoch=1, node="n0")).epoch == 1
    assert join(sb, "train").epoch == 1
    # A replica started now, with a member gone, reads it all from etcd and takes beats.
    c = replicas()
    sc = stub_of(c)
    assert sc.GetJob(jpb.GetJobRequest(job_id="train")).epoch == 1
    assert all(beat(sc, name, session) for name, session in sessions.items())
    wait_until(lambda: states(sc) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_UP}, "C lists both nodes up", timeout=5)


@needs_etcd
def test_the_name_of_a_live_node_is_refused_at_every_replica(
    replicas: Callable[..., DirectoryProcess], stub_of: Callable[[DirectoryProcess], Stub]
) -> None:
    a, b = replicas(), replicas()
    register(stub_of(a), "n0")
    wait_until(lambda: "n0" in states(stub_of(b)), "B lists n0", timeout=5)
    impostor = jpb.NodeInfo(name="n0", tcp_address="127.0.0.1:9999")
    with pytest.raises(grpc.RpcError) as refused:
        stub_of(b).RegisterNode(dpb.RegisterNodeRequest(node=impostor, identity_key=b"x" * 32))
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "held by a live node at 127.0.0.1:7000" in (refused.value.details() or "")


@needs_etcd
def test_one_replica_expires_idle_jobs_and_another_takes_over_when_it_dies(
    replicas: Callable[..., DirectoryProcess], stub_of: Callable[[DirectoryProcess], Stub], tmp_path: Path
) -> None:
    a = replicas("--job-ttl", "2")
    wait_until(lambda: "leading the directory's periodic work" in a.log_path.read_text(), "A leads", timeout=5)
    b = replicas("--job-ttl", "2")
    assert "leading" not in b.log_path.read_text()
    register(stub_of(a), "n0")
    register(stub_of(a), "n1")
    root = make_files_dataset(tmp_path / "pfs" / "imgs", 4, sizes=(10, 20), classes=1)
    stub_of(a).AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)))
    a.kill()
    join(stub_of(b), "idle", "imgs")
    # The leader's lease (2 s) ends, B takes the key, and drops the idle job past its TTL (2 s).
    wait_until(lambda: not stub_of(b).ListJobs(jpb.ListJobsRequest()).jobs, "B drops the idle job", timeout=15)
    assert "leading the directory's periodic work" in b.log_path.read_text()


@needs_etcd
def test_an_etcd_outage_keeps_reads_and_beats_refuses_changes_and_recovers(
    replicas: Callable[..., DirectoryProcess],
    stub_of: Callable[[DirectoryProcess], Stub],
    etcd: EtcdCluster,
    tmp_path: Path,
) -> None:
    a, b = replicas(), replicas()
    sa, sb = stub_of(a), stub_of(b)
    sessions = {name: register(sa, name, 7000 + i).session for i, name in enumerate(("n0", "n1"))}
    root = make_files_dataset(tmp_path / "pfs" / "imgs", 8, sizes=(10, 20), classes=1)
    sa.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)))
    job = join(sa, "train", "imgs")
    wait_until(lambda: len(sb.ListJobs(jpb.ListJobsRequest()).jobs) == 1, "B lists the job", timeout=5)
    for index in range(3):
        etcd.kill(index)
    # Reads and beats go on at both replicas; a change fails at once, saying why.
    for stub in (sa, sb):
        assert stub.GetJob(jpb.GetJobRequest(job_id="train")) == job
        assert states(stub) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_UP}
        assert beat(stub, "n0", sessions["n0"])
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        join(sb, "other", "imgs")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "etcd store" in (refused.value.details() or "")
    assert time.monotonic() - started < 15
    # A dataset added meanwhile is refused, and not kept half-registered at the replica.
    more = make_files_dataset(tmp_path / "pfs2" / "more", 4, sizes=(10, 20), classes=1)
    with pytest.raises(grpc.RpcError) as refused:
        sb.AddDataset(pb.AddDatasetRequest(name="more", root=str(more)))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [d.name for d in sb.ListDatasets(pb.ListDatasetsRequest()).datasets] == ["imgs"]
    # The PFS is gone too: recovery reads nothing from it.
    for path in sorted(root.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    etcd.restart(0, 1, 2)
    wait_until(lambda: _joins(sb, "other"), "a join once etcd is back", timeout=20)
    # A learns of it through its watch on etcd, a moment after B wrote it.
    wait_until(
        lambda: "other" in {j.spec.job_id for j in sa.ListJobs(jpb.ListJobsRequest()).jobs}, "A has the job", timeout=5
    )
    assert sa.GetJob(jpb.GetJobRequest(job_id="other")).spec.dataset == "imgs"
    assert sb.AddDataset(pb.AddDatasetRequest(name="more", root=str(more))).num_samples == 4
    wait_until(lambda: len(sa.ListDatasets(pb.ListDatasetsRequest()).datasets) == 2, "A has the dataset", timeout=5)
    # Leases that ended while etcd was away come back with the next beats.
    for stub in (sa, sb):
        wait_until(
            lambda: all(beat(stub, n, s) for n, s in sessions.items()) and set(states(stub).values()) == {jpb.NODE_UP},
            "every node up again",
            timeout=10,
        )


def _joins(stub: Stub, job: str) -> bool:
    try:
        join(stub, job, "imgs")
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True


@pytest.mark.parametrize("store", ["etcd:/127.0.0.1:2379", "etcd://127.0.0.1", "redis://h:1", "etcd://a:1,b"])
def test_a_bad_store_url_exits_with_one_line(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["directory", "--store", store]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--store" in err[0] and "etcd://HOST:PORT" in err[0]


@needs_etcd
def test_nodes_beating_at_a_replica_share_its_one_etcd_lease_and_beats_write_nothing(
    replicas: Callable[..., DirectoryProcess], stub_of: Callable[[DirectoryProcess], Stub], etcd: EtcdCluster
) -> None:
    stub = stub_of(replicas())
    with grpc.insecure_channel(etcd.nodes[0].endpoint) as channel:
        kv, leases = etcd_rpc_pb2_grpc.KVStub(channel), etcd_rpc_pb2_grpc.LeaseStub(channel)

        def up_lease(name: str) -> int:
            return int(kv.Range(etcd_rpc_pb2.RangeRequest(key=f"dataquay/up/{name}".encode())).kvs[0].lease)

        sessions = {name: register(stub, name, 7000 + i).session for i, name in enumerate(("n0", "n1", "n2"))}
        for _ in range(5):  # a daemon whose registrations time out retries them
            sessions["n0"] = register(stub, "n0", 7000).session
        shared = up_lease("n0")
        assert shared and [up_lease("n1"), up_lease("n2")] == [shared, shared]
        # Beats for three leases renew the nodes' leases in the replica's memory: not one write to etcd.
        revision = kv.Range(etcd_rpc_pb2.RangeRequest(key=b"dataquay/up/n0")).header.revision
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert all(beat(stub, name, session) for name, session in sessions.items())
            time.sleep(0.3)
        assert kv.Range(etcd_rpc_pb2.RangeRequest(key=b"dataquay/up/n0")).header.revision == revision
        assert up_lease("n0") == shared
        assert leases.LeaseTimeToLive(etcd_rpc_pb2.LeaseTimeToLiveRequest(ID=shared)).TTL > 0
        assert states(stub) == {"n0": jpb.NODE_UP, "n1": jpb.NODE_UP, "n2": jpb.NODE_UP}
