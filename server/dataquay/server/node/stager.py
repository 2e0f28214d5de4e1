"""Staging: copying a dataset's samples from the PFS into the node's cache.

Staging reads in the order the job's first epoch will consume the samples
(:func:`first_epoch_positions`: the step at which any rank of the job reads
each one), so a job that starts before staging ends finds its first steps
cached, and the stager stays ahead of the ranks rather than racing them.
For tar and npy datasets it keeps reads large: contiguous ranges are read
whole, ordered by the earliest first-epoch position of any sample they hold.
Already cached samples are skipped, so staging again, or after a crash, resumes.

A job may read while its staging runs. Every sample is then read from the
PFS once over staging and the first epoch: the run reserves what it will
read, a rank's read that needs a sample the run has not started takes it
over and reads it itself, and one the run is reading is waited for, not
read again (:mod:`dataquay.server.node.reads.claims`). What others read
meanwhile (a rank's miss, caching behind a trainer) the run finds queued or
cached when it gets there, and skips.

One run per dataset at a time; a second request joins the running one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.pfs import ReadRange, plan_reads
from dataquay.client.placement import JobPlan, epoch_permutation, node_orders
from dataquay.server.node.cache.manager import Admitted
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.cluster.placements import Placement
from dataquay.server.node.reads.claims import PfsClaims, wait_for
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.planning.capacity import exchange_staging_limit, refill_margin, staging_charges, within_room
from dataquay.server.registry import Registered, Registry
from dataquay.server.sizes import format_bytes
from dataquay.server.task_group import TaskGroup

log = logging.getLogger("dataquay.stager")

#: What a run stopped by the daemon's shutdown reports.
SHUTTING_DOWN = "the daemon is shutting down; stage again to resume"


@dataclass
class StagingProgress:
    """Progress of one staging run; updated by the run, read by anyone."""

    dataset: str
    total_samples: int
    total_bytes: int
    done_samples: int = 0
    done_bytes: int = 0
    skipped_samples: int = 0
    skipped_bytes: int = 0
    read_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    error: str = ""
    cache_full: bool = False
    failed_samples: int = 0
    first_failure: str = ""
    held_for_others: int = 0  #: of the samples staged, those other nodes own (spilled here)
    #: Payload bytes of the dataset the cache holds once the run ended (``dataset show``'s number).
    cached_bytes: int = 0
    #: What the cache manager said would fit, and evicted, before the run read anything.
    admission: Admitted | None = None

    @property
    def finished(self) -> bool:
        return self.ended is not None

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def found_cached(self, samples: int, nbytes: int) -> None:
        self.skipped_samples += samples
        self.skipped_bytes += nbytes
        self.done_samples += samples
        self.done_bytes += nbytes

    def staged(self, samples: int, nbytes: int, read_bytes: int) -> None:
        """``samples`` of ``nbytes`` (their manifest lengths, the unit of
        ``total_bytes``) cached from ``read_bytes`` read from the PFS (tar
        headers and the gaps read between samples included)."""
        self.done_samples += samples
        self.done_bytes += nbytes
        self.read_bytes += read_bytes

    def recount(self, cached: int, nbytes: int, cached_bytes: int) -> None:
        """What the cache holds of the run's samples once its writes are in:
        the cache may take fewer than were read (full, or evicting), and
        ``dataset show`` counts what it holds (``cached_bytes``, the payload
        bytes of the whole dataset here)."""
        self.done_samples, self.done_bytes, self.cached_bytes = cached, nbytes, cached_bytes

    @property
    def short(self) -> bool:
        """Whether samples the PFS gave are not in the cache."""
        return self.done_samples + self.failed_samples < self.total_samples

    def failed(self, failures: list[str]) -> None:
        if failures and not self.failed_samples:
            self.first_failure = failures[0]
        self.failed_samples += len(failures)

    def end(self, error: str = "") -> None:
        self.error = error
        self.ended = time.monotonic()


def _disk_full_error(store: Store, progress: StagingProgress) -> str:
    """Why a run that filled the cache's file system failed: unlike a cache at
    its configured capacity, that is not what the user asked for."""
    return (
        f"the cache file system ({store.path}) is full: {progress.done_samples}/{progress.total_samples} samples, "
        f"{format_bytes(progress.done_bytes)} of {format_bytes(progress.total_bytes)}, fit; the rest is served "
        "from the PFS. Free space there or drop a dataset, then stage again"
    )


def _write_error(store: Store, progress: StagingProgress) -> str:
    """Why a run whose cache writes failed (not for lack of space) failed."""
    return (
        f"writing to the cache in {store.path} failed ({store.last_write_error}): "
        f"{progress.done_samples}/{progress.total_samples} samples, {format_bytes(progress.done_bytes)} of "
        f"{format_bytes(progress.total_bytes)}, are cached; the rest is served from the PFS. See the daemon's log"
    )


def first_epoch_positions(plan: JobPlan, epoch_owners: np.ndarray) -> np.ndarray:
    """When each sample of ``plan`` is first read in epoch 0, as a sort key
    (int64, one per sample): the p-th read of rank r is ``p * W + r``, as
    every rank reads its p-th sample at about the same time; a sample no
    rank reads sorts last. A pure function of the job's settings, so the
    stager follows the order the sampler will deal (in mode ``global`` the
    job-wide permutation; in the node-local modes each node's own)."""
    n, world = plan.num_samples, plan.world_size
    if plan.settings.mode == "global" or not plan.settings.ranks_per_node:
        return permutation_positions(n, plan.settings.seed)
    position = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    g = plan.settings.ranks_per_node
    for node in range(plan.num_nodes):
        orders = node_orders(plan, 0, node, epoch_owners)
        steps = np.arange(orders.shape[1], dtype=np.int64) * world
        for local, order in enumerate(orders):
            np.minimum.at(position, order, steps + node * g + local)
    return position


async def staging_order(entry: Registered, placement: Placement | None, seed: int) -> np.ndarray:
    """The first-epoch positions a run stages in: those of ``placement``'s
    job, else of a job-less run shuffled with ``seed``; computed off the loop."""
    loop = asyncio.get_running_loop()
    if placement is None:
        return await loop.run_in_executor(None, permutation_positions, entry.manifest.num_samples, seed)
    plan = job_plan(placement.job, entry.manifest)
    return await loop.run_in_executor(None, first_epoch_positions, plan, placement.owners)


def permutation_positions(num_samples: int, seed: int) -> np.ndarray:
    """Each sample's place in epoch 0's job-wide permutation with ``seed``."""
    position = np.empty(num_samples, dtype=np.int64)
    position[epoch_permutation(num_samples, seed, 0)] = np.arange(num_samples)
    return position


def staging_ranges(manifest: Manifest, ids: np.ndarray, position: np.ndarray) -> list[ReadRange]:
    """The PFS ranges holding ``ids``, ordered by first-epoch ``position``
    (one per sample, :func:`first_epoch_positions`).

    A range's position is that of its earliest sample; for the files format
    every range is one sample, so the order is exactly the epoch's.
    """
    if not len(ids):
        return []
    ranges = plan_reads(manifest, ids)
    first = np.array([position[r.ids].min() for r in ranges])
    return [ranges[i] for i in np.argsort(first, kind="stable")]


class _RunClaims:
    """One run's claims (:class:`~dataquay.server.node.reads.pfs.RangeClaims`):
    a job reads only what the run still reserved when it was queued, and of
    that, what no rank took over before its thread got to it."""

    def __init__(self, claims: PfsClaims, db: str, manifest: Manifest, store: Store) -> None:
        self.claims = claims
        self.db = db
        self.manifest = manifest
        self.store = store
        #: The ids each queued job claimed, in the order the jobs are yielded.
        self.jobs: deque[list[int]] = deque()
        #: Ids of this run found cached or queued, or taken over by a rank's
        #: read, since :meth:`found_elsewhere` last took them (the threads append).
        self.elsewhere: list[int] = []

    def take(self, ranges: Sequence[ReadRange]) -> list[ReadRange]:
        ids = np.concatenate([r.ids for r in ranges])
        # The queue before the cache: the writer's thread commits a value
        # before it leaves the queue, so one of the two sees it.
        queued = self.store.queued_values(self.db, ids.tolist())
        done = np.fromiter((i in queued for i in ids.tolist()), dtype=bool, count=len(ids))
        done |= self.store.cached_mask(self.db, ids)
        mine, _ = self.claims.claim(self.db, ids[~done].tolist(), self, started=False, reserved_only=True)
        self.elsewhere.extend(set(ids.tolist()) - set(mine))
        if not mine:
            return []
        self.jobs.append(mine)
        return self._narrowed(ranges, set(mine))

    def narrow(self, read_range: ReadRange) -> list[ReadRange]:
        kept = self.claims.start(self.db, read_range.ids.tolist(), self)
        if len(kept) < len(read_range.ids):
            self.elsewhere.extend(set(read_range.ids.tolist()) - set(kept))
        return self._narrowed([read_range], set(kept))

    def found_elsewhere(self) -> list[int]:
        """The ids :attr:`elsewhere` gathered since the last call."""
        count = len(self.elsewhere)
        taken = self.elsewhere[:count]
        del self.elsewhere[:count]
        return taken

    def done(self, values: dict[int, bytes]) -> None:
        self.claims.resolve(self.db, values, self)

    def release(self, ids: list[int]) -> None:
        self.claims.release(self.db, ids, self)

    def close(self) -> None:
        """Ends every claim and reservation of the run (its jobs left are dropped)."""
        while self.jobs:
            self.release(self.jobs.popleft())
        self.claims.unreserve(self.db, self)

    def _narrowed(self, ranges: Sequence[ReadRange], kept: set[int]) -> list[ReadRange]:
        """``ranges`` cut down to ``kept``, in their order; a range partly kept is planned again."""
        out: list[ReadRange] = []
        for r in ranges:
            ids = r.ids.tolist()
            if all(i in kept for i in ids):
                out.append(r)
            elif any(i in kept for i in ids):
                out += plan_reads(self.manifest, np.array([i for i in ids if i in kept], dtype=np.int64))
        return out


class Stager:
    """Runs staging in the background and keeps the last run's progress per dataset.

    Its runs are a task group of their own: the daemon ends them before it
    drains in-flight calls, so that the Stage streams watching them end
    instead of holding the drain for its whole grace period.
    """

    def __init__(self, registry: Registry, store: Store, pfs: PfsPool) -> None:
        self.registry = registry
        self.store = store
        self.pfs = pfs
        self.runs: dict[str, StagingProgress] = {}
        self._done: dict[str, asyncio.Event] = {}
        self._tasks = TaskGroup()
        self._closed = False

    def start(
        self,
        dataset: str,
        position: np.ndarray,
        ids: np.ndarray | None = None,
        leave_room: bool = False,
        held_for_others: int = 0,
        admission: Admitted | None = None,
    ) -> StagingProgress:
        """Starts staging ``ids`` of ``dataset`` (default: all), in the order of
        their first-epoch ``position`` (:func:`first_epoch_positions`), unless a run is
        going; returns its progress, already ended once the stager is closed.
        ``leave_room`` stops short of the exchange's reserve (a job whose owners
        move); ``held_for_others`` of ``ids`` are other nodes' overflow, as reported;
        ``admission`` is what the cache manager made room for."""
        current = self.runs.get(dataset)
        if current is not None and not current.finished:
            return current
        entry = self.registry.get(dataset)
        manifest = entry.manifest
        if ids is None:
            ids = np.arange(manifest.num_samples, dtype=np.int64)
        progress = StagingProgress(
            dataset,
            len(ids),
            int(manifest.sample_length[ids].sum()),
            held_for_others=held_for_others,
            admission=admission,
        )
        self.runs[dataset] = progress
        self._done[dataset] = asyncio.Event()
        if self._closed:
            progress.end(SHUTTING_DOWN)
            self._done[dataset].set()
        else:
            claims = _RunClaims(self.pfs.claims, entry.record.cache_db, manifest, self.store)
            # All at once, before the run looks at what is cached: a peer's read
            # meanwhile finds its samples coming (PeerAnswers.coming), not missing.
            self.pfs.claims.reserve(entry.record.cache_db, claims, ids, manifest.num_samples)
            self._tasks.spawn(self._run(entry, position, ids, progress, leave_room, claims), f"stage-{dataset}")
        return progress

    def running(self, dataset: str) -> bool:
        """Whether a run of ``dataset`` is going (a new request joins it)."""
        current = self.runs.get(dataset)
        return current is not None and not current.finished

    def _full(self, leave_room: bool) -> bool:
        return self.store.space.reserve_reached if leave_room else self.store.full

    def _room(self, leave_room: bool) -> int | None:
        """Bytes staging may still fill: up to the exchange's reserve with
        ``leave_room``, else up to the refill margin; None for a cache with no capacity."""
        space = self.store.space
        if not space.capacity:
            return None
        limit = exchange_staging_limit(space.capacity) if leave_room else space.capacity - refill_margin(space.capacity)
        return limit - space.live_bytes - space.reserved_bytes

    async def close(self) -> None:
        """Ends the runs (staging resumes where it stopped when asked again) and starts no more."""
        self._closed = True
        await self._tasks.close()

    async def wait(self, dataset: str, timeout: float) -> None:
        """Returns when the dataset's run ends or ``timeout`` passes."""
        try:
            await asyncio.wait_for(self._done[dataset].wait(), timeout)
        except TimeoutError:
            pass

    async def _run(
        self,
        entry: Registered,
        position: np.ndarray,
        ids: np.ndarray,
        progress: StagingProgress,
        leave_room: bool,
        claims: _RunClaims,
    ) -> None:
        dataset, manifest, db = entry.record.name, entry.manifest, entry.record.cache_db
        log.info("staging started", extra={"fields": {"dataset": dataset, "samples": len(ids)}})
        write_errors = self.store.write_errors
        try:
            self.store.recheck_space()
            await self.store.open_dataset(db)
            cached = await self._cached_mask(db, ids)
            progress.found_cached(int(cached.sum()), int(manifest.sample_length[ids[cached]].sum()))
            missing = ids[~cached]
            if (room := self._room(leave_room)) is not None and len(missing):
                missing = within_room(missing, position, staging_charges(manifest.sample_length, missing), room)
            self.pfs.claims.narrow(db, claims, missing)
            ranges = staging_ranges(manifest, missing, position)
            name = db.encode()
            taken: list[int] = []
            async for read in self.pfs.stream(dataset, manifest, ranges, self.store.backlog, claims):
                progress.failed(read.failures)
                await self.store.put_many(
                    [PendingWrite(name, i, v, leaves_room=leave_room) for i, v in read.values.items()]
                )
                claims.release(claims.jobs.popleft())
                staged = np.fromiter(read.values, dtype=np.int64, count=len(read.values))
                progress.staged(len(staged), int(manifest.sample_length[staged].sum()), read.read_bytes)
                taken += self._found_elsewhere(progress, manifest, claims)
                if self._full(leave_room):
                    progress.cache_full = True
                    break
            taken += self._found_elsewhere(progress, manifest, claims)
            await self.store.flush()
            if taken and not self._full(leave_room):
                await self._read_what_others_left(
                    dataset, db, np.array(taken, dtype=np.int64), position, progress, leave_room
                )
            write_failed = self.store.write_errors > write_errors
            cached = await self._cached_mask(db, ids)
            progress.recount(
                int(cached.sum()), int(manifest.sample_length[ids[cached]].sum()), self.store.dataset_usage(db)[1]
            )
            progress.cache_full = self._full(leave_room) or (progress.short and not write_failed)
            if write_failed:
                progress.end(_write_error(self.store, progress))
            else:
                progress.end(_disk_full_error(self.store, progress) if self.store.disk_full else "")
            log.info(
                "staging finished",
                extra={
                    "fields": {
                        "dataset": dataset,
                        "seconds": round(progress.elapsed, 2),
                        "read_bytes": progress.read_bytes,
                        "cache_full": progress.cache_full,
                        "failed_samples": progress.failed_samples,
                    }
                },
            )
            if progress.failed_samples:
                log.warning(
                    "staging skipped samples the PFS would not give",
                    extra={
                        "fields": {
                            "dataset": dataset,
                            "failed_samples": progress.failed_samples,
                            "first": progress.first_failure,
                        }
                    },
                )
        except asyncio.CancelledError:
            progress.end(SHUTTING_DOWN)
            raise
        except Exception as exc:  # reported to the caller through the progress stream
            progress.end(str(exc))
            log.error("staging failed", extra={"fields": {"dataset": dataset, "error": str(exc)}})
        finally:
            claims.close()
            self._done[dataset].set()

    @staticmethod
    def _found_elsewhere(progress: StagingProgress, manifest: Manifest, claims: _RunClaims) -> list[int]:
        """Counts as done what the run skipped because others read it (a rank's
        miss, caching behind a trainer) or it was cached meanwhile; returns their ids."""
        ids = np.fromiter(set(claims.found_elsewhere()), dtype=np.int64)
        if len(ids):
            progress.found_cached(len(ids), int(manifest.sample_length[ids].sum()))
        return ids.tolist()

    async def _read_what_others_left(
        self,
        dataset: str,
        db: str,
        taken: np.ndarray,
        position: np.ndarray,
        progress: StagingProgress,
        leave_room: bool,
    ) -> None:
        """Caches the samples another reader took over from the run: the value
        its read ended with (a read ahead of the ranks hands its values to them,
        not to the cache), else, when its read failed, one read here; so that a
        run that ends well leaves every sample cached. One queued for the cache
        is its taker's to write."""
        manifest = self.registry.get(dataset).manifest
        left = taken[~(await self._cached_mask(db, taken))]
        queued = self.store.queued_values(db, left.tolist())
        claims, me = self.pfs.claims, object()
        mine, theirs = claims.claim(db, [i for i in left.tolist() if i not in queued], me, started=True)
        name = db.encode()
        try:
            got = await wait_for(theirs)
            await self.store.put_many([PendingWrite(name, i, v, leaves_room=leave_room) for i, v in got.items()])
            failed = [i for i in theirs if i not in got]
            mine += claims.claim(db, failed, me, started=True, steal=True)[0]
            ranges = staging_ranges(manifest, np.array(mine, dtype=np.int64), position)
            async for read in self.pfs.stream(dataset, manifest, ranges, self.store.backlog):
                progress.failed(read.failures)
                await self.store.put_many(
                    [PendingWrite(name, i, v, leaves_room=leave_room) for i, v in read.values.items()]
                )
                progress.staged(0, 0, read.read_bytes)  # done counts come from the recount
            await self.store.flush()
        finally:
            claims.release(db, mine, me)

    async def _cached_mask(self, db: str, ids: np.ndarray, step: int = 65536) -> np.ndarray:
        """Which ids are cached, checked in slices so the loop keeps serving."""
        parts = []
        for start in range(0, len(ids), step):
            parts.append(self.store.cached_mask(db, ids[start : start + step]))
            await asyncio.sleep(0)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
