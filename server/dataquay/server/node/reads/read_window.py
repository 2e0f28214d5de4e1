"""How many staging jobs to keep in flight on the PFS threads.

Reads that wait on the PFS (a network file system's open and read latency)
need many in flight to keep the cache writer fed. Reads the page cache or a
fast disk answers wait for nothing: there every extra thread only contends
for the GIL and the cores, and the reads get slower in wall time and cost
more CPU per byte. Which of the two a PFS is, and how loaded it is, only
the reads themselves can tell.

So the window follows two signals. The writer's queue: while it is nearly
empty the reads are what it waits for, and the window may grow; once reads
run ahead, it halves. And the reads' own rate, measured over a span of
completed jobs at each window: a doubled window is kept only while it reads
at least :data:`GAIN` times the rate of the window half its size, else the
window goes back and does not try that size again for :data:`RETRY_JOBS`
jobs (a PFS whose latency grows under load is then probed again).

Pure bookkeeping over the times and byte counts the caller passes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: A doubled window must read this much faster than the one half its size to be kept.
GAIN = 1.15
#: Jobs after which a size that did not pay is tried again.
RETRY_JOBS = 256
#: The writer's queue (0 to 1) below which it waits for the reads.
STARVED_FILL = 0.05
#: The writer's queue above which the reads run ahead of it.
AHEAD_FILL = 0.15
#: Fewest jobs a window's rate is measured over.
SPAN_JOBS = 4


@dataclass
class _Rate:
    """Bytes per second measured at one window size, and at which job."""

    per_second: float
    at_job: int


@dataclass
class ReadWindow:
    """The number of jobs in flight, between 1 and ``most``.

    Call :meth:`completed` as each job's result is taken, with the time, the
    bytes it read and the writer's queue fill; read :attr:`size` for how many
    to keep in flight.
    """

    most: int
    size: int = 2
    _jobs: int = 0
    _span_start: float | None = None
    _span_bytes: int = 0
    _span_jobs: int = 0
    _rates: dict[int, _Rate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.size = max(1, min(self.size, self.most))

    def completed(self, now: float, nbytes: int, fill: float) -> int:
        """Takes one completed job; returns the window's size."""
        self._jobs += 1
        if fill > AHEAD_FILL:
            self._resize(max(1, self.size // 2), now)
            return self.size
        if self._span_start is None:  # the span's clock starts at its first result
            self._span_start = now
            return self.size
        self._span_bytes += nbytes
        self._span_jobs += 1
        if self._span_jobs < max(SPAN_JOBS, 2 * self.size) or now <= self._span_start:
            return self.size
        rate = self._span_bytes / (now - self._span_start)
        self._rates[self.size] = _Rate(rate, self._jobs)
        smaller = self._fresh(self.size // 2)
        if smaller is not None and rate < GAIN * smaller.per_second:
            self._resize(self.size // 2, now)  # doubling did not pay
        elif fill < STARVED_FILL and self.size < self.most and self._worth_trying(2 * self.size, rate):
            self._resize(min(self.most, 2 * self.size), now)
        else:
            self._restart(now)
        return self.size

    def _worth_trying(self, size: int, rate: float) -> bool:
        """Whether growing to ``size`` may pay: never measured there lately, or faster there."""
        measured = self._fresh(size)
        return measured is None or measured.per_second >= GAIN * rate

    def _fresh(self, size: int) -> _Rate | None:
        measured = self._rates.get(size) if size >= 1 else None
        if measured is None or self._jobs - measured.at_job > RETRY_JOBS:
            return None
        return measured

    def _resize(self, size: int, now: float) -> None:
        self.size = size
        self._restart(now)

    def _restart(self, now: float) -> None:
        self._span_start, self._span_bytes, self._span_jobs = now, 0, 0
