"""A thread-safe token bucket that caps bytes per second.

PFS reads run in a thread pool and block their thread in
:meth:`TokenBucket.acquire`; the exchange, on the event loop, sleeps what
:meth:`TokenBucket.reserve` says. Capping at the source is what lets staging be
polite to a PFS that other jobs share, and the exchange to a network that
training reads need.
"""

from __future__ import annotations

import threading
import time


class TokenBucket:
    """Admits ``rate`` bytes per second on average, with bursts up to ``burst``."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = float(rate)
        # A tenth of a second of burst keeps the cap tight over short windows.
        self.burst = float(burst if burst is not None else rate / 10)
        # Start empty: a run's average then never exceeds the rate, however short.
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, amount: int) -> None:
        """Blocks the calling thread until ``amount`` bytes may pass (see :meth:`reserve`)."""
        wait = self.reserve(amount)
        if wait > 0:
            time.sleep(wait)

    def reserve(self, amount: int) -> float:
        """Takes ``amount`` bytes now; returns how long the caller must wait before sending them.

        A request larger than the burst is admitted by going into debt, so big
        ranges are not starved; later callers then wait the debt off. Async
        callers sleep the returned time on their loop instead of blocking it.
        """
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= amount
            return -self._tokens / self.rate if self._tokens < 0 else 0.0
