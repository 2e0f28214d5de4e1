"""Batches read ahead of a trainer, in a thread, across epoch boundaries.

A reader of ``Dataset.batches`` waits for a batch only when the thread
reading ahead has not got to it yet. The order of a sampler's next epoch is
known (it is seeded), so once an epoch's last batch is read the thread reads
on into the next epoch's first ones, and a rank that joins a job of a known
batch size starts on its first epoch at once: no epoch begins by waiting.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from dataquay.client.sampler import Sampler
from dataquay.client.stats import ReadStats

log = logging.getLogger("dataquay.client")

#: Batches of its first epoch a rank reads once it has joined a job that names its batch size.
JOIN_READ_AHEAD = 2
#: Overrides JOIN_READ_AHEAD; 0 turns it off (for ranks that read through ``get_batch`` alone).
JOIN_READ_AHEAD_ENV = "DATAQUAY_JOIN_READ_AHEAD"


def chunked(ids: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """``ids`` in batches of ``batch_size`` (the last may be shorter)."""
    return [ids[start : start + batch_size] for start in range(0, len(ids), batch_size)]


class Upcoming:
    """The first ``count`` batches of a sampler's next epoch, and how to read them."""

    def __init__(
        self, sampler: Sampler, epoch: int, batch_size: int, count: int, read: Callable[[np.ndarray], list[bytes]]
    ) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.batch_size = batch_size
        self.count = count
        self.read = read

    def chunks(self) -> list[np.ndarray]:
        """Their ids: one permutation of the dataset, so computed in the read-ahead thread."""
        return chunked(self.sampler.indices(self.epoch)[: self.count * self.batch_size], self.batch_size)


class ReadAhead:
    """Reads batches in a thread of its own, at most ``depth`` ahead of the reader.

    ``carried``, an earlier epoch's prefetcher, read ahead the first of
    ``chunks``: its batches are handed on first, and the thread reads the
    rest. Once every chunk is read, the thread reads on into ``then``, the
    next epoch's first batches, which stay queued for the prefetcher of that
    epoch to carry on (:meth:`carries`). At most ``depth`` batches wait in
    the queue and one more is being read, carried ones included.
    """

    def __init__(
        self,
        read: Callable[[np.ndarray], list[bytes]],
        stats: ReadStats,
        chunks: list[np.ndarray],
        depth: int,
        *,
        carried: ReadAhead | None = None,
        then: Upcoming | None = None,
    ) -> None:
        self._read = read
        self._stats = stats
        self._carried = carried
        self._chunks = chunks[len(carried.upcoming) :] if carried is not None else chunks
        self._then = then
        #: The next epoch's chunks read after ``chunks`` (set once known).
        self.upcoming: list[np.ndarray] = []
        self._upcoming_known = threading.Event()
        self._ready: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dataquay-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._stats.reading_ahead()
        try:
            if self._carried is not None and not self._forward(self._carried):
                return
            if not self._read_all(self._read, self._chunks) or self._then is None:
                return
            try:
                self.upcoming = self._then.chunks()
            except Exception as exc:  # the next epoch is then read when it begins
                log.debug("the next epoch's first batches are not read ahead: %s", exc)
                return
            self._upcoming_known.set()
            self._read_all(self._then.read, self.upcoming)
        finally:
            self._upcoming_known.set()

    def _read_all(self, read: Callable[[np.ndarray], list[bytes]], chunks: list[np.ndarray]) -> bool:
        """Reads ``chunks`` into the queue; False once stopped or a read failed."""
        for chunk in chunks:
            try:
                item: object = read(chunk)
            except Exception as exc:  # handed to the reader, who raises it at this batch
                item = exc
            if not self._put(item) or isinstance(item, Exception):
                return False
        return True

    def _forward(self, carried: ReadAhead) -> bool:
        """Hands on the batches ``carried`` read for this epoch; False once stopped or one failed."""
        for _ in carried.upcoming:
            item = carried._get(self._stop)
            if item is None or not self._put(item) or isinstance(item, Exception):
                return False
        return True

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, stop: threading.Event) -> object | None:
        """The next queued item; None once ``stop`` is set."""
        while not stop.is_set():
            try:
                return self._ready.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def carries(self, sampler: Sampler, epoch: int, chunks: list[np.ndarray]) -> bool:
        """Whether the next epoch's batches this read ahead are the first of
        ``chunks``, ``sampler``'s ``epoch`` (waits until their ids are known)."""
        then = self._then
        if then is None or then.sampler is not sampler or then.epoch != epoch:
            return False
        self._upcoming_known.wait()
        upcoming = self.upcoming
        return (
            bool(upcoming)
            and len(upcoming) <= len(chunks)
            and all(np.array_equal(a, b) for a, b in zip(upcoming, chunks))
        )

    def next_batch(self) -> list[bytes]:
        started = time.perf_counter()
        item = self._ready.get()
        self._stats.waited(time.perf_counter() - started)
        if isinstance(item, Exception):
            raise item
        return cast("list[bytes]", item)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._carried is not None:
            self._carried.close()


def join_read_ahead() -> int:
    """Batches a rank reads once it has joined: JOIN_READ_AHEAD unless the environment says otherwise."""
    raw = os.environ.get(JOIN_READ_AHEAD_ENV, "").strip()
    if not raw:
        return JOIN_READ_AHEAD
    if not raw.isdigit():
        raise ValueError(f"environment variable {JOIN_READ_AHEAD_ENV}={raw!r}: expected a number of batches, 0 or more")
    return int(raw)
