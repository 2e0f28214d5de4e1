"""The exchange's ledger and the daemon's saved owner arrays: pure parts, no daemon."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.client.jobs import job_plan, job_spec
from dataquay.client.placement import JobPlan, node_orders, owner_read_positions, owners
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.manifest_build import build_manifest
from dataquay.server.node.cluster.placements import Placement, Placements
from dataquay.server.node.exchange.outbox import PENDING, REFUSED, SCAN_ROWS, UNAVAILABLE, Outbox, acknowledged
from dataquay.server.node.exchange.positions import WHOLE_EPOCH, ReadPositions
from dataquay.server.node.exchange.sender import due_positions
from dataquay.server.registry import Registry
from dataquay.server.tools.synthetic import make_files_dataset


def outbox() -> Outbox:
    ids = np.array([9, 3, 7, 1, 5, 2])
    receivers = np.array([1, 2, 1, 2, 1, 2])
    sizes = np.array([10, 20, 30, 40, 50, 60])
    return Outbox(ids, receivers, sizes)


def test_take_hands_out_each_receivers_ids_in_order_within_the_byte_budget() -> None:
    box = outbox()
    assert box.receivers_left() == [1, 2]
    assert box.take(1, max_bytes=40, max_items=10).tolist() == [5]  # 50 bytes: over, but one always goes
    assert box.take(1, max_bytes=35, max_items=10).tolist() == [7]
    assert box.take(1, max_bytes=100, max_items=10).tolist() == [9]
    assert box.take(1, max_bytes=100, max_items=10).tolist() == []
    offered, upto = box.offer(2, max_items=2)
    assert offered.tolist() == [1, 2]
    assert box.take(2, max_bytes=1000, max_items=5, upto=upto).tolist() == [1, 2]
    assert box.take(2, max_bytes=1000, max_items=5, upto=upto).tolist() == []
    assert box.pending(2).tolist() == [3]


def test_only_acknowledged_ids_count_as_delivered_and_a_broken_stream_gives_back_the_rest() -> None:
    box = outbox()
    held_before = box.delivered([1], sent=False)
    assert held_before == 0
    chunk = box.take(2, max_bytes=1000, max_items=10)
    assert chunk.tolist() == [2, 3]
    assert box.delivered([2]) == 60
    box.unsettled(chunk, PENDING)  # the stream broke: 3 goes back, 2 stays delivered
    assert box.pending(2).tolist() == [3]
    progress = box.progress()
    assert (progress.delivered_samples, progress.delivered_bytes, progress.sent_bytes) == (2, 100, 60)
    assert not progress.settled
    box.take(2, 1000, 10)
    box.unsettled([3], REFUSED)
    box.unsettled(box.take(1, 1000, 10), UNAVAILABLE)
    progress = box.progress()
    assert progress.settled and (progress.refused_samples, progress.unavailable_samples) == (1, 3)
    assert box.delivered_ids().tolist() == [1, 2]


def test_ids_delivered_twice_count_once_and_unknown_ids_are_ignored() -> None:
    box = outbox()
    box.take(1, 1000, 10)
    assert box.delivered([5, 7, 5, 1234]) == 80
    assert box.delivered([7]) == 0
    assert box.progress().delivered_samples == 2


def test_a_reply_settles_only_the_ids_of_its_own_chunk_whatever_else_it_names() -> None:
    """A hostile receiver names the next chunk's ids, another receiver's, and
    ids no sample has (past 2**63 too): the sender counts none of them."""
    box = outbox()
    chunk = box.take(1, max_bytes=80, max_items=10)
    assert chunk.tolist() == [5, 7]
    reply = [7, 9, 3, 2**63 + 9, 2**64 - 1]  # 9: receiver 1's next chunk; 3: receiver 2's
    held = acknowledged(chunk, reply)
    assert held.tolist() == [7]
    assert box.delivered(held) == 30
    box.unsettled(np.setdiff1d(chunk, held), REFUSED)
    assert box.pending(1).tolist() == [9]
    assert box.pending(2).tolist() == [1, 2, 3]
    assert acknowledged(chunk, [5, 7]) is chunk
    assert acknowledged(chunk, []).tolist() == []
    progress = box.progress()
    assert (progress.delivered_samples, progress.refused_samples, progress.sent_bytes) == (1, 1, 30)


def test_takes_match_a_whole_scan_through_broken_streams_and_read_limits() -> None:
    """Against the ledger's meaning, over more rows than one look spans: a
    take hands out the receiver's first pending ids in sending order, the
    ones a broken stream gave back first of all."""
    rng = np.random.default_rng(7)
    n = 3 * SCAN_ROWS + 123
    ids = rng.permutation(10 * n)[:n]
    receivers = rng.integers(0, 3, n)
    readers = rng.integers(-1, 2, n)
    box = Outbox(ids, receivers, rng.integers(1, 100, n), readers=readers, read_at=rng.integers(0, n, n))
    in_flight: list[np.ndarray] = []
    for step in range(600):
        receiver = int(rng.integers(0, 3))
        read_upto = np.array([step * 20, step * 10]) if step % 3 == 0 else None
        pending = np.flatnonzero((box.receivers == receiver) & (box.state == PENDING))
        if read_upto is not None:
            r = box.readers[pending]
            pending = pending[(r < 0) | (box.read_at[pending] < read_upto[np.maximum(r, 0)])]
        fits = int(np.searchsorted(np.cumsum(box.sizes[pending]), 500, side="right"))
        expected = box.ids[pending[: max(1, min(fits, 64))]] if len(pending) else np.empty(0)
        chunk = box.take(receiver, max_bytes=500, max_items=64, read_upto=read_upto)
        assert chunk.tolist() == expected.tolist(), step
        in_flight.append(chunk)
        if step % 7 == 6:  # a stream breaks: a chunk goes back, a random half of another is refused
            box.unsettled(in_flight.pop(int(rng.integers(0, len(in_flight)))), PENDING)
            if in_flight:
                back = in_flight.pop(0)
                box.unsettled(back[: len(back) // 2], REFUSED)
                box.delivered(back[len(back) // 2 :])
        assert box.pending_upto(receiver) == bool(np.any((box.receivers == receiver) & (box.state == PENDING)))


class Link:
    """The directory's record of one job, and no node listing, as :class:`Placements` reads them."""

    def __init__(self, job: jpb.Job) -> None:
        self.record = job
        self.nodes: dict[str, object] = {}

    async def job(self, job_id: str) -> jpb.Job:
        return self.record


