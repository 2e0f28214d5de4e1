"""The daemon's PFS readers: a thread pool behind an optional bandwidth cap.

A request's misses are planned into contiguous ranges (one per file for the
files format, multi-MiB ranges for tar and npy), the ranges are spread over the
pool, and every range passes the token bucket before it is read. The threads
also frame each sample as a cache value (checksum + bytes), so that neither
the event loop nor the cache writer spends time on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dataquay.client.manifest import Manifest
from dataquay.client.pfs import PfsReader, ReadRange, plan_reads
from dataquay.client.records import encode_value
from dataquay.server.ratelimit import TokenBucket


#: Each thread of a request should get at least this much work: a hop to a
#: thread costs tens of microseconds and GIL churn, which only pays off when
#: the reads themselves wait (a PFS's open and read latency, a cold disk).
_GROUP_SECONDS = 0.002
#: Weight of the newest observation in the per-range read time estimate.
_EWMA_WEIGHT = 0.2


class PfsPool:
    """Reads samples from the PFS in ``threads`` threads, capped at ``bandwidth`` B/s."""

    def __init__(self, threads: int, bandwidth: int = 0) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="dataquay-pfs")
        self._bucket = TokenBucket(bandwidth) if bandwidth else None
        self._readers: dict[str, PfsReader] = {}
        self.bytes_read = 0
        self.errors = 0
        # Seconds one planned range takes to read; starts pessimistic (a
        # network PFS) so that the first requests spread over the pool.
        self.range_seconds = 0.001

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def reader(self, dataset: str, manifest: Manifest) -> PfsReader:
        key = f"{dataset}:{manifest.manifest_id}"
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = PfsReader(manifest, dataset)
        return reader

    def _read_ranges(self, reader: PfsReader, ranges: Sequence[ReadRange]) -> dict[int, bytes]:
        """Cache values (see ``records.encode_value``) of the ranges' samples, by id."""
        out: dict[int, bytes] = {}
        started = time.perf_counter()
        for r in ranges:
            if self._bucket is not None:
                self._bucket.acquire(r.length)
            try:
                payloads = reader.read_range(r)
            except OSError:
                self.errors += 1
                raise
            for sample_id, payload in payloads.items():
                out[sample_id] = encode_value(payload)
            self.bytes_read += r.length
        if ranges:
            per_range = (time.perf_counter() - started) / len(ranges)
            self.range_seconds += _EWMA_WEIGHT * (per_range - self.range_seconds)
        return out

    async def read(self, dataset: str, manifest: Manifest, ids: np.ndarray) -> dict[int, bytes]:
        """Cache values of ``ids`` by id, read concurrently; raises PfsReadError."""
        reader = self.reader(dataset, manifest)
        ranges = plan_reads(manifest, ids)
        loop = asyncio.get_running_loop()
        expected = self.range_seconds * len(ranges)
        groups = _split(ranges, min(self.threads, 1 + int(expected / _GROUP_SECONDS)))
        results = await asyncio.gather(
            *(loop.run_in_executor(self._executor, self._read_ranges, reader, g) for g in groups)
        )
        merged: dict[int, bytes] = {}
        for part in results:
            merged.update(part)
        return merged

    async def stream(
        self, dataset: str, manifest: Manifest, ranges: Sequence[ReadRange]
    ) -> AsyncIterator[dict[int, bytes]]:
        """Reads ``ranges`` in order, a few jobs per thread in flight (staging).

        A job holds as many consecutive ranges as take about ``_GROUP_SECONDS``
        to read, by the running estimate: one 1 MiB range, or dozens of small
        files, so that thread hops stay a small part of the work.
        """
        reader = self.reader(dataset, manifest)
        loop = asyncio.get_running_loop()
        window = 2 * self.threads
        pending: list[asyncio.Future[dict[int, bytes]]] = []
        start = 0
        while start < len(ranges):
            per_job = max(1, int(_GROUP_SECONDS / max(self.range_seconds, 1e-6)))
            job = ranges[start : start + per_job]
            start += len(job)
            pending.append(loop.run_in_executor(self._executor, self._read_ranges, reader, job))
            if len(pending) >= window:
                yield await pending.pop(0)
        for future in pending:
            yield await future


def _split(ranges: Sequence[ReadRange], parts: int) -> list[list[ReadRange]]:
    """Deals ranges into at most ``parts`` groups of similar byte counts."""
    groups: list[list[ReadRange]] = [[] for _ in range(min(parts, len(ranges)))]
    loads = [0] * len(groups)
    for r in sorted(ranges, key=lambda r: -r.length):
        i = loads.index(min(loads))
        groups[i].append(r)
        loads[i] += r.length
    return groups
