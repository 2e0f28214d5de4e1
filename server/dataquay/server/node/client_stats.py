"""What the node's trainers report of their own reads and waits.

A client serves local hits from the LMDB map in its own process, so the daemon
never sees them; clients report their cumulative counters now and then, and
this book adds what is new since each client's last report. Cumulative
reports make a lost or repeated report harmless. A client not heard from
for a day is forgotten, which bounds the book on a long-lived node.

A client counts as open until it says it closed or, where the kernel named
its process (the unix socket), that process is gone: a trainer killed by
SIGKILL or the OOM killer sends no last report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

#: Clients not heard from for this long are forgotten.
FORGET_SECONDS = 86400.0
#: Largest count the API carries (uint64): totals stop there, so that one
#: bogus report cannot make the node's Stats unanswerable.
MAX_COUNT = 2**64 - 1

Counts = dict[str, tuple[int, int]]  # tier -> (samples, bytes)


@dataclass
class _Client:
    reads: Counts
    wait: float
    seen: float
    #: Sent its last report: kept as the baseline of a late duplicate, not counted as a client.
    closed: bool = False
    #: The reporting process as the kernel named it; 0 where it named none (TCP).
    pid: int = 0

    @property
    def open(self) -> bool:
        return not self.closed and (not self.pid or _running(self.pid))


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class ClientStatsBook:
    """Node totals over every client that reported."""

    reads: dict[str, list[int]] = field(default_factory=dict)  # tier -> [samples, bytes]
    data_wait_seconds: float = 0.0
    _clients: dict[str, _Client] = field(default_factory=dict)

    def report(
        self, client: str, reads: Counts, wait: float, now: float | None = None, closing: bool = False, pid: int = 0
    ) -> None:
        """Adds what ``client``'s cumulative counters grew by since its last
        report; ``closing``: it has ended, and counts no more among the
        clients; ``pid``: its process, as the kernel named it (0: unknown)."""
        now = time.monotonic() if now is None else now
        last = self._clients.get(client)
        base_reads, base_wait = (last.reads, last.wait) if last is not None else ({}, 0.0)
        for tier, (samples, nbytes) in reads.items():
            old_samples, old_bytes = base_reads.get(tier, (0, 0))
            total = self.reads.setdefault(tier, [0, 0])
            total[0] = min(MAX_COUNT, total[0] + max(0, samples - old_samples))
            total[1] = min(MAX_COUNT, total[1] + max(0, nbytes - old_bytes))
        self.data_wait_seconds += max(0.0, wait - base_wait)
        self._clients[client] = _Client(dict(reads), wait, now, closing, pid)
        self._forget(now)

    @property
    def clients(self) -> int:
        """Clients that reported, have not closed and whose process runs."""
        return sum(c.open for c in self._clients.values())

    def _forget(self, now: float) -> None:
        stale = [name for name, c in self._clients.items() if now - c.seen > FORGET_SECONDS]
        for name in stale:
            del self._clients[name]
