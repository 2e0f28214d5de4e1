"""How much of a node's cache is used, promised and free: the store's
accounting, no I/O.

"Full" is measured, not a latch: the store counts the pages its trees use
after every commit and delete (:attr:`CacheSpace.live_bytes`), so space that
deletes free is room again. Writers that must not lose what they write (the
exchange's receiver) reserve room first; what other inserts may take is
charged against what is left, and inserts for a job whose owners move leave
the exchange's reserve free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.planning.capacity import exchange_reserve, exchange_staging_limit, refill_margin, value_bytes

#: Room never reserved (at most; a 32nd of a smaller cache): pages a commit
#: copies on write, and pages freed by the last commit, which LMDB reuses only
#: after the next one.
RESERVE_SLACK = 512 * 1024


class CacheSpace:
    """The cache's capacity and what of it is used and reserved."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: Full because the file system had no space left, not at the map's capacity.
        self.disk_full = False
        #: Bytes of pages the trees use, as of the last commit or delete.
        self.live_bytes = 0
        #: Bytes promised to reservations and not yet written.
        self.reserved_bytes = 0
        #: live_bytes when the map last filled; None while it has room.
        self._filled_at: int | None = None
        #: live_bytes when the map last refused even a reserved write, which
        #: may grow it past the capacity by the store's housekeeping room.
        self._filled_reserved_at: int | None = None
        self._changed = asyncio.Condition()

    @property
    def full(self) -> bool:
        """Whether inserts stop: the file system has no space, or the map
        filled and nothing has been freed since."""
        return self.disk_full or self._latched(self._filled_at)

    @property
    def refused_reserved(self) -> bool:
        """Whether the map refused a reserved write and nothing was freed since."""
        return self._latched(self._filled_reserved_at)

    def _latched(self, filled_at: int | None) -> bool:
        return filled_at is not None and self.live_bytes > filled_at - self._refill

    @property
    def at_capacity(self) -> bool:
        """Whether the pages in use leave no room for even a little more."""
        return self.live_bytes >= self.capacity - self._refill

    @property
    def _refill(self) -> int:
        return refill_margin(self.capacity)

    @property
    def exchange_reserve(self) -> int:
        """Bytes that inserts which leave room for the exchange leave free:
        where its arrivals go before what leaves is deleted, so that a cache
        short of its share still exchanges."""
        return exchange_reserve(self.capacity)

    @property
    def reserve_reached(self) -> bool:
        """Whether inserts that leave room for the exchange stop (or nearly: a
        sample more would not fit)."""
        return self.full or self.live_bytes >= exchange_staging_limit(self.capacity)

    @property
    def free(self) -> int:
        """Bytes that may still be reserved: none while the file system is
        full or the map refused a reserved write. A map that refused only other
        inserts still takes reservations: a reserved write may use the store's
        housekeeping room, and the exchange that reserves is what frees room
        on every node (a latch here would hold all of them full at once)."""
        if self.disk_full or self.refused_reserved:
            return 0
        slack = min(RESERVE_SLACK, self.capacity // 32)
        return max(0, self.capacity - self.live_bytes - self.reserved_bytes - slack)

    def map_filled(self, reserved: bool = False) -> None:
        """The map had no room for a write (``reserved``: one whose room was
        reserved): full until deletes free some."""
        self._filled_at = self.live_bytes
        if reserved:
            self._filled_reserved_at = self.live_bytes

    def within_limits(self, batch: list[PendingWrite]) -> tuple[list[PendingWrite], bool]:
        """``batch`` without the inserts that would reach into room reserved,
        or beyond the capacity, and whether one was left out for the capacity
        itself (the cache is full). A reserved write has its room; one that
        leaves room for the exchange stops at its reserve."""
        room = self.capacity - self.live_bytes - self.reserved_bytes
        reserve = self.exchange_reserve
        cost = value_bytes(np.fromiter((len(w.value) for w in batch), np.int64, len(batch)))
        if int(cost.sum()) <= room - reserve:
            return batch, False  # far from every limit: the common case while staging
        kept, at_capacity = [], False
        for write, charge in zip(batch, cost.tolist()):
            if not write.kept_when_full:
                if charge > room - (reserve if write.leaves_room else 0):
                    at_capacity = at_capacity or charge > room
                    continue
                room -= charge
            kept.append(write)
        return kept, at_capacity

    async def reserve(self, nbytes: int, timeout: float, keep_free: Callable[[], int] = lambda: 0) -> bool:
        """Waits until the cache has ``nbytes`` of room no one else reserved,
        beyond the ``keep_free()`` bytes the caller leaves to others, and holds
        it for the caller's writes; False if none came in ``timeout`` seconds.
        The caller queues its writes with ``reserved=True`` and calls
        :meth:`release` once they are committed."""
        if self.free - keep_free() >= nbytes:  # without the timer and task of a wait, as every exchange chunk would pay
            self.reserved_bytes += nbytes
            return True
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.free - keep_free() >= nbytes), timeout)
            except TimeoutError:
                return False
            self.reserved_bytes += nbytes
            return True

    async def release(self, nbytes: int) -> None:
        """Gives back a reservation (its writes are committed, or given up)."""
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)
        await self.changed()

    async def changed(self, freed: bool = False) -> None:
        """Wakes the reservations waiting for room; ``freed``: a delete just
        freed pages, which are room again at once."""
        if freed or (self._filled_at is not None and not self.full):
            self._filled_at = None
        if freed or not self._latched(self._filled_reserved_at):
            self._filled_reserved_at = None
        async with self._changed:
            self._changed.notify_all()
