"""Notices of the misses a trainer read from the PFS itself, for its daemon to cache.

A trainer's thread only appends to a bounded backlog here and never waits.
The backlog holds the ids it read and, for a dataset some of whose samples
the daemon found the page cache no longer held, references to the payloads
it already returned (up to :data:`HELD_BYTES`, no copy). Only for such a
dataset: a payload held keeps the trainer's batch alive after the trainer
dropped it, and its next batches take fresh memory, which cost the 110 KiB
miss path a fifth of its rate on two cores (`bench/reads.py`, part miss).

A thread of the client sends the backlog to the daemon in notices of up to
:data:`NOTICE_IDS` ids (CacheBehind), one at a time, so that a daemon slower
to cache than the trainer is to read holds the notices back, not the
trainer. It gathers a notice's worth, or what came in :data:`LINGER_SECONDS`
(each call costs the trainer's process some CPU and its GIL, so a fast
trainer sends a few large notices a second, not one per batch), and sends
it while the trainer pauses between reads (:data:`PAUSE_SECONDS` without a
read, as while it computes a step): the daemon then caches on cores the
trainer does not need. A loader that never pauses has its notices sent
:data:`DEFER_SECONDS` after they came, or once the backlog nears full. A
process that ends (a DataLoader worker at the end of an epoch) sends what
its backlog holds first, for :data:`FLUSH_SECONDS` at most; a daemon found
unreachable meanwhile is told of once, as a read that finds it so tells it.

The daemon reads the samples back from the page cache; those it names as not
held there, the thread copies into its shared-memory segment and hands over
in a second call, if it still holds their payloads. A sample whose notice is
lost (the backlog was full, the page cache and the backlog no longer held its
bytes, the call failed) is remembered, up to :data:`LOST_IDS`, and its next
read goes through the daemon, which reads and caches it
(:meth:`CacheBehindNotices.take_lost`); beyond that, staging or a later read
caches it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from dataquay.client.connection import DaemonConnection
from dataquay.client.errors import DaemonUnavailableError, DataquayError
from dataquay.client.stats import call_at_process_end
from dataquay.client.wire.shm import Segment, SegmentPool
from dataquay.protos import cache_pb2 as pb

log = logging.getLogger("dataquay.client")

MiB = 1 << 20
#: Ids waiting to be noticed at most; more are dropped.
BACKLOG_IDS = 1 << 16
#: Payload bytes the backlog keeps references to, for handing over.
HELD_BYTES = 64 * MiB
#: Most ids, and payload bytes, one notice names: the most the daemon takes
#: (or one sample of any size).
NOTICE_IDS = 4096
NOTICE_BYTES = 64 * MiB
#: How long an entry waits for others to share its notice.
LINGER_SECONDS = 0.05
#: How long the trainer must not have read for it to count as pausing.
PAUSE_SECONDS = 0.002
#: How long a notice waits for the trainer to pause, at most.
DEFER_SECONDS = 1.0
#: How often the thread looks again while the trainer reads.
_LOOK_SECONDS = 0.01
#: Samples whose notice was lost, remembered at most.
LOST_IDS = 1 << 16
#: How long closing a client waits for its backlog to be sent.
FLUSH_SECONDS = 5.0
_ALIGN = 64


@dataclass(frozen=True)
class _Entry:
    dataset: str
    manifest_id: str
    ids: list[int]
    nbytes: int
    payloads: list[bytes] | None  # None: not held
    noted_at: float


class CacheBehindNotices:
    """The backlog of one client and the thread that sends it.

    Thread-safe. A forked child starts with an empty backlog
    (:meth:`after_fork_in_child`) and its own thread, on its first notice.
    """

    def __init__(
        self,
        connection: DaemonConnection,
        segments: SegmentPool,
        timeout: float,
        daemon_down: Callable[[DaemonUnavailableError], None] | None = None,
    ) -> None:
        self._connection = connection
        self._segments = segments
        self._timeout = timeout
        self._daemon_down = daemon_down
        self.after_fork_in_child()

    def after_fork_in_child(self) -> None:
        """Starts empty, with a lock of its own: the parent's thread may have
        held the old one, and does not exist here."""
        self._cond = threading.Condition()
        self._backlog: deque[_Entry] = deque()
        self._ids = 0
        self._bytes = 0
        self._held = 0
        self._sending = False
        self._flushing = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        # The trainer's reads in progress, and when the last one ended (monotonic).
        self._marks = threading.Lock()
        self._reading = 0
        self._read_ended = 0.0
        #: Samples not noticed: the backlog was full, a notice failed, a payload was no longer held.
        self.dropped = 0
        self._lost: dict[tuple[str, str], set[int]] = {}
        self._lost_count = 0
        #: The parent's, in a forked child: it is left alone.
        self._hand_over_seg: Segment | None = None
        #: (dataset, manifest id) of which the daemon could not read some samples back.
        self._holding: set[tuple[str, str]] = set()

    def note(
        self, dataset: str, manifest_id: str, ids: np.ndarray, payloads: list[bytes], nbytes: int | None = None
    ) -> None:
        """Queues a notice of ``payloads`` (``nbytes`` in all, if the caller
        counted them), read for ``ids``; never waits."""
        with self._cond:
            if self._closed:
                return
            if self._ids + len(ids) > BACKLOG_IDS:
                self._drop(dataset, manifest_id, ids.tolist())
                return
            flat = ids.tolist()
            total = sum(map(len, payloads)) if nbytes is None else nbytes
            whole = len(payloads) <= NOTICE_IDS and total <= NOTICE_BYTES
            for start, stop in [(0, len(payloads))] if whole else _parts(payloads):
                part = payloads[start:stop]
                size = total if whole else sum(map(len, part))
                held = (dataset, manifest_id) in self._holding and self._held + size <= HELD_BYTES
                self._held += size if held else 0
                self._backlog.append(
                    _Entry(dataset, manifest_id, flat[start:stop], size, part if held else None, time.monotonic())
                )
            self._ids += len(flat)
            self._bytes += total
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dataquay-cache-behind", daemon=True)
                self._thread.start()
                call_at_process_end(self._flush_at_end)
            self._cond.notify_all()

    @contextmanager
    def trainer_reading(self) -> Iterator[None]:
        """Marks a read of the trainer's: notices wait until it pauses."""
        with self._marks:
            self._reading += 1
        try:
            yield
        finally:
            with self._marks:
                self._reading -= 1
                self._read_ended = time.monotonic()

    def take_lost(self, dataset: str, manifest_id: str, ids: np.ndarray) -> np.ndarray | None:
        """Which of ``ids`` lost their notice (None when none did): their read
        should go through the daemon, which caches them. They are forgotten here."""
        if not self._lost:  # the common answer takes no lock
            return None
        with self._cond:
            lost = self._lost.get((dataset, manifest_id))
            if not lost:
                return None
            mask = np.fromiter((i in lost for i in ids.tolist()), dtype=bool, count=len(ids))
            if not mask.any():
                return None
            before = len(lost)
            lost.difference_update(ids[mask].tolist())
            self._lost_count -= before - len(lost)
            if not lost:
                del self._lost[(dataset, manifest_id)]
        return mask

    def _drop(self, dataset: str, manifest_id: str, ids: list[int]) -> None:
        """Counts ``ids`` as not noticed and remembers them (see :meth:`take_lost`); holds the lock."""
        self.dropped += len(ids)
        room = LOST_IDS - self._lost_count
        if room <= 0:
            return
        lost = self._lost.setdefault((dataset, manifest_id), set())
        before = len(lost)
        lost.update(ids[:room])
        self._lost_count += len(lost) - before

    def _dropped(self, dataset: str, manifest_id: str, ids: list[int]) -> None:
        with self._cond:
            self._drop(dataset, manifest_id, ids)

    def flush(self, timeout: float = FLUSH_SECONDS) -> bool:
        """Waits until the backlog is sent (at most ``timeout`` seconds); whether it was."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._backlog and not self._sending, timeout)
            finally:
                self._flushing -= 1

    def _flush_at_end(self) -> None:
        """Sends the backlog as the process ends (a DataLoader worker at the end of an epoch)."""
        self.flush()

    def close(self) -> None:
        """Sends what the backlog holds (at most FLUSH_SECONDS), then stops the thread."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._hand_over_seg is not None:
            self._hand_over_seg.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._backlog or self._closed)
                self._cond.wait_for(lambda: self._due() or self._fills_notice(), LINGER_SECONDS)
                while not self._due() and (wait := self._until_pause()) > 0:
                    self._cond.wait(wait)
                if self._closed:
                    return
                batch = self._take()
                self._sending = True
            try:
                self._send(batch)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _due(self) -> bool:
        """Whether the backlog is sent now, trainer reading or not; holds the lock."""
        return self._closed or self._flushing > 0 or self._ids > BACKLOG_IDS - NOTICE_IDS

    def _fills_notice(self) -> bool:
        return self._ids >= NOTICE_IDS or self._bytes >= NOTICE_BYTES

    def _until_pause(self) -> float:
        """Seconds to wait before the next look at whether the trainer
        pauses (0: send now); holds the lock."""
        if not self._backlog:
            return 0.0
        now = time.monotonic()
        deferred = self._backlog[0].noted_at + DEFER_SECONDS - now
        if deferred <= 0:
            return 0.0
        if self._reading:
            return min(deferred, _LOOK_SECONDS)
        return max(0.0, min(deferred, self._read_ended + PAUSE_SECONDS - now))

    def _take(self) -> list[_Entry]:
        """The oldest entries of one dataset, as many as one notice names."""
        first = self._backlog.popleft()
        batch, ids, nbytes = [first], len(first.ids), first.nbytes
        while self._backlog:
            nxt = self._backlog[0]
            if (nxt.dataset, nxt.manifest_id) != (first.dataset, first.manifest_id):
                break
            if ids + len(nxt.ids) > NOTICE_IDS or nbytes + nxt.nbytes > NOTICE_BYTES:
                break
            batch.append(self._backlog.popleft())
            ids += len(nxt.ids)
            nbytes += nxt.nbytes
        self._ids -= ids
        self._bytes -= nbytes
        self._held -= sum(e.nbytes for e in batch if e.payloads is not None)
        return batch

    def _send(self, batch: list[_Entry]) -> None:
        dataset, manifest_id = batch[0].dataset, batch[0].manifest_id
        ids = [i for e in batch for i in e.ids]
        request = pb.CacheBehindRequest(dataset=dataset, manifest_id=manifest_id, ids=ids)
        try:
            reply = self._call(request)
        except DataquayError as exc:
            self._dropped(dataset, manifest_id, ids)
            self._failed(exc, "samples read from the PFS not noticed to the daemon")
            return
        if not reply.not_in_page_cache:
            return
        with self._cond:
            self._holding.add((dataset, manifest_id))
        held = {i: p for e in batch if e.payloads is not None for i, p in zip(e.ids, e.payloads)}
        wanted = [(i, held[i]) for i in reply.not_in_page_cache if i in held]
        self._dropped(dataset, manifest_id, [i for i in reply.not_in_page_cache if i not in held])
        if wanted:
            self._hand_over(dataset, manifest_id, wanted)

    def _hand_over(self, dataset: str, manifest_id: str, wanted: list[tuple[int, bytes]]) -> None:
        """Copies the payloads into this client's hand-over segment and names them to the daemon."""
        seg = self._hand_over_segment()
        handed = [] if seg is None else _copy_in(seg, wanted)
        self._dropped(dataset, manifest_id, [i for i, _ in wanted[len(handed) :]])
        if seg is None or not handed:
            return
        request = pb.CacheBehindRequest(
            dataset=dataset, manifest_id=manifest_id, shm_name=seg.name, shm_size=seg.size, handed=handed
        )
        try:
            queued = self._call(request).queued
        except DataquayError as exc:
            self._dropped(dataset, manifest_id, [s.id for s in handed])
            self._failed(exc, "samples read from the PFS not handed to the daemon")
            return
        if queued:
            seg.daemon_mapped()

    def _hand_over_segment(self) -> Segment | None:
        """A /dev/shm segment this process writes: the segments of reads are
        sealed memfds that only the daemon writes into."""
        if self._hand_over_seg is None or self._hand_over_seg.closed:
            try:
                self._hand_over_seg = Segment(self._segments.size)
            except OSError as exc:
                log.debug("no segment to hand samples over in: %s", exc)
                return None
        return self._hand_over_seg

    def _failed(self, exc: DataquayError, what: str) -> None:
        """A call that failed: an unreachable daemon is told of as reads tell it."""
        log.debug("%s: %s", what, exc)
        if isinstance(exc, DaemonUnavailableError) and self._daemon_down is not None:
            self._daemon_down(exc)

    def _call(self, request: pb.CacheBehindRequest) -> pb.CacheBehindReply:
        reply: pb.CacheBehindReply = self._connection.call(
            "CacheBehind", lambda stub: stub.CacheBehind(request, timeout=self._timeout)
        )
        return reply


def _parts(payloads: list[bytes]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive runs of at most NOTICE_IDS payloads and
    NOTICE_BYTES (a larger payload is a run of its own)."""
    bounds: list[tuple[int, int]] = []
    start = nbytes = 0
    for i, payload in enumerate(payloads):
        if i > start and (i - start >= NOTICE_IDS or nbytes + len(payload) > NOTICE_BYTES):
            bounds.append((start, i))
            start, nbytes = i, 0
        nbytes += len(payload)
    if start < len(payloads):
        bounds.append((start, len(payloads)))
    return bounds


def _copy_in(seg: Segment, payloads: list[tuple[int, bytes]]) -> list[pb.Sample]:
    """Writes the payloads one after another into ``seg`` while they fit."""
    out: list[pb.Sample] = []
    at = 0
    for sample_id, payload in payloads:
        if at + len(payload) > seg.size:
            break
        seg.map[at : at + len(payload)] = payload
        out.append(pb.Sample(id=sample_id, shm_offset=at, length=len(payload)))
        at = (at + len(payload) + _ALIGN - 1) // _ALIGN * _ALIGN
    return out
