"""What a trainer process read through its client, by tier, and how long it waited.

The counters reported to the daemon are this process's own: a forked
DataLoader worker starts from zero under a client id of its own, so the
daemon, which sums what every client reports, counts each read once. What
a trainer's :meth:`Client.stats` shows adds its forked workers' reads
(:mod:`dataquay.client.family_stats`). A process that counted reads reports
them as it ends, so a DataLoader worker, which neither closes its client nor
sets an epoch, has its reads counted too.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing
import multiprocessing.util
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dataquay.client.family_stats import FamilyCounters
from dataquay.client.wire.tiers import CLIENT_TIERS, LOCAL
from dataquay.protos import cache_pb2 as pb

#: Epochs :meth:`Client.stats` remembers.
EPOCHS_KEPT = 100
#: How often a client reports its counters to its daemon (and at set_epoch and close).
STATS_REPORT_SECONDS = 10.0
#: How often, at most, a rank's moving read position is reported.
POSITION_REPORT_SECONDS = 0.25


@dataclass(frozen=True)
class ClientStats:
    """What this process and its forked children have read through its client, by tier.

    Tiers: those of :data:`dataquay.client.wire.tiers.CLIENT_TIERS`.
    """

    samples: dict[str, int]
    bytes: dict[str, int]
    #: Seconds spent inside get_batch, item access and views: the time a
    #: training loop waited for data.
    data_wait_seconds: float
    #: Local values that failed checksum verification (served via the daemon).
    corrupt_local: int
    #: The epochs read through :meth:`Dataset.batches`, oldest first (the last
    #: EPOCHS_KEPT): how long each took and how much of it was data wait.
    epochs: tuple[EpochWait, ...] = ()
    #: Samples a framework adapter left out because they could not be read
    #: or decoded (``on_error="skip"``).
    skipped: int = 0
    #: Reads of a sample an adapter tried again after it failed (``on_error="retry"``).
    retried: int = 0
    #: Seconds ``set_epoch`` waited for the exchange into its epoch
    #: (``Dataset.sampler(wait_for_exchange=...)``).
    exchange_wait_seconds: float = 0.0


@dataclass(frozen=True)
class EpochWait:
    """One pass of ``Dataset.batches`` over a sampler's epoch."""

    epoch: int
    batches: int
    wall_seconds: float
    data_wait_seconds: float

    @property
    def stall_percent(self) -> float:
        """Share of the epoch's wall time spent waiting for data."""
        return 100 * self.data_wait_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


# The family counters' columns: samples then bytes by tier, then these.
_WAIT = 2 * len(CLIENT_TIERS)
_SKIPPED = _WAIT + 1
_RETRIED = _WAIT + 2
_WIDTH = _WAIT + 3

# Each hook of call_at_process_end -> the process it is registered in.
_process_end_hooks: dict[Callable[[], None], int] = {}
_process_end_lock = threading.Lock()


def call_at_process_end(hook: Callable[[], None]) -> None:
    """Has ``hook`` run when this process ends normally; once per process.

    A child that multiprocessing started (a DataLoader worker) ends with
    ``os._exit``, which runs no atexit handler, and its start clears the
    multiprocessing finalizers it inherited; so the hook is registered from
    within the process that needs it, as one of those finalizers there and
    through atexit anywhere else.
    """
    pid = os.getpid()
    if _process_end_hooks.get(hook) == pid:  # every read asks: the common answer takes no lock
        return
    with _process_end_lock:
        if _process_end_hooks.get(hook) == pid:
            return
        _process_end_hooks[hook] = pid
    if multiprocessing.parent_process() is None:
        atexit.register(hook)
    else:
        multiprocessing.util.Finalize(None, hook, exitpriority=0)


