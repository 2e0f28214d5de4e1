"""The daemon's PFS readers: a thread pool behind an optional bandwidth cap.

A request's misses are planned into contiguous ranges (one per file for the
files format, multi-MiB ranges for tar and npy), the ranges are spread over the
pool, and every range passes the token bucket before it is read. The threads
also frame each sample as a cache value (checksum + bytes), so that neither
the event loop nor the cache writer spends time on it.

A PFS can hang a read for good (an NFS server gone, a hard mount). Every wait
on the threads is therefore bounded: when a call's reads make no progress
(no range read, no thread taking up its work) for ``read_timeout`` seconds,
the call fails with a :class:`PfsReadError` that says so, and the threads
are daemon threads that nobody joins, so shutdown never waits on a read that
will not return.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import numpy as np

from dataquay.client.errors import PfsReadError
from dataquay.client.manifest import Manifest
from dataquay.client.pfs import PfsRangeError, PfsReader, ReadRange, plan_reads
from dataquay.client.wire.records import encode_value
from dataquay.server.daemon_threads import DaemonThreadPool
from dataquay.server.node.reads.claims import PfsClaims, wait_for
from dataquay.server.node.reads.read_window import ReadWindow
from dataquay.server.ratelimit import TokenBucket
from dataquay.server.task_group import STAGING_NICENESS, idle_thread_priority, lower_thread_priority

#: Each thread of a request should get at least this much work: a hop to a
#: thread costs tens of microseconds and GIL churn, which only pays off when
#: the reads themselves wait (a PFS's open and read latency, a cold disk).
_GROUP_SECONDS = 0.002
#: Most ranges one staging job reads in a row.
_STREAM_JOB_RANGES = 64
#: Weight of the newest observation in the per-range read time estimate.
_EWMA_WEIGHT = 0.2
#: Threads caching behind the trainers: notices come one at a time per client.
BEHIND_THREADS = 2

T = TypeVar("T")


class StagedRead(NamedTuple):
    """What one job of a staging stream read: cache values by id, the samples
    the PFS would not give (described), and the bytes it read from the PFS,
    headers and gaps between samples included (what the PFS served, and what
    ``dataquay_pfs_read_bytes_total`` counts)."""

    values: dict[int, bytes]
    failures: list[str]
    read_bytes: int


class RangeClaims(Protocol):
    """A staging run's claims on what it reads (:mod:`.claims`), as its reads see them."""

    def take(self, ranges: Sequence[ReadRange]) -> list[ReadRange]:
        """On the loop, before a job is queued: the part of ``ranges`` the run claimed."""
        ...

    def narrow(self, read_range: ReadRange) -> list[ReadRange]:
        """In the reading thread, just before the read: what of ``read_range`` is still the run's."""
        ...

    def done(self, values: dict[int, bytes]) -> None:
        """In the reading thread: ``values`` are read (their waiters need not wait for the job)."""
        ...


class _Progress:
    """When the reads of one call last moved: a thread took up its work or
    finished a range; and whether the call was left, so that its threads
    stop after the range they are reading."""

    __slots__ = ("at", "stopped")

    def __init__(self) -> None:
        self.at = time.monotonic()
        self.stopped = False

    def mark(self) -> None:
        self.at = time.monotonic()


