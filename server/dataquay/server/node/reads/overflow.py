"""Reading from the PFS, ahead of the ranks, what they will read that no cache holds.

When a dataset is larger than the caches, a node owns samples it could not
cache: the store is full, and the MinIO policy never evicts. Read on demand,
each of them costs the rank that asks the PFS's latency and its share of the
PFS's bandwidth at the moment it asks. But the ranks' orders are known in
advance (:func:`dataquay.client.placement.node_orders`), so the daemon reads
those samples before they are asked for, in the order the ranks will need
them (every rank's p-th sample, then every rank's (p+1)-th), into memory
bounded by the node's prefetch budget, and hands each over when it is read.
It starts as soon as the job's staging ends on the node (what staging could
not fit is the overflow) or its ranks join, so that the first batches do not
wait either; once an epoch's overflow is read, the next epoch's follows, so
that a new epoch does not begin by waiting for the PFS.

While the dataset's staging runs here nothing is prefetched: staging reads
in the ranks' order itself, and a rank's read takes over what it needs now
(:mod:`.claims`). What staging reserved is left to it, and a read or staging
that needs a sample being prefetched waits for it.

Every sample is read from the PFS once an epoch: what a rank asked for is
not prefetched any more (a rank that got ahead of the reads had it read on
demand), and a read of a sample still being prefetched waits for that read.
A rank's requests need not come in its order (several loader workers each
ask for their own batches): the prefetch keeps to the ranks' order and
skips only what was asked. A sample prefetched that its rank left far
behind without asking for it (its client read it elsewhere) is dropped as
wasted once room is needed.
Reads go through the node's PFS pool, its threads and its bandwidth cap,
with the checks of any PFS read: a file that changed since its manifest
was built is refused, and the sample is then read, and refused, on demand.

Only samples this node owns are prefetched (not those spilled to another
node's cache, which are asked of it), and in modes whose owners move
only those it owned the epoch before as well: what moves in comes by the
exchange. For the same reason, while the ranks are still on the epoch
before, the next epoch's prefetch leaves out what moved in at the current
one (its exchange may still deliver it); it goes back for those once the
ranks begin that epoch. A sample handed over is offered to the cache unless
the cache is full, as any PFS read of a sample the node owns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.placement import JobPlan, node_orders
from dataquay.client.wire.records import CHECKSUM_BYTES, stored_checksum
from dataquay.client.wire.tiers import PFS
from dataquay.server.errors import DataquayError
from dataquay.server.limits import ByteBudget
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.cluster.placements import Placement
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.registry import Registered
from dataquay.server.task_group import Spawn

log = logging.getLogger("dataquay.overflow")

Fetched = dict[int, tuple[str, bytes | memoryview, int]]
#: The placement of a job (by id) over a dataset in a given epoch.
PlacementOf = Callable[[str, Registered, int], Awaitable[Placement]]
#: Whether a placement's reads from the PFS may be cached (:meth:`Placements.caches_pfs_reads`).
CachesReads = Callable[[Placement, Registered], bool]

#: Share of the prefetch budget the overflow may fill; the rest is the transfers'.
BUDGET_SHARE = 0.75
#: Bytes one prefetch asks of the PFS pool at most (one sample, if larger):
#: small enough that a rank's own miss does not queue long behind it.
CHUNK_BYTES = 1 << 20
#: Prefetches in flight at once, over all jobs.
READS_IN_FLIGHT = 2
#: Candidates looked up in the cache at a time.
_WINDOW = 256
#: Windows looked up before the event loop's other work goes first: an epoch
#: whose samples are all cached would otherwise hold the loop for its whole scan.
_WINDOWS_PER_TURN = 16
#: How often a loop with nothing to do looks again, in seconds.
_IDLE_POLL_SECONDS = 1.0
#: A job none of whose ranks read for this long is forgotten, its samples dropped.
IDLE_SECONDS = 60.0
#: Ids of an epoch asked for while it is being planned, kept to apply once it is.
_UNPLANNED_READS = 64
#: A held sample this share of an epoch behind its rank's furthest request is not waited for any more.
_BEHIND = 1 / 8


class EpochReads(NamedTuple):
    """An epoch as one node's ranks read it; a slot is position * g + rank."""

    ids: np.ndarray  #: every id the ranks read, ascending (int64)
    slots: np.ndarray  #: the slot each of ``ids`` is first read at
    ahead: np.ndarray  #: which of ``ids`` to prefetch (indexes into it), in slot order
    positions: int  #: ids each rank reads
    arrived: np.ndarray  #: per entry of ``ids``, whether it moved in at the epoch before


