"""Refused bulk connections, counted by reason and logged at a bounded rate.

Anyone who reaches the bulk port can make the listener refuse connections
(hundreds of silent ones, garbage, a wrong token): a log line each would
let them write the daemon's log at the rate they connect. The first refusal
after a quiet spell is logged at once with its detail, so that a misconfigured
peer shows up; those that follow within :data:`LOG_SECONDS` are counted by
reason and go out as one summary line when that spell ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

log = logging.getLogger("dataquay.bulk")

#: The shortest time between two log lines about refused connections.
LOG_SECONDS = 10.0


class RefusalLog:
    """Counts and logs refused bulk connections; callable from any thread."""

    def __init__(self, seconds: float = LOG_SECONDS) -> None:
        self.seconds = seconds
        #: Every connection refused since the listener started.
        self.total = 0
        self._pending: Counter[str] = Counter()
        self._last: dict[str, str] = {}
        self._logged_at = -seconds
        self._lock = threading.Lock()

    def refused(self, reason: str, peer: str, detail: str) -> float | None:
        """Counts one refusal; logs it now if the last line is old enough.

        Returns the seconds after which :meth:`flush` should run where this
        refusal opened a summary that is still to be logged, else None.
        """
        now = time.monotonic()
        with self._lock:
            self.total += 1
            if now - self._logged_at >= self.seconds and not self._pending:
                self._logged_at = now
                fields = {"peer": peer, "reason": reason, "detail": detail, "refused_so_far": self.total}
            else:
                first = not self._pending
                self._pending[reason] += 1
                self._last = {"last_peer": peer, "last_detail": detail}
                return max(0.0, self._logged_at + self.seconds - now) if first else None
        log.warning("closed a bulk connection", extra={"fields": fields})
        return None

    def flush(self) -> None:
        """Logs one line with the refusals counted since the last, if any."""
        with self._lock:
            if not self._pending:
                return
            fields: dict[str, object] = {"refused": dict(self._pending), "refused_so_far": self.total, **self._last}
            self._pending.clear()
            self._logged_at = time.monotonic()
        log.warning("closed bulk connections", extra={"fields": fields})