@pytest.mark.parametrize("epoch", [3, 6])
def test_a_restarted_daemon_steps_on_from_saved_owners_instead_of_replaying(tmp_path: Path, epoch: int) -> None:
    root = make_files_dataset(tmp_path / "pfs", 300, sizes=(100,))
    registry = Registry(tmp_path / "state")
    registry.load()
    entry, _ = registry.add("imgs", build_manifest(root), replace=False)
    spec = job_spec("j", "imgs", mode="partial", q=0.3, nodes=["a", "b", "c"], seed=11, partition="sample")
    job = jpb.Job(spec=spec, manifest_id=entry.manifest.manifest_id, num_samples=300, epoch=epoch, created_unix=1.5)
    expected = owners(job_plan(job, entry.manifest), epoch)

    first = Placements(Link(job), "b", tmp_path / "state")  # type: ignore[arg-type]
    placement = asyncio.run(first.placement("j", entry))
    assert np.array_equal(placement.owners, expected) and placement.node_index == 1
    saved = list((tmp_path / "state" / "placements" / "j").glob("*.npy"))
    assert len(saved) == 1 and np.array_equal(np.load(saved[0]), expected)

    # Garbage in the saved epoch's place would show if it were not used.
    tampered = expected.copy()
    tampered[:] = 2
    np.save(saved[0], tampered)
    restarted = Placements(Link(job), "b", tmp_path / "state")  # type: ignore[arg-type]
    assert np.array_equal(asyncio.run(restarted.placement("j", entry)).owners, tampered)
    following = asyncio.run(restarted.placement("j", entry, epoch + 1)).owners
    assert np.array_equal(following, owners(job_plan(job, entry.manifest), epoch + 1, tampered))