def epoch_reads(
    orders: np.ndarray,
    epoch_owners: np.ndarray,
    node: int,
    before: np.ndarray | None = None,
    two_before: np.ndarray | None = None,
) -> EpochReads:
    """What ``node``'s ranks read, from their orders (g x L, :func:`node_orders`),
    and which of it the node prefetches: what it owns per ``epoch_owners``
    and, where ``before`` (the previous epoch's holders) is given, held then
    too. With ``two_before`` as well, it marks what moved in at the epoch before."""
    ids, first = np.unique(orders.T.ravel(), return_index=True)
    mine = epoch_owners[ids] == node
    if before is not None:
        mine &= before[ids] == node
    arrived = np.zeros(len(ids), dtype=bool)
    if before is not None and two_before is not None:
        arrived = (before[ids] == node) & (two_before[ids] != node)
    ahead = np.flatnonzero(mine)
    return EpochReads(ids, first, ahead[np.argsort(first[ahead], kind="stable")], orders.shape[1], arrived)


class _Chunk(NamedTuple):
    """Samples prefetched together: their ids, their entries (indexes in the epoch's ids), the bytes they take."""

    ids: np.ndarray
    entries: np.ndarray
    reserved: int


#: No chunk while the budget is full.
_NO_ROOM = _Chunk(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0)
#: No chunk yet: _WINDOWS_PER_TURN windows held nothing to prefetch.
_SCANNED = _Chunk(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), 0)


@dataclass
class OverflowCounts:
    """What the overflow's prefetches did since the daemon started (payload bytes)."""

    read_samples: int = 0  #: read from the PFS ahead of the ranks
    read_bytes: int = 0
    served_samples: int = 0  #: handed to a rank's read
    served_bytes: int = 0
    wasted_samples: int = 0  #: prefetched and dropped unread
    wasted_bytes: int = 0
    failed_samples: int = 0  #: refused by the PFS (changed, unreadable): left to the reads on demand


