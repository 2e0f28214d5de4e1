"""The memory a node's reads ahead of its ranks may hold: one budget, ``--prefetch-memory``.

Two readers fill it: the transfers a node's ranks will read from other nodes
(:mod:`dataquay.server.node.prefetch`) and the samples they will read that no
cache holds, from the PFS (:mod:`dataquay.server.node.overflow`). Each
reserves a read's bytes before it starts it and gives them back once the
samples are handed to a rank or dropped, so what both hold (and have in
flight) never exceeds the budget. The overflow reads as far ahead as it may,
the transfers only a few steps: the overflow is held to a share of the
budget so that the transfers, needed sooner, always find room.
"""

from __future__ import annotations

import asyncio


class PrefetchBudget:
    """Bytes reserved by reads ahead of the ranks, against ``limit``; lives on the event loop.

    Attributes:
        limit: the budget in bytes (0: nothing is read ahead).
        used: bytes reserved now: held for the ranks or being read.
        peak: the most ever reserved at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._waiters: set[asyncio.Future[None]] = set()

    def room(self, share: float = 1.0) -> int:
        """Bytes that may still be reserved within ``share`` of the limit."""
        return max(0, int(self.limit * share) - self.used)

    def take(self, nbytes: int, share: float = 1.0) -> bool:
        """Reserves ``nbytes`` if they fit within ``share`` of the limit; False (nothing reserved) if not."""
        if nbytes > self.room(share):
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def give_back(self, nbytes: int) -> None:
        """Returns reserved bytes and wakes whoever waits for room."""
        if nbytes:
            self.used -= nbytes
            self.wake()

    def wake(self) -> None:
        """Wakes the waiters of :meth:`changed` (room was freed, or the ranks moved on)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def changed(self, timeout: float) -> None:
        """Returns at the next :meth:`wake`, or after ``timeout`` seconds."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            self._waiters.discard(waiter)
