"""Read counters that a process's forked children add to and the process reads.

DataLoader workers do a trainer's reading; their counters are their own
(each reports to the daemon under a client id of its own), so the trainer's
``client.stats()`` would show zeros. The children also add what they count
into one anonymous shared mapping made by the parent, which the parent adds
to its own counters when asked. Forked children only: a spawned worker
starts from a pickle and shares no memory with its parent.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os

import numpy as np

#: Seconds a process waits for the family's lock before it gives up a count
#: (a child killed while holding it must not hang the trainer).
LOCK_SECONDS = 1.0


class FamilyCounters:
    """``width`` float64 counters in memory shared with forked children.

    The process that made it reads (:meth:`totals`); its descendants add
    (:meth:`add`). Values are float64: exact for counts below 2**53.
    """

    def __init__(self, width: int) -> None:
        self._memory = mmap.mmap(-1, 8 * width)  # anonymous, MAP_SHARED: forked children write here
        self._values = np.frombuffer(self._memory, dtype=np.float64)
        self._lock = multiprocessing.get_context("fork").Lock()
        self._owner = os.getpid()

    @property
    def in_owner(self) -> bool:
        """Whether this is the process that made the counters (it reads; children add)."""
        return os.getpid() == self._owner

    def add(self, deltas: np.ndarray) -> None:
        """Adds a child's ``deltas``; dropped if the lock stays held LOCK_SECONDS."""
        if self._lock.acquire(timeout=LOCK_SECONDS):
            try:
                self._values += deltas
            finally:
                self._lock.release()

    def totals(self) -> np.ndarray:
        """A copy of what the children added; zeros if the lock stays held."""
        if not self._lock.acquire(timeout=LOCK_SECONDS):
            return np.zeros_like(self._values)
        try:
            return self._values.copy()
        finally:
            self._lock.release()