@pytest.mark.parametrize(
    ("mode", "capacity", "caches"),
    [("partial", 20_000, False), ("partial", 10_000_000, True), ("partial", 0, True), ("local", 20_000, True)],
)
def test_a_cache_short_of_its_share_where_owners_move_caches_no_read_from_the_pfs(
    tmp_path: Path, mode: str, capacity: int, caches: bool
) -> None:
    """Its exchange passes on what it holds: reads cached would grow the short
    caches' holdings, epoch after epoch, up to where the exchange has no room to move."""
    root = make_files_dataset(tmp_path / "pfs", 300, sizes=(100,))
    registry = Registry(tmp_path / "state")
    registry.load()
    entry, _ = registry.add("imgs", build_manifest(root), replace=False)
    spec = job_spec("j", "imgs", mode=mode, q=0.3, nodes=["a", "b", "c"], seed=11, partition="sample")
    job = jpb.Job(spec=spec, manifest_id=entry.manifest.manifest_id, num_samples=300, epoch=4, created_unix=1.5)
    placements = Placements(Link(job), "b")  # type: ignore[arg-type]
    for epoch in (4, 5):
        placement = asyncio.run(placements.placement("j", entry, epoch))
        assert placements.caches_pfs_reads(placement, entry, capacity) is caches


def test_concurrent_asks_for_one_epoch_compute_and_save_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_files_dataset(tmp_path / "pfs", 300, sizes=(100,))
    registry = Registry(tmp_path / "state")
    registry.load()
    entry, _ = registry.add("imgs", build_manifest(root), replace=False)
    spec = job_spec("j", "imgs", mode="partial", q=0.3, nodes=["a", "b", "c"], seed=11, partition="sample")
    job = jpb.Job(spec=spec, manifest_id=entry.manifest.manifest_id, num_samples=300, epoch=5, created_unix=1.5)
    placements = Placements(Link(job), "b", tmp_path / "state")  # type: ignore[arg-type]

    async def ask_four_times() -> list[Placement]:
        return await asyncio.gather(*(placements.placement("j", entry) for _ in range(4)))

    first, *others = asyncio.run(ask_four_times())
    assert all(other is first for other in others)
    assert np.array_equal(first.owners, owners(job_plan(job, entry.manifest), 5))
    saved = sorted(p.name for p in (tmp_path / "state" / "placements" / "j").iterdir())
    assert len(saved) == 1 and saved[0].endswith("-5.npy")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_each_receivers_ids_go_in_the_order_this_nodes_ranks_read_them() -> None:
    ids = np.array([9, 3, 7, 1, 5, 2])
    box = Outbox(
        ids,
        np.array([1, 1, 1, 1, 2, 2]),
        np.full(6, 10),
        readers=np.array([0, 1, 0, 1, -1, 0]),
        read_at=np.array([4, 0, 1, 2, -1, 3]),
    )
    assert box.pending(1).tolist() == [3, 7, 1, 9]  # read at 0, 1, 2, 4
    assert box.pending(2).tolist() == [5, 2]  # 5 is not read here: first
    assert box.take(1, max_bytes=25, max_items=10).tolist() == [3, 7]


def test_what_a_receiver_reads_first_next_epoch_goes_by_its_due_position() -> None:
    ids = np.array([9, 3, 7, 1, 5, 2])
    # This node's ranks read them at 0..5; the receiver's ranks read 1 and 2
    # first, and their read-ahead asks for them before this node reads them.
    box = Outbox(
        ids, np.ones(6), np.full(6, 10), readers=np.zeros(6), read_at=np.arange(6), due=np.array([-1, 9, 9, 1, 9, 0])
    )
    assert box.pending(1).tolist() == [9, 2, 3, 1, 7, 5]  # 2 by 0, 1 by 1, the rest as read here
    assert box.take(1, max_bytes=100, max_items=2).tolist() == [9, 2]


def test_due_positions_are_where_the_receivers_ranks_read_each_id_in_the_next_epoch() -> None:
    settings = JobSettings(job_id="j", mode="partial", q=0.5, ranks_per_node=2, nodes=("a", "b", "c"))
    plan = JobPlan(settings, num_samples=90, num_nodes=3)
    before, after = owners(plan, 0), owners(plan, 1)
    give = np.flatnonzero((before == 0) & (after != 0))
    at = owner_read_positions(plan, 1, after, give)
    for node in (1, 2):
        orders = node_orders(plan, 1, node, after)
        theirs = after[give] == node
        assert theirs.any()
        for sample_id, position in zip(give[theirs].tolist(), at[theirs].tolist()):
            assert sample_id in orders[:, position].tolist()


