"""Staging: copying a dataset's samples from the PFS into the node's cache.

Staging reads in the order the job's first epoch will consume the samples, so
a job that starts before staging ends finds its first steps cached. For tar and
npy datasets it keeps reads large: contiguous ranges are read whole, ordered by
the earliest first-epoch position of any sample they hold. Already cached
samples are skipped, so staging again, or after a crash, resumes.

One run per dataset at a time; a second request joins the running one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from dataquay.client.manifest import Manifest
from dataquay.client.pfs import ReadRange, plan_reads
from dataquay.client.placement import epoch_permutation
from dataquay.server.node.cache.manager import Admitted
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.registry import Registry
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

    def recount(self, cached: int, nbytes: int) -> None:
        """What the cache holds of the run's samples once its writes are in:
        the cache may take fewer than were read (full, or evicting), and
        ``dataset show`` counts what it holds."""
        self.done_samples, self.done_bytes = cached, nbytes

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


def staging_ranges(manifest: Manifest, ids: np.ndarray, seed: int) -> list[ReadRange]:
    """The PFS ranges holding ``ids``, ordered by first-epoch position.

    A range's position is that of its earliest sample in epoch 0 of a job with
    ``seed``; for the files format every range is one sample, so the order is
    exactly the epoch's.
    """
    if not len(ids):
        return []
    position = np.empty(manifest.num_samples, dtype=np.int64)
    position[epoch_permutation(manifest.num_samples, seed, 0)] = np.arange(manifest.num_samples)
    ranges = plan_reads(manifest, ids)
    first = np.array([position[r.ids].min() for r in ranges])
    return [ranges[i] for i in np.argsort(first, kind="stable")]


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
        seed: int,
        ids: np.ndarray | None = None,
        leave_room: bool = False,
        held_for_others: int = 0,
        admission: Admitted | None = None,
    ) -> StagingProgress:
        """Starts staging ``ids`` of ``dataset`` (default: all) unless a run is
        going; returns its progress, already ended once the stager is closed.
        ``leave_room`` stops short of the exchange's reserve (a job whose owners
        move); ``held_for_others`` of ``ids`` are other nodes' overflow, as reported;
        ``admission`` is what the cache manager made room for."""
        current = self.runs.get(dataset)
        if current is not None and not current.finished:
            return current
        manifest = self.registry.get(dataset).manifest
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
            self._tasks.spawn(self._run(dataset, seed, ids, progress, leave_room), f"stage-{dataset}")
        return progress

    def running(self, dataset: str) -> bool:
        """Whether a run of ``dataset`` is going (a new request joins it)."""
        current = self.runs.get(dataset)
        return current is not None and not current.finished

    def _full(self, leave_room: bool) -> bool:
        return self.store.space.reserve_reached if leave_room else self.store.full

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

    async def _run(self, dataset: str, seed: int, ids: np.ndarray, progress: StagingProgress, leave_room: bool) -> None:
        entry = self.registry.get(dataset)
        manifest, db = entry.manifest, entry.record.cache_db
        log.info("staging started", extra={"fields": {"dataset": dataset, "samples": len(ids)}})
        write_errors = self.store.write_errors
        try:
            self.store.recheck_space()
            await self.store.open_dataset(db)
            cached = await self._cached_mask(db, ids)
            progress.found_cached(int(cached.sum()), int(manifest.sample_length[ids[cached]].sum()))
            ranges = staging_ranges(manifest, ids[~cached], seed)
            name = db.encode()
            async for read in self.pfs.stream(dataset, manifest, ranges, self.store.backlog):
                progress.failed(read.failures)
                for sample_id, value in read.values.items():
                    await self.store.put(PendingWrite(name, sample_id, value, leaves_room=leave_room))
                staged = np.fromiter(read.values, dtype=np.int64, count=len(read.values))
                progress.staged(len(staged), int(manifest.sample_length[staged].sum()), read.read_bytes)
                if self._full(leave_room):
                    progress.cache_full = True
                    break
            await self.store.flush()
            write_failed = self.store.write_errors > write_errors
            cached = await self._cached_mask(db, ids)
            progress.recount(int(cached.sum()), int(manifest.sample_length[ids[cached]].sum()))
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
            self._done[dataset].set()

    async def _cached_mask(self, db: str, ids: np.ndarray, step: int = 65536) -> np.ndarray:
        """Which ids are cached, checked in slices so the loop keeps serving."""
        parts = []
        for start in range(0, len(ids), step):
            parts.append(self.store.cached_mask(db, ids[start : start + step]))
            await asyncio.sleep(0)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