@dataclass
class _Epoch:
    """One epoch of a job as the prefetch walks it."""

    epoch: int
    reads: EpochReads
    ranks: int  # g
    reached: np.ndarray  # per rank, the furthest position asked for
    asked: np.ndarray  # per entry of reads.ids, whether a rank asked for it
    cursor: int = 0  # next entry of reads.ahead to consider
    deferring: bool = False  # leaving out what arrived at the epoch before (the ranks are not on this one yet)
    held: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # id -> (cache value, index in reads.ids)
    caches_reads: bool = True  # whether what it reads may go into the cache
    reading: dict[int, asyncio.Future[None]] = field(default_factory=dict)  # id -> its read in flight

    def note(self, ids: np.ndarray) -> None:
        """Marks ``ids`` asked for and moves each rank's furthest position."""
        known = self.reads.ids
        if not len(ids) or not len(known):
            return
        where = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        where = where[known[where] == ids]
        self.asked[where] = True
        slots = self.reads.slots[where]
        np.maximum.at(self.reached, slots % self.ranks, slots // self.ranks)

    def left_behind(self, index: np.ndarray) -> np.ndarray:
        """Which entries (of reads.ids) their rank has left far behind."""
        slots = self.reads.slots[index]
        behind = max(1, int(self.reads.positions * _BEHIND))
        return slots // self.ranks + behind < self.reached[slots % self.ranks]


@dataclass
class _Job:
    """The prefetch of one job."""

    entry: Registered
    job_id: str
    owners_move: bool  # what it caches leaves the exchange's reserve free
    epochs: dict[int, _Epoch] = field(default_factory=dict)
    latest: int = 0  # the latest epoch its ranks read
    walking: int = 0  # the epoch prefetched now
    last_read: float = field(default_factory=time.monotonic)
    failed_epoch: int = -1  # an epoch that could not be planned: not tried again
    task: asyncio.Task[None] | None = None
    unplanned: dict[int, list[np.ndarray]] = field(default_factory=dict)  # ids read before their epoch was planned


class OverflowPrefetcher:
    """Reads the overflow of the jobs this node's ranks read, ahead of them.

    Args:
        store: the node's cache: what it holds is not prefetched.
        pfs: the node's PFS readers.
        placement_of: a job's placement in an epoch.
        caches_reads: whether an epoch's reads may go into the cache (not
            in a short cache where owners move).
        spawn: runs a background task owned by the daemon.
        budget: the node's prefetch memory, shared with the transfers.
    """

    def __init__(
        self,
        store: Store,
        pfs: PfsPool,
        placement_of: PlacementOf,
        caches_reads: CachesReads,
        spawn: Spawn,
        budget: ByteBudget,
    ) -> None:
        self.store = store
        self.pfs = pfs
        self.placement_of = placement_of
        self.caches_reads = caches_reads
        self.spawn = spawn
        self.budget = budget
        self.counts = OverflowCounts()
        self._jobs: dict[str, _Job] = {}
        self._in_flight = asyncio.Semaphore(READS_IN_FLIGHT)
        #: Ids a read waits for: never dropped.
        self._wanted: Counter[int] = Counter()

    def start(self, entry: Registered, placement: Placement) -> None:
        """Starts prefetching for the job of ``placement`` (its ranks joined
        it or began an epoch); a read for it starts it too."""
        self._note(entry, placement, np.empty(0, dtype=np.int64))

    async def take(self, entry: Registered, placement: Placement, ids: np.ndarray, misses: np.ndarray) -> Fetched:
        """Notes that this node's ranks read ``ids`` and hands over the samples
        of ``misses`` prefetched, waiting for those being read."""
        job = self._note(entry, placement, ids)
        if job is None or not len(misses):
            return {}
        # The read's own epoch, then the one before (a rank still finishing it
        # while another began this one); never a later epoch's copy.
        states = sorted((e for e in job.epochs.values() if e.epoch <= placement.epoch), key=lambda e: -e.epoch)
        out: Fetched = {}
        waits: dict[int, tuple[_Epoch, asyncio.Future[None]]] = {}
        for sample_id in misses.tolist():
            state = next((e for e in states if sample_id in e.held or sample_id in e.reading), None)
            if state is None:
                continue
            if sample_id in state.held:
                self._hand_over(job, state, sample_id, out)
            else:
                waits[sample_id] = (state, state.reading[sample_id])
        if waits:
            self._wanted.update(waits.keys())
            try:
                await asyncio.wait({reading for _, reading in waits.values()})
            finally:
                self._wanted.subtract(waits.keys())
                self._wanted += Counter()  # drops the ids no read waits for any more
            for sample_id, (state, _) in waits.items():
                if sample_id in state.held:
                    self._hand_over(job, state, sample_id, out)
        return out

    def _hand_over(self, job: _Job, state: _Epoch, sample_id: int, out: Fetched) -> None:
        """Moves ``sample_id`` from ``state``'s held samples to ``out``."""
        value, _ = state.held.pop(sample_id)
        payload = memoryview(value)[CHECKSUM_BYTES:]
        out[sample_id] = (PFS, payload, stored_checksum(value))
        self.budget.give(len(value))
        self.counts.served_samples += 1
        self.counts.served_bytes += len(payload)
        if state.caches_reads and not self.store.full:
            self.store.offer(
                PendingWrite(job.entry.record.cache_db.encode(), sample_id, value, leaves_room=job.owners_move)
            )

    def _note(self, entry: Registered, placement: Placement, ids: np.ndarray) -> _Job | None:
        """Records what the ranks asked for; starts (or restarts) the job's loop."""
        if placement.node_index < 0 or not placement.job.spec.ranks_per_node:
            return None  # no ranks here, or their orders are not known yet
        job_id, epoch = placement.job.spec.job_id, placement.epoch
        job = self._jobs.get(job_id)
        if job is not None and job.entry.record.manifest_id != entry.record.manifest_id:
            self._forget(job)
            job = None
        if job is None:
            job = self._jobs[job_id] = _Job(entry, job_id, placement.owners_move, latest=epoch, walking=epoch)
        job.last_read = now = time.monotonic()
        for quiet in [j for j in self._jobs.values() if now - j.last_read > IDLE_SECONDS]:
            self._forget(quiet)
        if epoch > job.latest:
            job.latest = epoch
            for old in [e for e in job.epochs if e < epoch - 1]:
                self._drop(job.epochs.pop(old))
            for begun in [e for e in job.epochs.values() if e.deferring and e.epoch <= epoch]:
                begun.deferring = False
                if begun.reads.arrived.any():
                    begun.cursor = 0  # back for what was left out
                    job.walking = min(job.walking, begun.epoch)
        state = job.epochs.get(epoch)
        if state is not None:
            state.note(ids)
        elif len(ids):
            job.unplanned.setdefault(epoch, []).append(ids)
            del job.unplanned[epoch][:-_UNPLANNED_READS]
        self.budget.wake()
        if (job.task is None or job.task.done()) and epoch > job.failed_epoch:
            job.task = self.spawn(self._run(job), f"overflow-{job_id}")
        return job

    # ----------------------------------------------------------- the loop

    async def _run(self, job: _Job) -> None:
        """Prefetches for ``job`` until its ranks stop reading."""
        try:
            while self._jobs.get(job.job_id) is job:
                epoch = job.walking = max(job.walking, job.latest)
                if epoch > job.latest + 1:
                    await self._wait(job)  # the next epoch is prefetched; the ranks are still on the one before
                    continue
                state = job.epochs.get(epoch)
                if state is None:
                    state = await self._plan(job, epoch)
                    if state is None:
                        return
                    if epoch >= job.latest - 1:
                        job.epochs[epoch] = state
                    for ids in job.unplanned.pop(epoch, []):
                        state.note(ids)
                    continue
                await self._in_flight.acquire()
                if self._jobs.get(job.job_id) is not job or job.epochs.get(epoch) is not state:
                    self._in_flight.release()
                    continue
                chunk = self._next_chunk(job, state)
                if chunk is None:
                    self._in_flight.release()
                    job.walking = epoch + 1
                elif chunk is _SCANNED:
                    self._in_flight.release()
                    await asyncio.sleep(0)
                elif not len(chunk.ids):
                    self._in_flight.release()
                    if not self._sweep(job):
                        await self._wait(job)
                else:
                    self.budget.reserve(chunk.reserved, BUDGET_SHARE)
                    done = asyncio.get_running_loop().create_future()
                    state.reading.update(dict.fromkeys(chunk.ids.tolist(), done))
                    self.pfs.claims.claim(job.entry.record.cache_db, chunk.ids.tolist(), chunk, started=True)
                    self.spawn(self._read(job, state, chunk, done), f"overflow-read-{job.job_id}-{epoch}")
        finally:
            if job.failed_epoch < 0:
                self._forget(job)

    async def _wait(self, job: _Job) -> None:
        """Waits for room or progress; forgets a job whose ranks went quiet."""
        await self.budget.changed(_IDLE_POLL_SECONDS)
        if time.monotonic() - job.last_read > IDLE_SECONDS:
            self._forget(job)

    async def _plan(self, job: _Job, epoch: int) -> _Epoch | None:
        """What ``job``'s ranks on this node read in ``epoch``; None (and not
        tried again for it) when the job cannot be planned here."""
        entry = job.entry
        try:
            placement = await self.placement_of(job.job_id, entry, epoch)
            before = two_before = None
            if placement.owners_move and epoch > 0:
                before = (await self.placement_of(job.job_id, entry, epoch - 1)).sources
            if placement.owners_move and epoch > 1:
                two_before = (await self.placement_of(job.job_id, entry, epoch - 2)).sources
            plan = job_plan(placement.job, entry.manifest)
            reads = await asyncio.get_running_loop().run_in_executor(
                None,
                _plan_reads,
                plan,
                epoch,
                placement.node_index,
                placement.owners,
                placement.sources,
                before,
                two_before,
            )
        except (DataquayError, ValueError) as exc:
            log.info("not prefetching", extra={"fields": {"job": job.job_id, "epoch": epoch, "reason": str(exc)}})
            job.failed_epoch = epoch
            return None
        g = plan.settings.ranks_per_node
        reached, asked = np.full(g, -1, dtype=np.int64), np.zeros(len(reads.ids), dtype=bool)
        caches = self.caches_reads(placement, entry)
        return _Epoch(epoch, reads, g, reached, asked, deferring=epoch > job.latest, caches_reads=caches)

    def _next_chunk(self, job: _Job, state: _Epoch) -> _Chunk | None:
        """The next ids to prefetch: as many as fit in :data:`CHUNK_BYTES`
        and the budget (none while it is full, :data:`_SCANNED` after a turn of
        windows that held none); None once the epoch has none left."""
        ahead = state.reads.ahead
        lengths = job.entry.manifest.sample_length
        db = job.entry.record.cache_db
        most = int(self.budget.limit * BUDGET_SHARE)
        if self.pfs.claims.staging(db):
            return _NO_ROOM  # staging reads in the ranks' order itself; what it cannot fit comes after
        for _ in range(_WINDOWS_PER_TURN):
            if state.cursor >= len(ahead):
                return None
            room = self.budget.room(BUDGET_SHARE)
            if not room:
                return _NO_ROOM
            window = slice(state.cursor, min(state.cursor + _WINDOW, len(ahead)))
            index = ahead[window]
            ids = state.reads.ids[index]
            sizes = lengths[ids].astype(np.int64) + CHECKSUM_BYTES
            keep = ~state.asked[index] & ~self.store.cached_mask(db, ids) & (sizes <= most)
            keep &= ~self.pfs.claims.reserved_mask(db, ids)  # staging reads those
            if state.deferring:
                keep &= ~state.reads.arrived[index]
            if state.held or state.reading:
                keep &= ~np.fromiter((i in state.held or i in state.reading for i in ids.tolist()), bool, len(ids))
            kept = np.flatnonzero(keep)
            if not len(kept):
                state.cursor = window.stop
                continue
            total = np.cumsum(sizes[kept])
            count = int(np.searchsorted(total, min(room, max(CHUNK_BYTES, int(total[0]))), side="right"))
            if not count:
                state.cursor += int(kept[0])
                return _NO_ROOM
            taken = kept[:count]
            state.cursor += int(taken[-1]) + 1
            return _Chunk(ids[taken], index[taken], int(total[count - 1]))
        return _SCANNED

    async def _read(self, job: _Job, state: _Epoch, chunk: _Chunk, done: asyncio.Future[None]) -> None:
        """Reads one chunk ahead into ``state``; what was read on demand meanwhile is dropped."""
        ids = chunk.ids
        kept = 0
        values: dict[int, bytes] = {}
        try:
            try:
                values, failures = await self.pfs.read_available(job.entry.record.name, job.entry.manifest, ids)
            except (DataquayError, OSError) as exc:
                values, failures = {}, [str(exc)]
            finally:
                self.pfs.claims.resolve(job.entry.record.cache_db, values, chunk)
                self.pfs.claims.release(job.entry.record.cache_db, ids.tolist(), chunk)
                self._in_flight.release()
                for sample_id in ids.tolist():
                    state.reading.pop(sample_id, None)
                done.set_result(None)
            if failures:
                self.counts.failed_samples += len(ids) - len(values)
                log.warning(
                    "a prefetch failed; those samples are read on demand",
                    extra={"fields": {"job": job.job_id, "samples": len(ids) - len(values), "first": failures[0]}},
                )
            current = self._jobs.get(job.job_id) is job and job.epochs.get(state.epoch) is state
            index_of = dict(zip(ids.tolist(), chunk.entries.tolist()))
            for sample_id, value in values.items():
                self.counts.read_samples += 1
                self.counts.read_bytes += len(value) - CHECKSUM_BYTES
                index = index_of[sample_id]
                if current and (not state.asked[index] or self._wanted[sample_id]):
                    state.held[sample_id] = (value, index)
                    kept += len(value)
                else:
                    self._count_wasted(len(value))
        finally:
            self.budget.give(chunk.reserved - kept)

    # ---------------------------------------------------------- dropping

    def _sweep(self, job: _Job) -> bool:
        """Drops held samples their ranks left far behind without asking for
        them; True if that freed any room."""
        freed = 0
        for state in job.epochs.values():
            if not state.held:
                continue
            ids = np.fromiter(state.held, np.int64, len(state.held))
            index = np.array([at for _, at in state.held.values()], dtype=np.int64)
            for sample_id in ids[state.left_behind(index)].tolist():
                if not self._wanted[sample_id]:
                    value, _ = state.held.pop(sample_id)
                    self._count_wasted(len(value))
                    freed += len(value)
        self.budget.give(freed)
        return freed > 0

    def _drop(self, state: _Epoch) -> None:
        """Drops an epoch's held samples (reads still in flight drop theirs on arrival)."""
        freed = sum(len(value) for value, _ in state.held.values())
        for value, _ in state.held.values():
            self._count_wasted(len(value))
        state.held.clear()
        self.budget.give(freed)

    def _forget(self, job: _Job) -> None:
        if self._jobs.get(job.job_id) is job:
            del self._jobs[job.job_id]
        for state in job.epochs.values():
            self._drop(state)

    def _count_wasted(self, value_bytes: int) -> None:
        self.counts.wasted_samples += 1
        self.counts.wasted_bytes += value_bytes - CHECKSUM_BYTES


def _plan_reads(
    plan: JobPlan,
    epoch: int,
    node: int,
    epoch_owners: np.ndarray,
    sources: np.ndarray,
    before: np.ndarray | None,
    two_before: np.ndarray | None,
) -> EpochReads:
    """What ``node``'s ranks read, prefetching what no other node is asked
    for (``sources``: the node asked for each sample)."""
    return epoch_reads(node_orders(plan, epoch, node, epoch_owners), sources, node, before, two_before)