def test_only_what_is_delivered_and_read_may_be_dropped() -> None:
    ids = np.array([10, 11, 12, 13])
    box = Outbox(ids, np.zeros(4), np.full(4, 10), readers=np.array([0, 0, 1, -1]), read_at=np.array([0, 5, 2, -1]))
    box.delivered([10, 11, 13])
    # Rank 0 read 3 ids (10 yes, 11 not yet), rank 1 none; 13 is read by no rank here.
    assert box.read_and_delivered(np.array([3, 0])).tolist() == [13, 10]
    box.dropped([13, 10])
    assert box.read_and_delivered(np.array([6, 6])).tolist() == [11]
    progress = box.progress()
    assert (progress.delivered_samples, progress.settled) == (3, False)
    assert box.undelivered_ids().tolist() == [12]


def test_a_short_receiver_is_handed_only_what_this_nodes_ranks_have_read() -> None:
    ids = np.array([20, 21, 22, 23])
    box = Outbox(ids, np.zeros(4), np.full(4, 10), readers=np.array([0, 0, 1, -1]), read_at=np.array([0, 5, 2, -1]))
    # Rank 0 read 1 id (20), rank 1 none; 23 is read by no rank here, so it may go at once.
    assert box.take(0, max_bytes=100, max_items=10, read_upto=np.array([1, 0])).tolist() == [23, 20]
    assert box.take(0, max_bytes=100, max_items=10, read_upto=np.array([1, 0])).tolist() == []
    assert box.pending_upto(0)
    assert box.take(0, max_bytes=100, max_items=10, read_upto=np.array([6, 3])).tolist() == [22, 21]
    assert not box.pending_upto(0)


def test_room_is_made_from_read_give_aways_no_receiver_has_taken() -> None:
    ids = np.array([30, 31, 32, 33])
    box = Outbox(
        ids, np.zeros(4), np.array([10, 20, 30, 40]), readers=np.array([0, 0, 0, 0]), read_at=np.array([0, 1, 2, 3])
    )
    box.delivered([30])
    # Rank 0 read 3 ids: 30 is delivered, 31 and 32 are not; 25 bytes take both.
    assert box.read_pending(np.array([3]), max_bytes=25).tolist() == [31, 32]
    assert box.read_pending(np.array([3]), max_bytes=5).tolist() == [31]
    assert box.read_pending(np.array([0]), max_bytes=100).tolist() == []


def test_read_positions_keep_each_ranks_furthest_and_a_later_epoch_means_all_read() -> None:
    positions = ReadPositions()
    assert positions.report("j", 2, 0, 10)
    assert not positions.report("j", 2, 0, 4)  # an older report changes nothing
    assert positions.report("j", 3, 1, 0)
    assert positions.read_upto("j", 2, np.array([0, 1, 2])).tolist() == [10, WHOLE_EPOCH, 0]
    assert positions.read_upto("j", 3, np.array([0, 1])).tolist() == [0, 0]
    positions.forget({"k"})
    assert positions.read_upto("j", 2, np.array([0])).tolist() == [0]


def test_what_a_receiver_reads_in_the_first_third_of_its_epoch_goes_first_in_its_order() -> None:
    # 300 ids per rank: positions 0..99 are the receiver's first third, whose
    # first batches its read-ahead asks for while this node still reads.
    at = np.array([0, 50, 99, 100, 200, 299, -1])
    assert due_positions(at, 300).tolist() == [0, 50, 99, 200, 300, 399, -1]
    ids = np.array([1, 2, 3])
    # This node reads 1, 2, 3 at 0, 40, 80; the receiver reads 3 first in the next epoch.
    box = Outbox(
        ids,
        np.ones(3),
        np.full(3, 10),
        readers=np.zeros(3),
        read_at=np.array([0, 40, 80]),
        due=due_positions(np.array([250, 150, 0]), 300),
    )
    assert box.pending(1).tolist() == [1, 3, 2]