class PfsPool:
    """Reads samples from the PFS in ``threads`` threads, capped at ``bandwidth`` B/s."""

    def __init__(self, threads: int, bandwidth: int = 0, read_timeout: float = 60.0) -> None:
        self.threads = threads
        self.read_timeout = read_timeout
        self._executor = DaemonThreadPool(threads, "dataquay-pfs")
        # Staging reads are background work, below the cache writer they feed
        # and below reads that a trainer is waiting for.
        self._staging = DaemonThreadPool(
            threads, "dataquay-stage", initializer=lower_thread_priority, initargs=(STAGING_NICENESS,)
        )
        #: Threads of caching behind the trainers, at idle priority: reading
        #: back from the page cache and taking over handed bytes.
        self.behind = DaemonThreadPool(BEHIND_THREADS, "dataquay-behind", initializer=idle_thread_priority)
        self._bucket = TokenBucket(bandwidth) if bandwidth else None
        self._readers: dict[str, PfsReader] = {}
        self.bytes_read = 0
        self.errors = 0
        #: Who reads which sample now: each is read once however many want it.
        self.claims = PfsClaims()
        # Seconds one planned range takes to read; starts pessimistic (a
        # network PFS) so that the first requests spread over the pool.
        self.range_seconds = 0.001

    def close(self) -> None:
        """Drops queued reads; a read in progress ends with the process, unwaited."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._staging.shutdown(wait=False, cancel_futures=True)
        self.behind.shutdown(wait=False, cancel_futures=True)

    def reader(self, dataset: str, manifest: Manifest) -> PfsReader:
        key = f"{dataset}:{manifest.manifest_id}"
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = PfsReader(manifest, dataset)
        return reader

    def _read_ranges(self, reader: PfsReader, ranges: Sequence[ReadRange], progress: _Progress) -> dict[int, bytes]:
        """Cache values (see ``records.encode_value``) of the ranges' samples, by id."""
        return self._read_counted(reader, ranges, progress)[0]

    def _read_counted(
        self, reader: PfsReader, ranges: Sequence[ReadRange], progress: _Progress
    ) -> tuple[dict[int, bytes], int]:
        """Like ``_read_ranges``, with the bytes read from the PFS."""
        out: dict[int, bytes] = {}
        nbytes = 0
        started = time.perf_counter()
        progress.mark()
        for r in ranges:
            if progress.stopped:
                break
            if self._bucket is not None:
                self._bucket.acquire(r.length)
                progress.mark()
            try:
                payloads = reader.read_range(r)
            except OSError:
                self.errors += 1
                raise
            progress.mark()
            for sample_id, payload in payloads.items():
                out[sample_id] = encode_value(payload)
            self.bytes_read += r.length
            nbytes += r.length
        if ranges:
            per_range = (time.perf_counter() - started) / len(ranges)
            self.range_seconds += _EWMA_WEIGHT * (per_range - self.range_seconds)
        return out, nbytes

    async def read(self, dataset: str, manifest: Manifest, ids: np.ndarray) -> dict[int, bytes]:
        """Cache values of ``ids`` by id, read concurrently; raises PfsReadError."""
        reader = self.reader(dataset, manifest)
        ranges = plan_reads(manifest, ids)
        loop = asyncio.get_running_loop()
        progress = _Progress()
        results = await self._bounded(
            [
                loop.run_in_executor(self._executor, self._read_ranges, reader, g, progress)
                for g in self._groups(ranges)
            ],
            progress,
            dataset,
            int(ids[0]) if len(ids) else None,
        )
        merged: dict[int, bytes] = {}
        for part in results:
            merged.update(part)
        return merged

    async def read_once(
        self,
        dataset: str,
        db: str,
        manifest: Manifest,
        ids: np.ndarray,
        keep: Callable[[dict[int, bytes]], Awaitable[None]],
    ) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """``ids`` from the PFS, each read once on this node however many want
        it (:attr:`claims`): one another read is reading is waited for, one
        staging has not started is read here and staging skips it, one whose
        other read failed is read here. ``keep`` gets what this call read
        before its claims end, so that whoever comes next finds it queued
        for the cache. Returns (what this call read, what others read).

        Raises:
            PfsReadError: as :meth:`read`.
        """
        me = object()
        mine, theirs = self.claims.claim(db, ids.tolist(), me, started=True, steal=True)
        try:
            values = await self.read(dataset, manifest, np.array(mine, dtype=np.int64)) if mine else {}
            self.claims.resolve(db, values, me)
            got = await wait_for(theirs)
            left = np.array([i for i in theirs if i not in got], dtype=np.int64)
            if len(left):
                values.update(await self.read(dataset, manifest, left))
            await keep(values)
        finally:
            self.claims.release(db, mine, me)
        return values, got

    async def read_available(
        self, dataset: str, manifest: Manifest, ids: np.ndarray
    ) -> tuple[dict[int, bytes], list[str]]:
        """Like :meth:`read`, but a sample the PFS refuses is left out and
        described, not raised: (cache values by id, failures). For reads
        ahead of the ranks, where one changed file must not cost the rest.

        Raises:
            PfsReadError: the reads made no progress for ``read_timeout`` seconds.
        """
        reader = self.reader(dataset, manifest)
        ranges = plan_reads(manifest, ids)
        loop = asyncio.get_running_loop()
        progress = _Progress()
        results = await self._bounded(
            [
                loop.run_in_executor(self._executor, self._read_ranges_skipping, reader, manifest, g, progress)
                for g in self._groups(ranges)
            ],
            progress,
            dataset,
            int(ids[0]) if len(ids) else None,
        )
        merged: dict[int, bytes] = {}
        failures: list[str] = []
        for values, failed in results:
            merged.update(values)
            failures += failed
        return merged, failures

    async def read_cached(
        self, dataset: str, manifest: Manifest, ids: np.ndarray
    ) -> tuple[dict[int, bytes], list[int], list[int]]:
        """Cache values of those ``ids`` the page cache holds, read without a
        trip to storage (not counted as PFS reads): (values by id, ids it does
        not hold, ids refused). A sample of a file that changed since its
        manifest was built is refused, never a value. Background work: in
        the threads of :attr:`behind`, at idle priority.

        Raises:
            PfsReadError: the reads made no progress for ``read_timeout`` seconds.
        """
        reader = self.reader(dataset, manifest)
        ranges = plan_reads(manifest, ids)
        loop = asyncio.get_running_loop()
        progress = _Progress()
        (result,) = await self._bounded(
            [loop.run_in_executor(self.behind, self._read_cached_ranges, reader, ranges, progress)],
            progress,
            dataset,
            int(ids[0]) if len(ids) else None,
        )
        return result

    def _read_cached_ranges(
        self, reader: PfsReader, ranges: Sequence[ReadRange], progress: _Progress
    ) -> tuple[dict[int, bytes], list[int], list[int]]:
        out: dict[int, bytes] = {}
        not_cached: list[int] = []
        refused: list[int] = []
        for r in ranges:
            if progress.stopped:
                break
            try:
                payloads = reader.read_range_cached(r)
            except PfsReadError:
                refused += r.ids.tolist()
                continue
            progress.mark()
            if payloads is None:
                not_cached += r.ids.tolist()
                continue
            for sample_id, payload in payloads.items():
                out[sample_id] = encode_value(payload)
        return out, not_cached, refused

    def _groups(self, ranges: Sequence[ReadRange]) -> list[list[ReadRange]]:
        """``ranges`` dealt over as many threads as their expected read time is worth."""
        return _split(ranges, min(self.threads, 1 + int(self.range_seconds * len(ranges) / _GROUP_SECONDS)))

    async def _bounded(
        self, futures: list[asyncio.Future[T]], progress: _Progress, dataset: str, first: int | None
    ) -> list[T]:
        """The results of ``futures``, in order; raises the first error among
        them, or PfsReadError once they made no progress for ``read_timeout``
        seconds. Either way the rest are cancelled: queued work is dropped, a
        stuck read is left to its thread."""
        pending: set[asyncio.Future[T]] = set(futures)
        try:
            while pending:
                left = progress.at + self.read_timeout - time.monotonic()
                if left <= 0:
                    raise PfsReadError(
                        f"PFS reads of {dataset!r} (from sample {first}) made no progress in "
                        f"{self.read_timeout:g} s (--pfs-read-timeout): the file system does not answer"
                    )
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_EXCEPTION)
                failed = [f.exception() for f in done if f.exception() is not None]
                if failed:
                    raise failed[0]  # type: ignore[misc]
        finally:
            for future in pending:
                future.cancel()
        return [f.result() for f in futures]

    def _read_ranges_skipping(
        self, reader: PfsReader, manifest: Manifest, ranges: Sequence[ReadRange], progress: _Progress
    ) -> tuple[dict[int, bytes], list[str]]:
        """Like ``_read_ranges``, but a range that fails is retried sample by
        sample and the samples that still fail are skipped: (values, failures)."""
        read = self._read_skipping(reader, manifest, ranges, progress)
        return read.values, read.failures

    def _read_skipping(
        self,
        reader: PfsReader,
        manifest: Manifest,
        ranges: Sequence[ReadRange],
        progress: _Progress,
        claims: RangeClaims | None = None,
    ) -> StagedRead:
        """``_read_ranges_skipping`` with the bytes read from the PFS. With
        ``claims``, only what is still claimed is read, and each range's
        values are handed to their waiters as soon as it is read."""
        out: dict[int, bytes] = {}
        failures: list[str] = []
        nbytes = 0
        for claimed in ranges:
            for r in claims.narrow(claimed) if claims is not None else [claimed]:
                got: dict[int, bytes] = {}
                try:
                    got, n = self._read_counted(reader, [r], progress)
                    nbytes += n
                except PfsRangeError:
                    for sample_id in r.ids.tolist():
                        one = plan_reads(manifest, np.array([sample_id]))
                        try:
                            values, n = self._read_counted(reader, one, progress)
                        except PfsReadError as exc:
                            failures.append(str(exc))
                            continue
                        got.update(values)
                        nbytes += n
                if claims is not None:
                    claims.done(got)
                out.update(got)
        return StagedRead(out, failures, nbytes)

    async def stream(
        self,
        dataset: str,
        manifest: Manifest,
        ranges: Sequence[ReadRange],
        backlog: Callable[[], float],
        claims: RangeClaims | None = None,
    ) -> AsyncIterator[StagedRead]:
        """Reads ``ranges`` in order for staging, only as fast as they are consumed.

        Yields a :class:`StagedRead` per job: a sample the PFS will not give
        is skipped and described, so one bad file does not stop a staging run.

        Ranges go to the threads in jobs of several consecutive ranges (up to
        ``_STREAM_JOB_RANGES``), so thread hops stay a small part of the work
        even for small files. How many jobs are in flight is a
        :class:`ReadWindow`'s: it follows ``backlog()``, the fill (0 to 1)
        of the queue the results go to, and the rate the reads reach at each
        size. From a slow PFS that means every thread; from a fast one, a
        thread or two, since more would only take the CPU (and the GIL) from
        the writer they feed. Once the consumer stops iterating, the jobs
        still queued are dropped and those running stop after their current
        range.

        With ``claims`` (:class:`RangeClaims`), a job reads only what the run
        claimed when it was queued and still holds when its thread gets to
        it; a job left with nothing to read is not queued, nor yielded.
        """
        reader = self.reader(dataset, manifest)
        loop = asyncio.get_running_loop()
        window = ReadWindow(most=2 * self.threads)
        progress = _Progress()
        # Each job in flight with its first sample, which a timeout names.
        pending: deque[tuple[asyncio.Future[StagedRead], int]] = deque()
        per_job = max(1, min(_STREAM_JOB_RANGES, len(ranges) // (4 * self.threads)))

        async def next_job() -> StagedRead:
            job, first = pending.popleft()
            try:
                (result,) = await self._bounded([job], progress, dataset, first)
            except BaseException:
                for later, _ in pending:
                    later.cancel()
                raise
            return result

        try:
            for start in range(0, len(ranges), per_job):
                job = ranges[start : start + per_job]
                if claims is not None:
                    job = claims.take(job)
                    if not job:
                        continue
                future = loop.run_in_executor(
                    self._staging, self._read_skipping, reader, manifest, job, progress, claims
                )
                pending.append((future, int(job[0].ids[0])))
                while len(pending) >= window.size:
                    read = await next_job()
                    yield read
                    window.completed(time.monotonic(), read.read_bytes, backlog())
            while pending:
                yield await next_job()
        finally:
            # A consumer that stops early (a full cache) leaves no reads behind
            # to take the PFS's bandwidth from the reads that follow.
            progress.stopped = True
            for job_left, _ in pending:
                job_left.cancel()


def _split(ranges: Sequence[ReadRange], parts: int) -> list[list[ReadRange]]:
    """Deals ranges into at most ``parts`` groups of similar byte counts."""
    groups: list[list[ReadRange]] = [[] for _ in range(min(parts, len(ranges)))]
    loads = [0] * len(groups)
    for r in sorted(ranges, key=lambda r: -r.length):
        i = loads.index(min(loads))
        groups[i].append(r)
        loads[i] += r.length
    return groups
