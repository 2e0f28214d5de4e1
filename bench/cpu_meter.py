"""CPU seconds of a process tree, from /proc: user + system time of every
process below a pid, live or reaped, so that what a daemon's children spend
is counted too, and a meter of a set of such trees and this process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds of the process and its reaped children) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields after the command: state ppid ... utime(14) stime(15) cutime(16) cstime(17).
    return int(fields[1]), sum(int(v) for v in fields[11:15]) / TICKS


def processes() -> dict[int, tuple[int, float]]:
    """(parent pid, CPU seconds) of every process, by pid: one pass over /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(entry)] = _stat(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def cpu_seconds(pid: int, snapshot: dict[int, tuple[int, float]] | None = None) -> float:
    """User + system seconds of ``pid`` and every process below it, live or
    reaped, in ``snapshot`` (default: /proc now)."""
    snapshot = processes() if snapshot is None else snapshot
    tree, grew = {pid}, True
    while grew:
        below = {p for p, (parent, _) in snapshot.items() if parent in tree} - tree
        grew = bool(below)
        tree |= below
    return sum(snapshot[p][1] for p in tree if p in snapshot)


class Meter:
    """CPU seconds spent by a set of processes, and this one as the client, while it is open.

    This process's own time is its CPU clock, read inside the passes over
    /proc, so that the meter's own work is not counted as the client's.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.spent: dict[str, float] = {}

    @contextmanager
    def measure(self) -> Iterator[Meter]:
        before = processes()
        client = time.process_time()
        yield self
        client = time.process_time() - client
        after = processes()
        self.spent = {role: cpu_seconds(pid, after) - cpu_seconds(pid, before) for role, pid in self.pids.items()}
        self.spent["client"] = client
