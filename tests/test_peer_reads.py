"""Daemons in a cluster: datasets from the directory, staging of owned samples
only, misses served by their owners, and owners that die or never had the
dataset. Real directory and daemon processes on loopback, real files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset, make_npy_dataset, sample_bytes

N = 90
SIZE = 3000
NODES = ("n0", "n1", "n2")


class Cluster:
    def __init__(self, directory: DirectoryProcess, daemons: list[DaemonProcess]) -> None:
        self.directory = directory
        self.daemons = daemons
        self._channels = [grpc.insecure_channel(grpc_target(d.address), options=channel_options()) for d in daemons]
        self.stubs = [cache_pb2_grpc.CacheStub(c) for c in self._channels]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        for process in [*self.daemons, self.directory]:
            process.kill()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    directory = DirectoryProcess(tmp_path / "directory").start()
    daemons = [
        DaemonProcess(
            tmp_path / name, ("--directory", directory.address, "--node-name", name, "--peer-timeout", "2")
        ).start()
        for name in NODES
    ]
    started = Cluster(directory, daemons)
    yield started
    started.close()


@pytest.fixture
def payloads(tmp_path: Path) -> list[bytes]:
    make_files_dataset(tmp_path / "pfs" / "imgs", N, sizes=(SIZE,), classes=3)
    return [sample_bytes(0, i, SIZE) for i in range(N)]


def read(stub: cache_pb2_grpc.CacheStub, ids: list[int], job: str = "", peer: bool = False) -> list[pb.Sample]:
    request = pb.ReadRequest(dataset="imgs", ids=ids, job=job, peer=peer)
    return [s for chunk in stub.Read(request) for s in chunk.samples]


def join(stub: cache_pb2_grpc.CacheStub, job: str = "j1", **fields: object) -> jpb.Job:
    return stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job, dataset="imgs", **fields)))


def stage(stub: cache_pb2_grpc.CacheStub, job: str = "j1") -> pb.StageProgress:
    *_, last = stub.Stage(pb.StageRequest(dataset="imgs", job=job))
    return last


def owner_of(stub: cache_pb2_grpc.CacheStub, job: jpb.Job) -> np.ndarray:
    manifest = Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
    return owners(job_plan(job, manifest), 0)


def registered(cluster: Cluster, tmp_path: Path) -> jpb.Job:
    """Registers the dataset through node 0 and starts job j1 on all nodes."""
    stubs = cluster.stubs
    stubs[0].AddDataset(pb.AddDatasetRequest(name="imgs", root=str(tmp_path / "pfs" / "imgs")))
    return join(stubs[0])


def test_each_node_stages_what_it_owns_and_misses_come_from_the_owners(
    cluster: Cluster, payloads: list[bytes], tmp_path: Path
) -> None:
    job = registered(cluster, tmp_path)
    assert list(job.spec.nodes) == list(NODES) and job.num_samples == N
    stubs = cluster.stubs
    owner = owner_of(stubs[1], job)
    for m, stub in enumerate(stubs):
        progress = stage(stub)
        assert not progress.error and progress.node == NODES[m]
        assert progress.done_samples == progress.total_samples == int((owner == m).sum())
        assert stub.Stats(pb.StatsRequest()).cache_entries == progress.total_samples
    pfs_after_staging = [s.Stats(pb.StatsRequest()).pfs_bytes for s in stubs]

    ids = np.random.default_rng(1).permutation(N).tolist()
    for m, stub in enumerate(stubs):
        samples = read(stub, ids, job="j1")
        assert [s.id for s in samples] == ids
        assert [s.data for s in samples] == [payloads[i] for i in ids]
        assert all(s.checksum == checksum(s.data) for s in samples)
        assert [s.tier for s in samples] == [pb.TIER_CACHE if owner[i] == m else pb.TIER_PEER for i in ids]
    stats = [s.Stats(pb.StatsRequest()) for s in stubs]
    assert [s.pfs_bytes for s in stats] == pfs_after_staging
    for m, s in enumerate(stats):
        tiers = {t.tier: t.samples for t in s.reads}
        assert tiers[pb.TIER_PEER] == N - int((owner == m).sum())
        assert tiers[pb.TIER_PFS] == 0
        assert {p.node for p in s.peers} == set(NODES) - {NODES[m]}
    for daemon in cluster.daemons:
        assert "renewing the lease by RPC" not in daemon.log_path.read_text(), "heartbeat datagrams were lost"


def test_a_peer_serves_only_its_cache_and_flags_the_rest(
    cluster: Cluster, payloads: list[bytes], tmp_path: Path
) -> None:
    job = registered(cluster, tmp_path)
    stubs = cluster.stubs
    listed = stubs[2].ListDatasets(pb.ListDatasetsRequest()).datasets
    assert [(d.name, d.num_samples, d.cached_samples) for d in listed] == [("imgs", N, 0)]
    owner = owner_of(stubs[0], job)
    stage(stubs[1])
    samples = read(stubs[1], list(range(N)), peer=True)
    assert [s.missing for s in samples] == [owner[i] != 1 for i in range(N)]
    assert all(s.data == payloads[s.id] for s in samples if not s.missing)
    assert stubs[1].Stats(pb.StatsRequest()).pfs_bytes == int((owner == 1).sum()) * SIZE

    with pytest.raises(grpc.RpcError) as unknown:
        stubs[1].Read(pb.ReadRequest(dataset="nope", ids=[0], peer=True)).next()
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.value.details()


def test_a_dead_owner_is_read_from_the_pfs_and_set_aside(
    cluster: Cluster, payloads: list[bytes], tmp_path: Path
) -> None:
    job = registered(cluster, tmp_path)
    stubs = cluster.stubs
    owner = owner_of(stubs[0], job)
    for stub in stubs:
        stage(stub)
    cluster.daemons[1].kill()

    ids = list(range(N))
    for _ in range(2):
        samples = read(stubs[0], ids, job="j1")
        assert [s.data for s in samples] == payloads
        assert [s.tier for s in samples] == [
            pb.TIER_CACHE if owner[i] == 0 else pb.TIER_PEER if owner[i] == 2 else pb.TIER_PFS for i in ids
        ]
    stats = stubs[0].Stats(pb.StatsRequest())
    assert stats.cache_entries == int((owner == 0).sum()), "a non-owner cached what it read"
    dead = next(p for p in stats.peers if p.node == "n1")
    assert dead.suspect and dead.failures >= 1


def test_reads_go_on_while_the_directory_is_down(cluster: Cluster, payloads: list[bytes], tmp_path: Path) -> None:
    registered(cluster, tmp_path)
    stubs = cluster.stubs
    for stub in stubs:
        stage(stub)
    assert read(stubs[0], [0], job="j1")[0].data == payloads[0]
    cluster.directory.kill()
    samples = read(stubs[0], list(range(N)), job="j1")
    assert [s.data for s in samples] == payloads
    assert {s.tier for s in samples} == {pb.TIER_CACHE, pb.TIER_PEER}


def test_job_errors_get_clear_status_codes(
    cluster: Cluster, payloads: list[bytes], tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    registered(cluster, tmp_path)
    stub = cluster.stubs[2]
    with pytest.raises(grpc.RpcError) as unknown:
        read(stub, [0], job="no-such-job")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-job" in unknown.value.details()
    with pytest.raises(grpc.RpcError) as mismatch:
        join(stub, seed=7)
    assert mismatch.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "seed" in mismatch.value.details()
    with pytest.raises(grpc.RpcError) as bad_mode:
        join(stub, job="j2", mode="sideways")
    assert bad_mode.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sideways" in bad_mode.value.details()
    assert read(stub, [3], job="j1")[0].data == payloads[3]

    standalone = start_daemon(name="alone")
    with grpc.insecure_channel(grpc_target(standalone.address), options=channel_options()) as channel:
        with pytest.raises(grpc.RpcError) as no_directory:
            join(cache_pb2_grpc.CacheStub(channel))
    assert no_directory.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--directory" in no_directory.value.details()


def test_shard_partition_stages_whole_files_and_serves_them_to_peers(cluster: Cluster, tmp_path: Path) -> None:
    root = make_npy_dataset(tmp_path / "pfs" / "frames", 120, record_shape=(32,), files=6)
    records = np.concatenate([np.load(path) for path in sorted(root.glob("*.npy"))])
    stubs = cluster.stubs
    stubs[0].AddDataset(pb.AddDatasetRequest(name="frames", root=str(root)))
    job = stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="s1", dataset="frames", partition="shard")))
    manifest = Manifest(b"".join(c.data for c in stubs[0].GetManifest(pb.GetDatasetRequest(name="frames"))))
    owner = owners(job_plan(job, manifest), 0)
    files = manifest.shard_groups()
    for group in np.unique(files):
        assert len(set(owner[files == group].tolist())) == 1, "a file was split between nodes"

    for m, stub in enumerate(stubs):
        *_, last = stub.Stage(pb.StageRequest(dataset="frames", job="s1"))
        assert last.done_samples == int((owner == m).sum()) and not last.error
    ids = list(range(120))
    samples = [s for chunk in stubs[2].Read(pb.ReadRequest(dataset="frames", ids=ids, job="s1")) for s in chunk.samples]
    assert [s.data for s in samples] == [records[i].tobytes() for i in ids]
    assert {s.tier for s in samples} <= {pb.TIER_CACHE, pb.TIER_PEER}


def test_a_partial_job_serves_the_right_bytes_after_owners_move(
    cluster: Cluster, payloads: list[bytes], tmp_path: Path
) -> None:
    stubs = cluster.stubs
    stubs[0].AddDataset(pb.AddDatasetRequest(name="imgs", root=str(tmp_path / "pfs" / "imgs")))
    job = join(stubs[0], job="p1", mode="partial", q=0.5, ranks_per_node=1)
    for stub in stubs:
        stage(stub, job="p1")
    manifest = Manifest(b"".join(c.data for c in stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
    plan = job_plan(job, manifest)
    assert (owners(plan, 1) != owners(plan, 0)).any()
    stubs[0].ReportEpoch(jpb.ReportEpochRequest(job_id="p1", epoch=1))
    samples = read(stubs[0], list(range(N)), job="p1")
    assert [s.data for s in samples] == payloads
    # No rank reports read positions here, so the exchange into epoch 2, which
    # starts as the node enters epoch 1, may already have given away what
    # leaves in epoch 2: only what stays through epoch 2 is sure to be cached.
    kept = (owners(plan, 0) == 0) & (owners(plan, 1) == 0) & (owners(plan, 2) == 0)
    assert kept.any() and all(s.tier == pb.TIER_CACHE for s in samples if kept[s.id])
