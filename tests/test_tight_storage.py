"""Caches that hold little more than their node's share: the exchange fits in
the headroom, nothing is dropped, every epoch is read from the local caches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from rank_epochs import job_ranks, read_whole_epoch
from test_exchange import Nodes

from dataquay.client.job_settings import JobSettings
from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import JobPlan, owners
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import cache_need, node_shares
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.simulate import Scenario, simulate
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes
from dataquay.server.tools.trainers import RankGroup

NODES = 4
RANKS_PER_NODE = 2
SAMPLES = 1200
SIZES = (60_000, 80_000, 100_000)
JOB = "tight"


def payload(i: int) -> bytes:
    return sample_bytes(0, i, SIZES[i % len(SIZES)])


def largest_share(q: float, epochs: int) -> int:
    """The cache bytes of the largest share any node has in epochs 0..epochs."""
    settings = JobSettings(
        job_id=JOB, mode="partial", q=q, ranks_per_node=RANKS_PER_NODE, nodes=tuple(f"n{m}" for m in range(NODES))
    )
    plan = JobPlan(settings, num_samples=SAMPLES, num_nodes=NODES)
    sizes = np.array([SIZES[i % len(SIZES)] for i in range(SAMPLES)])
    return int(node_shares(plan, sizes, epochs + 1).max())


def capacity_needed(q: float, epochs: int) -> int:
    """What the sizing guide (docs/guides/sizing.md) asks of every node's cache for this job: 1.05 x the
    largest share, + 16 MiB."""
    return cache_need(largest_share(q, epochs), "partial", q)


def tight_cluster(cluster: Callable[..., LocalCluster], tmp_path: Path, q: float, capacity: int) -> LocalCluster:
    """4 daemons caching at most ``capacity`` each, "imgs" staged for a partial job."""
    local = cluster(NODES, daemon_args=("--cache-size", str(capacity), "--spare-copies-fill", "0"))
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                "--mode",
                "partial",
                "--q",
                str(q),
                "--ranks-per-node",
                str(RANKS_PER_NODE),
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    return local


def rank_group(local: LocalCluster, tmp_path: Path) -> RankGroup:
    return job_ranks(local, tmp_path, JOB, NODES * RANKS_PER_NODE, RANKS_PER_NODE, compute_seconds=0.002)


def read_epoch(group: RankGroup, epoch: int) -> dict[str, int]:
    """Epoch ``epoch`` read by every rank, each sample once with its bytes; the samples by tier."""
    tiers = read_whole_epoch(group, epoch, SAMPLES, payload)
    assert tiers["fallback"] == 0
    return tiers


@pytest.mark.parametrize(("q", "epochs"), [(1.0, 10), (0.5, 10), (0.1, 5)])
def test_a_cache_just_above_its_share_reads_every_epoch_locally_and_drops_nothing(
    cluster: Callable[..., LocalCluster], tmp_path: Path, q: float, epochs: int
) -> None:
    local = tight_cluster(cluster, tmp_path, q, capacity_needed(q, epochs))
    nodes = Nodes(local, JOB)
    manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
    plan = job_plan(nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True)), manifest)
    epoch_owners = owners(plan, 0)
    try:
        with rank_group(local, tmp_path) as group:
            for epoch in range(epochs):
                tiers = read_epoch(group, epoch)
                assert tiers["local"] == SAMPLES, (epoch, tiers)
                assert tiers["pfs"] == 0
                runs = nodes.wait_exchanged(epoch + 1)
                assert sum(r.refused_samples + r.unavailable_samples for r in runs) == 0
                epoch_owners = owners(plan, epoch + 1, epoch_owners)
                for m in range(NODES):
                    assert nodes.holds(m, np.flatnonzero(epoch_owners == m)).all()
        stats = nodes.stats()
        assert [s.inserts_dropped for s in stats] == [0] * NODES
        assert all(s.cache_used_bytes <= s.cache_capacity_bytes for s in stats)
    finally:
        nodes.close()


def test_a_cache_short_of_its_share_reads_a_level_deficit_from_the_pfs(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    epochs = 8
    capacity = int(0.75 * largest_share(0.5, epochs))
    local = tight_cluster(cluster, tmp_path, 0.5, capacity)
    nodes = Nodes(local, JOB)
    pfs_reads = []
    try:
        with rank_group(local, tmp_path) as group:
            for epoch in range(epochs):
                pfs_reads.append(read_epoch(group, epoch)["pfs"])
        stats = nodes.stats()
        assert all(s.cache_used_bytes <= s.cache_capacity_bytes for s in stats)
    finally:
        nodes.close()
    # A quarter of the share does not fit: it is read from the PFS every epoch,
    # about as much each time, never a growing share: before, it went 20, 89,
    # 142, 167 in a run like this. simulate predicts it: on a quiet machine
    # with 6 s epochs within a few percent (docs/results.md); in these epochs of
    # about a second the exchange falls behind the ranks and gives some
    # samples up (about 1.2x on an idle machine), with room for a loaded one.
    settings = JobSettings(
        job_id=JOB,
        mode="partial",
        q=0.5,
        ranks_per_node=RANKS_PER_NODE,
        batch_size=16,
        nodes=tuple(f"n{m}" for m in range(NODES)),
    )
    scenario = Scenario(JobPlan(settings, num_samples=SAMPLES, num_nodes=NODES), int(np.mean(SIZES)), capacity)
    predicted = [t.pfs_bytes // int(np.mean(SIZES)) for t in simulate(scenario, epochs)][1:]
    steady = np.array(pfs_reads[1:])
    assert 0.95 * np.mean(predicted) <= steady.mean() <= 1.45 * np.mean(predicted), (pfs_reads, predicted)
    assert steady[-3:].mean() <= 1.3 * steady[:3].mean(), pfs_reads
