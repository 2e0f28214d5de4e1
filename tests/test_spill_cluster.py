"""Caches of unequal capacity, each filled: a node short of its share spills
the rest to nodes with room, whose ranks' epochs then read no PFS."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from polling import wait_until
from rank_epochs import job_ranks, read_whole_epoch
from test_exchange import Nodes

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import cached_bytes
from dataquay.server.planning.spill import NO_HOLDER, spill_holders
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes
from dataquay.server.tools.trainers import RankGroup

NODES = 4
RANKS_PER_NODE = 2
SAMPLES = 400
SIZES = (20_000, 30_000, 40_000)
JOB = "spill"
#: Node 0's cache against its share; the others have three shares' room.
SMALL, LARGE = 0.4, 3.0


def payload(i: int) -> bytes:
    return sample_bytes(0, i, SIZES[i % len(SIZES)])


def share_bytes() -> int:
    """What a node's share of a quarter of the samples takes in its cache."""
    sizes = np.array([SIZES[i % len(SIZES)] for i in range(SAMPLES)])
    return cached_bytes(sizes[: SAMPLES // NODES])


def listed_capacities(local: LocalCluster) -> dict[str, int]:
    nodes = local.wait_for_nodes(up=[node_name(m) for m in range(NODES)])
    return {n.info.name: n.info.cache_capacity for n in nodes}


def unequal_cluster(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[LocalCluster, list[int], str, str]:
    """4 daemons, node 0's cache well below its share, "imgs" staged for a ``local`` job."""
    share = share_bytes()
    capacities = [int(SMALL * share)] + [int(LARGE * share)] * (NODES - 1)
    local = cluster(NODES, daemon_args=("--cache-size", str(capacities[1])))
    local.restart_node(0, extra_args=("--cache-size", str(capacities[0])))
    wait_until(lambda: listed_capacities(local).get(node_name(0)) == capacities[0], "node 0 listed with its new cache")
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[1].address]) == 0
    capsys.readouterr()
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                "--mode",
                "local",
                "--ranks-per-node",
                str(RANKS_PER_NODE),
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    return local, capacities, out.out, out.err


def test_a_small_cache_spills_its_overflow_to_caches_with_room_and_no_epoch_reads_the_pfs(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local, capacities, out, err = unequal_cluster(cluster, tmp_path, capsys)
    nodes = Nodes(local, JOB)
    manifest = Manifest(b"".join(c.data for c in nodes.stubs[1].GetManifest(pb.GetDatasetRequest(name="imgs"))))
    job = nodes.stubs[1].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
    epoch_owners = owners(job_plan(job, manifest), 0)
    holders = spill_holders(epoch_owners, manifest.sample_length.astype(np.int64), capacities, job.spec.seed)
    spilled = int((holders != epoch_owners).sum())
    assert (holders != NO_HOLDER).all()
    assert spilled == int((epoch_owners == 0).sum() - (holders == 0).sum()) > SAMPLES // NODES // 2
    assert f"the {NODES} caches together hold the dataset: {spilled} samples that do not fit" in err
    assert f"{SAMPLES}/{SAMPLES} samples cached" in out
    assert f"{spilled} samples of nodes whose caches are short are held by nodes with room" in out
    assert cli_main(["status", "--addr", local.daemons[1].address]) == 0
    taken = int((holders == 1).sum())
    status = capsys.readouterr().out
    assert f"'imgs': {taken}/{taken} samples, {spilled} of them for nodes whose caches are short" in status
    try:
        with rank_group(local, tmp_path) as group:
            for epoch in range(3):
                tiers = read_epoch(group, epoch)
                # Before spilling, node 0's overflow (63 samples) was read from the PFS every epoch.
                assert tiers["pfs"] == 0 and tiers["fallback"] == 0, (epoch, tiers)
                assert tiers["peer"] == spilled, (epoch, tiers)
        stats = nodes.stats()
        assert all(s.cache_used_bytes <= s.cache_capacity_bytes for s in stats)
        assert [s.cache_entries for s in stats] == [int((holders == m).sum()) for m in range(NODES)]
        assert stats[0].prefetch.overflow_read_samples == 0
    finally:
        nodes.close()


def test_a_spill_holder_down_leaves_its_part_to_the_pfs(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local, _, out, _ = unequal_cluster(cluster, tmp_path, capsys)
    spilled = spilled_to_node_1(out)
    local.kill_node(1)
    # Node 1's ranks need not wait out connect's timeout for a daemon known to be gone.
    waits = [10.0 if r // RANKS_PER_NODE != 1 else 0.5 for r in range(NODES * RANKS_PER_NODE)]
    with rank_group(local, tmp_path, waits) as group:
        tiers = read_epoch(group, 0)
    # Node 1's own ranks read straight from the PFS (its daemon is gone); node 0's reads what node 1 held.
    assert tiers["fallback"] == SAMPLES // NODES
    assert tiers["pfs"] == spilled and tiers["peer"] == 0, tiers


def test_a_node_restarted_with_room_for_its_share_reads_its_overflow_once_and_keeps_it(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local, capacities, out, _ = unequal_cluster(cluster, tmp_path, capsys)
    spilled = spilled_to_node_1(out)
    local.restart_node(0, extra_args=("--cache-size", str(capacities[1])))
    wait_until(lambda: listed_capacities(local).get(node_name(0)) == capacities[1], "node 0 listed with its new cache")
    nodes = Nodes(local, JOB)
    try:
        with rank_group(local, tmp_path) as group:
            # Node 0 holds its whole share now: what node 1 held for it is read, and cached, once.
            tiers = read_epoch(group, 0)
            assert tiers["pfs"] == spilled and tiers["peer"] == 0, tiers
            wait_until(lambda: nodes.stats()[0].cache_entries == SAMPLES // NODES, "node 0 caches its share")
            tiers = read_epoch(group, 1)
            assert tiers["local"] == SAMPLES, tiers
    finally:
        nodes.close()


def spilled_to_node_1(stage_output: str) -> int:
    """The samples node 1 holds for others, as ``stage --job`` reports them."""
    row = next(line.split() for line in stage_output.splitlines() if line.startswith(node_name(1)))
    return int(row[-2])


def rank_group(local: LocalCluster, tmp_path: Path, connect_timeouts: list[float] | None = None) -> RankGroup:
    return job_ranks(
        local,
        tmp_path,
        JOB,
        NODES * RANKS_PER_NODE,
        RANKS_PER_NODE,
        compute_seconds=0.0,
        connect_timeouts=connect_timeouts,
    )


def read_epoch(group: RankGroup, epoch: int) -> dict[str, int]:
    return read_whole_epoch(group, epoch, SAMPLES, payload)
