"""Data larger than the caches: what a node owns and could not cache is read
from the PFS ahead of its ranks, in their order, within the prefetch memory,
and handed over when they ask; real daemons whose caches hold part of their share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from polling import wait_until

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import JobPlan, node_orders, owners
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import CHECKSUM_BYTES
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.limits import ByteBudget
from dataquay.server.node.reads.overflow import epoch_reads
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

NODES = 2
RANKS = 2
SAMPLES = 256  # no rank pads in any mode: 4 ranks x 8 steps of 8
SIZES = (2000, 3100, 4500)
BATCH = 8
JOB = "big"
#: Holds part of a node's share of the dataset (a third to a half).
CACHE = "320K"


def sample_payload(i: int) -> bytes:
    return sample_bytes(0, i, SIZES[i % len(SIZES)])


class Node:
    """A node of a staged cluster, as its ranks and a test see it.

    Without ``job`` it joins the job, as a rank would, which starts its prefetch.
    """

    def __init__(self, local: LocalCluster, index: int = 0, job: jpb.Job | None = None) -> None:
        ready = local.daemons[index].ready
        assert ready is not None
        self.index = index
        self.channel = grpc.insecure_channel(ready["tcp"], options=channel_options())
        self.stub = cache_pb2_grpc.CacheStub(self.channel)
        manifest = Manifest(b"".join(c.data for c in self.stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
        self.lengths = manifest.sample_length
        if job is None:
            job = self.stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
        self.job = job
        self.plan: JobPlan = job_plan(job, manifest)

    def close(self) -> None:
        self.channel.close()

    def stats(self) -> pb.StatsReply:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)

    def holds(self, ids: np.ndarray) -> np.ndarray:
        request = pb.ReadRequest(dataset="imgs", ids=ids.tolist(), peer=True)
        got = {s.id: not s.missing for chunk in self.stub.Read(request) for s in chunk.samples}
        return np.array([got[i] for i in ids.tolist()], dtype=bool)

    def overflow(self, epoch: int, before: int | None = None) -> np.ndarray:
        """What this node's ranks read in ``epoch`` that it owns (and owned in
        ``before``) and does not hold."""
        ids = np.unique(node_orders(self.plan, epoch, self.index))
        mine = owners(self.plan, epoch)[ids] == self.index
        if before is not None:
            mine &= owners(self.plan, before)[ids] == self.index
        ids = ids[mine]
        return ids[~self.holds(ids)]

    def read_epoch(self, epoch: int) -> list[pb.Sample]:
        """This node's ranks read ``epoch`` as their clients would: batch by
        batch, each asking its daemon for what the cache does not hold."""
        orders = node_orders(self.plan, epoch, self.index)
        served: list[pb.Sample] = []
        for start in range(0, orders.shape[1], BATCH):
            for rank_order in orders:
                ids = rank_order[start : start + BATCH]
                misses = ids[~self.holds(ids)]
                if len(misses):
                    served += self.read(misses)
        return served

    def read(self, ids: np.ndarray) -> list[pb.Sample]:
        request = pb.ReadRequest(dataset="imgs", ids=ids.tolist(), job=JOB)
        samples = [s for chunk in self.stub.Read(request, timeout=30) for s in chunk.samples]
        assert [s.data for s in samples] == [sample_payload(i) for i in ids.tolist()]
        return samples

    def nbytes(self, ids: np.ndarray) -> int:
        return int(self.lengths[ids].sum())


def staged(
    cluster: Callable[..., LocalCluster], tmp_path: Path, job_args: list[str], *daemon_args: str, restart: bool = True
) -> tuple[LocalCluster, Path]:
    """A cluster whose caches hold part of their share of "imgs", staged for
    JOB; node 0 restarted since (unless not to), so that its PFS counters
    count no staging and it has not begun reading ahead."""
    local = cluster(NODES, daemon_args=("--cache-size", CACHE, *daemon_args))
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                *job_args,
                "--ranks-per-node",
                str(RANKS),
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    if restart:
        local.restart_node(0)
    return local, root


@pytest.mark.parametrize("mode", ["local", "partial", "global", "locality"])
def test_the_overflow_is_prefetched_and_served_from_memory_once_each(
    cluster: Callable[..., LocalCluster], tmp_path: Path, mode: str
) -> None:
    settings = ["--mode", mode, "--batch-size", str(BATCH)] + (["--q", "0.5"] if mode == "partial" else [])
    local, _ = staged(cluster, tmp_path, settings)
    node = Node(local)
    try:
        overflow = node.overflow(0)
        share = int((owners(node.plan, 0) == 0).sum())
        assert 0 < len(overflow) < share
        # The next epoch's overflow, except what moves in by the exchange.
        upcoming = node.overflow(1, before=0)
        # What node 0's ranks read from node 1 that node 1 could not cache
        # either: node 0 reads it from the PFS when asked.
        peer = Node(local, 1, node.job)
        foreign = np.unique(node_orders(node.plan, 0, 0))
        foreign = foreign[owners(node.plan, 0)[foreign] == 1]
        foreign = foreign[~peer.holds(foreign)] if len(foreign) else foreign
        peer.close()
        # Joining the job started the prefetch: epoch 0, then epoch 1.
        wait_until(
            lambda: node.stats().prefetch.overflow_read_samples == len(overflow) + len(upcoming),
            "the overflow of epochs 0 and 1 was prefetched",
            poll=0.1,
        )
        served = node.read_epoch(0)
        mine = [s for s in served if s.id in set(overflow.tolist())]
        assert len(mine) == len(overflow) and {s.tier for s in mine} == {pb.TIER_PFS}
        stats = node.stats()
        ahead = stats.prefetch
        assert ahead.overflow_served_samples == len(overflow)
        assert ahead.overflow_served_bytes == node.nbytes(overflow)
        assert ahead.overflow_wasted_samples == 0 and ahead.overflow_failed_samples == 0
        # Each sample came from the PFS once: none was read again on demand.
        read = node.nbytes(overflow) + node.nbytes(upcoming) + node.nbytes(foreign)
        assert stats.pfs_bytes == read
        # Epoch 1's overflow is held (with, under global and locality, its first transfers).
        assert ahead.overflow_read_bytes - ahead.overflow_served_bytes == node.nbytes(upcoming)
        assert ahead.held_bytes >= node.nbytes(upcoming) + CHECKSUM_BYTES * len(upcoming)
    finally:
        node.close()


def test_prefetch_memory_stays_within_its_budget_across_epochs(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    budget = 24 << 10  # a few samples: the ranks catch up and read some on demand
    local, _ = staged(cluster, tmp_path, ["--mode", "local"], "--prefetch-memory", str(budget))
    node = Node(local)
    try:
        from_pfs = 0
        for epoch in range(3):
            node.stub.ReportEpoch(jpb.ReportEpochRequest(job_id=JOB, epoch=epoch), timeout=10)
            from_pfs += sum(len(s.data) for s in node.read_epoch(epoch) if s.tier == pb.TIER_PFS)
        got: list[pb.StatsReply] = []

        def settled() -> bool:
            """Whether the memory in use is all held samples: no prefetch in flight."""
            got[:] = [node.stats()]
            a = got[0].prefetch
            held = a.overflow_read_samples - a.overflow_served_samples - a.overflow_wasted_samples
            return a.held_bytes == (
                a.overflow_read_bytes - a.overflow_served_bytes - a.overflow_wasted_bytes + CHECKSUM_BYTES * held
            )

        wait_until(settled, "no prefetch in flight", poll=0.05)
        stats = got[0]
        ahead = stats.prefetch
        assert ahead.memory_bytes == budget
        assert 0 < ahead.peak_bytes <= budget and ahead.held_bytes <= budget
        assert ahead.overflow_wasted_samples == 0
        assert ahead.overflow_served_samples > 0
        # Every sample the ranks got from the PFS was read there once (ahead
        # or on demand); beyond them, the head of epoch 3 is held.
        held = ahead.overflow_read_bytes - ahead.overflow_served_bytes
        assert stats.pfs_bytes == from_pfs + held
    finally:
        node.close()


def test_a_rank_asking_out_of_order_is_still_served_from_what_was_prefetched(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    budget = 24 << 10
    local, _ = staged(cluster, tmp_path, ["--mode", "local"], "--prefetch-memory", str(budget))
    node = Node(local)
    try:
        # What fits in the overflow's share of the budget, in the ranks' order, is read first.
        orders = node_orders(node.plan, 0, 0)
        in_order = orders.T.ravel()
        ahead = in_order[~node.holds(in_order)]
        fits = np.cumsum(node.lengths[ahead] + CHECKSUM_BYTES) <= int(budget * 0.75)
        first = ahead[: int(fits.sum())]
        wait_until(lambda: node.stats().prefetch.overflow_read_samples == len(first), "the budget was filled", poll=0.1)
        # Rank 0's second batch of 4 comes before its first, as from two loader workers.
        wanted = []
        for batch in (orders[0, 4:8], orders[0, 0:4]):
            misses = batch[~node.holds(batch)]
            node.read(misses)
            wanted += [i for i in misses.tolist() if i in set(first.tolist())]
        ahead_stats = node.stats().prefetch
        assert wanted and ahead_stats.overflow_served_samples >= len(wanted)
        assert ahead_stats.overflow_wasted_samples == 0
    finally:
        node.close()


def test_the_next_epoch_leaves_what_just_moved_in_to_the_exchange_until_it_begins(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    # An exchange capped at 1 byte/s delivers nothing: what moves in stays uncached.
    local, _ = staged(cluster, tmp_path, ["--mode", "partial", "--q", "0.5"], "--exchange-bandwidth", "1")
    node = Node(local)
    try:
        first = len(node.overflow(0)) + len(node.overflow(1, before=0))
        wait_until(
            lambda: node.stats().prefetch.overflow_read_samples == first, "epochs 0 and 1 were prefetched", poll=0.1
        )
        node.stub.ReportEpoch(jpb.ReportEpochRequest(job_id=JOB, epoch=1), timeout=10)
        stay = node.overflow(2, before=1)
        arrived = stay[owners(node.plan, 0)[stay] != 0]  # moved in at epoch 1
        assert 0 < len(arrived) < len(stay)
        # While the ranks are on epoch 1, epoch 2's prefetch leaves them to the exchange.
        wait_until(
            lambda: node.stats().prefetch.overflow_read_samples == first + len(stay) - len(arrived),
            "epoch 2 was prefetched, what arrived at epoch 1 left out",
            poll=0.1,
        )
        node.stub.ReportEpoch(jpb.ReportEpochRequest(job_id=JOB, epoch=2), timeout=10)
        # Now they are read too (before anything of epoch 3).
        wait_until(
            lambda: node.stats().prefetch.overflow_read_samples >= first + len(stay),
            "what arrived at epoch 1 was prefetched once epoch 2 began",
            poll=0.1,
        )
        served = node.read(stay)
        assert {s.tier for s in served} == {pb.TIER_PFS}
        assert node.stats().prefetch.overflow_served_samples == len(stay)
    finally:
        node.close()


def test_staging_for_a_job_hands_what_did_not_fit_to_the_prefetch(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local, _ = staged(cluster, tmp_path, ["--mode", "local"], restart=False)
    other = Node(local, 1)
    node = Node(local, 0, other.job)  # no rank has joined on node 0
    try:
        overflow = node.overflow(0)
        # Epochs 0 and 1 (local: the same samples) are read before any rank asks.
        wait_until(
            lambda: node.stats().prefetch.overflow_read_samples == 2 * len(overflow),
            "the overflow was prefetched once staging ended",
            poll=0.1,
        )
        node.stub.ReportEpoch(jpb.ReportEpochRequest(job_id=JOB, epoch=0), timeout=10)
        assert {s.tier for s in node.read_epoch(0)} == {pb.TIER_PFS}
        assert node.stats().prefetch.overflow_served_samples == len(overflow)
    finally:
        node.close()
        other.close()


def test_a_sample_changed_on_the_pfs_since_its_manifest_is_not_served(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local, root = staged(cluster, tmp_path, ["--mode", "local"])
    other = Node(local, 1)
    node = Node(local, 0, other.job)  # it has not joined: it reads nothing ahead yet
    try:
        overflow = node.overflow(0)
        changed = int(overflow[len(overflow) // 2])
        path = next(root.glob(f"*/{changed:08d}.bin"))
        path.write_bytes(bytes(len(sample_payload(changed))))  # same size, new content and mtime
        node.stub.ReportEpoch(jpb.ReportEpochRequest(job_id=JOB, epoch=0), timeout=10)  # starts reading ahead
        # Epochs 0 and 1 were prefetched (local: the same samples), the changed one refused in each.
        wait_until(
            lambda: node.stats().prefetch.overflow_read_samples == 2 * (len(overflow) - 1),
            "the rest was prefetched",
            poll=0.1,
        )
        assert node.stats().prefetch.overflow_failed_samples == 2
        others = overflow[overflow != changed]
        assert len(node.read(others)) == len(others)
        with pytest.raises(grpc.RpcError) as refused:
            node.read(np.array([changed]))
        assert "changed since the dataset was registered" in (refused.value.details() or "")
        assert node.stats().prefetch.overflow_served_samples == len(others)
    finally:
        node.close()
        other.close()


def test_epoch_reads_are_in_the_ranks_order_and_only_the_nodes_own() -> None:
    orders = np.array([[5, 1, 9, 2], [7, 3, 5, 8]])  # 2 ranks; 5 is read twice
    epoch_owners = np.array([0, 0, 1, 0, 1, 0, 1, 0, 0, 0])  # 2 is another node's
    reads = epoch_reads(orders, epoch_owners, 0, None)
    assert reads.ids.tolist() == [1, 2, 3, 5, 7, 8, 9] and reads.positions == 4
    assert reads.slots.tolist() == [2, 6, 3, 0, 1, 7, 4]  # position * 2 + rank, first time read
    assert reads.ids[reads.ahead].tolist() == [5, 7, 1, 3, 9, 8]
    assert reads.slots[reads.ahead].tolist() == [0, 1, 2, 3, 4, 7]
    assert not reads.arrived.any()
    before = np.array([0, 1, 1, 0, 1, 0, 1, 0, 0, 0])  # 1 moved in: the exchange brings it
    assert reads.ids[epoch_reads(orders, epoch_owners, 0, before).ahead].tolist() == [5, 7, 3, 9, 8]
    two_before = np.array([0, 1, 1, 0, 1, 1, 1, 0, 0, 1])  # 5 and 9 moved in at the epoch before
    arrived = epoch_reads(orders, epoch_owners, 0, before, two_before).arrived
    assert reads.ids[arrived].tolist() == [5, 9]


def test_the_budget_reserves_within_a_share_and_wakes_its_waiters() -> None:
    async def run() -> None:
        budget = ByteBudget(100)
        assert budget.reserve(60, share=0.75) and not budget.reserve(20, share=0.75) and budget.reserve(40)
        assert (budget.held, budget.peak, budget.room()) == (100, 100, 0)
        waiting = asyncio.ensure_future(budget.changed(timeout=30))
        await asyncio.sleep(0)
        budget.give(60)
        await waiting
        assert (budget.held, budget.peak, budget.room(0.75)) == (40, 100, 35)

    asyncio.run(run())