class ReadStats:
    """This process's read counters, shared by a client and its datasets.

    Thread-safe. The object lives as long as its client; a forked child
    resets it in place (:meth:`after_fork_in_child`), so the datasets that
    hold it count into the child's own counters.

    Args:
        at_exit: what reports the counters; called when a process that
            counted something ends (see :func:`call_at_process_end`).
    """

    def __init__(self, at_exit: Callable[[], None] | None = None) -> None:
        self._at_exit = at_exit
        self._family = FamilyCounters(_WIDTH)
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._samples = dict.fromkeys(CLIENT_TIERS, 0)
        self._bytes = dict.fromkeys(CLIENT_TIERS, 0)
        self._wait = 0.0
        self._skipped = 0
        self._retried = 0
        self._exchange_wait = 0.0
        self._epochs: collections.deque[EpochWait] = collections.deque(maxlen=EPOCHS_KEPT)
        self._positions: dict[tuple[str, int], tuple[int, int]] = {}  # (job, rank) -> (epoch, position)
        self._thread = threading.local()
        self._client_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._reported_at = time.monotonic()

    def add(self, tier: str, samples: int, nbytes: int, wait: float = 0.0) -> None:
        """Counts ``samples`` of ``nbytes`` read from ``tier`` and ``wait`` seconds of data wait."""
        with self._lock:
            self._samples[tier] += samples
            self._bytes[tier] += nbytes
            self._wait += wait
        if not self._family.in_owner:
            deltas = np.zeros(_WIDTH)
            column = CLIENT_TIERS.index(tier)
            deltas[[column, len(CLIENT_TIERS) + column, _WAIT]] = samples, nbytes, wait
            self._family.add(deltas)
        if self._at_exit is not None:
            call_at_process_end(self._at_exit)

    def skipped(self) -> None:
        """Counts a sample an adapter left out (``on_error="skip"``)."""
        self._count_error(_SKIPPED)

    def retried(self) -> None:
        """Counts a failed read an adapter tries again (``on_error="retry"``)."""
        self._count_error(_RETRIED)

    def _count_error(self, column: int) -> None:
        with self._lock:
            if column == _SKIPPED:
                self._skipped += 1
            else:
                self._retried += 1
        if not self._family.in_owner:
            deltas = np.zeros(_WIDTH)
            deltas[column] = 1
            self._family.add(deltas)

    def served(self, local_hits: int, local_bytes: int, started: float) -> None:
        """Counts a call's local hits and the time since ``started`` as data
        wait, unless a read-ahead thread made the call (its reader's wait counts)."""
        reading_ahead = getattr(self._thread, "reading_ahead", False)
        self.add(LOCAL, local_hits, local_bytes, 0.0 if reading_ahead else time.perf_counter() - started)

    def reading_ahead(self) -> None:
        """Marks the calling thread as one reading ahead, whose calls are no data wait."""
        self._thread.reading_ahead = True

    def waited(self, seconds: float) -> None:
        """Counts time a reader of batches read ahead waited for one."""
        self.add(LOCAL, 0, 0, seconds)

    def exchange_waited(self, seconds: float) -> None:
        """Counts time ``set_epoch`` waited for the exchange into its epoch."""
        with self._lock:
            self._exchange_wait += seconds

    def epoch_read(self, record: EpochWait) -> None:
        """Remembers one pass of ``Dataset.batches`` (the last EPOCHS_KEPT)."""
        self._epochs.append(record)

    @property
    def data_wait_seconds(self) -> float:
        """The data wait counted so far."""
        with self._lock:
            return self._wait

    def snapshot(self, corrupt_local: int) -> ClientStats:
        """The counters as they stand, with the local cache's count of corrupt
        values; in the process that made them, its forked children's added."""
        with self._lock:
            samples, nbytes, wait = dict(self._samples), dict(self._bytes), self._wait
            skipped, retried, exchange_wait = self._skipped, self._retried, self._exchange_wait
        if self._family.in_owner:
            family = self._family.totals()
            tiers = len(CLIENT_TIERS)
            for column, tier in enumerate(CLIENT_TIERS):
                samples[tier] += int(family[column])
                nbytes[tier] += int(family[tiers + column])
            wait += float(family[_WAIT])
            skipped += int(family[_SKIPPED])
            retried += int(family[_RETRIED])
        return ClientStats(
            samples,
            nbytes,
            wait,
            corrupt_local,
            tuple(self._epochs),
            skipped=skipped,
            retried=retried,
            exchange_wait_seconds=exchange_wait,
        )

    def note_position(self, job_id: str, epoch: int, rank: int, position: int) -> bool:
        """Keeps a rank's read position for the next report; True when one is
        due (POSITION_REPORT_SECONDS since the last)."""
        with self._lock:
            self._positions[(job_id, rank)] = (epoch, position)
        return time.monotonic() - self._reported_at >= POSITION_REPORT_SECONDS

    def report_due(self) -> bool:
        """Whether STATS_REPORT_SECONDS have passed since the last report."""
        return time.monotonic() - self._reported_at >= STATS_REPORT_SECONDS

    def report(self, closing: bool = False) -> pb.ClientStatsReport:
        """The counters as the daemon takes them; the next report is due
        STATS_REPORT_SECONDS from now. ``closing``: the last one of this client."""
        self._reported_at = time.monotonic()
        with self._lock:
            samples, nbytes, wait = dict(self._samples), dict(self._bytes), self._wait
            positions = [
                pb.RankPosition(job=job, epoch=epoch, rank=rank, position=position)
                for (job, rank), (epoch, position) in self._positions.items()
            ]
        return pb.ClientStatsReport(
            client=self._client_id,
            reads=[pb.ClientReads(tier=t, samples=samples[t], bytes=nbytes[t]) for t in CLIENT_TIERS],
            data_wait_seconds=wait,
            read_positions=positions,
            closing=closing,
        )

    def after_fork_in_child(self) -> None:
        """Starts the child's counters from zero under a client id of its own.

        Single-threaded here; the lock may have been held by a thread that
        does not exist in this process.
        """
        self._reset()
