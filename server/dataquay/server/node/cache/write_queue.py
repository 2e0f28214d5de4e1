"""The values waiting for the cache writer: bounded in bytes, taken in large
batches, numbered so that a caller can wait until its writes are done, and
found by key, so that a read can take a value that waits here instead of
reading it again."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

MiB = 1 << 20
#: Most values, and bytes, that one write transaction takes.
BATCH_ITEMS = 4096
BATCH_BYTES = 64 * MiB
#: Bytes queued at most: reads stop offering, staging waits (back-pressure).
QUEUE_BYTES = 256 * MiB


@dataclass(frozen=True)
class PendingWrite:
    """One value waiting for the writer: ``value`` is already checksum-framed.

    ``repair`` overwrites a corrupt value; ``reserved`` writes under a
    reservation (:meth:`CacheSpace.reserve`). Neither is dropped because the cache
    is full. ``leaves_room`` inserts only below the exchange's reserve
    (:attr:`CacheSpace.exchange_reserve`): what a node of a job whose owners move
    stages or caches on a read.
    """

    db: bytes
    sample_id: int
    value: bytes | memoryview
    repair: bool = False
    reserved: bool = False
    leaves_room: bool = False

    @property
    def kept_when_full(self) -> bool:
        return self.repair or self.reserved


class WriteQueue:
    """A FIFO of pending writes for one writer task.

    Writes are numbered as they are queued (the number is a ticket); the
    writer resolves each one it committed or dropped, in order, and
    :meth:`wait_resolved` returns once a ticket's writes are resolved.
    """

    def __init__(self) -> None:
        self._items: list[PendingWrite] = []
        self._by_key: dict[tuple[bytes, int], PendingWrite] = {}
        # Writes taken by the writer and not resolved yet: still found by
        # :meth:`waiting` while their transaction commits, so that a sample is
        # always either waiting here or cached, never neither.
        self._taken: deque[PendingWrite] = deque()
        self.queued_bytes = 0
        #: The ticket of the last write queued.
        self.queued_count = 0
        self._resolved = 0
        self._has_work = asyncio.Event()
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._resolved_moved = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def is_full(self) -> bool:
        return self.queued_bytes >= QUEUE_BYTES

    def backlog(self) -> float:
        """How full the queue is, 0 to 1."""
        return min(1.0, self.queued_bytes / QUEUE_BYTES)

    def push(self, write: PendingWrite) -> None:
        self.push_many([write])

    def push_many(self, writes: list[PendingWrite]) -> None:
        """Queues ``writes`` in order, each with the next ticket."""
        if not writes:
            return
        self.queued_count += len(writes)
        self._items += writes
        self._by_key.update(((w.db, w.sample_id), w) for w in writes)
        self.queued_bytes += sum(len(w.value) for w in writes)
        self._idle.clear()
        self._has_work.set()
        if self.is_full:
            self._has_room.clear()

    def take_batch(self) -> list[PendingWrite]:
        """The oldest writes, as many as one transaction takes."""
        size = count = 0
        for write in self._items:
            if count >= BATCH_ITEMS or (count and size + len(write.value) > BATCH_BYTES):
                break
            size += len(write.value)
            count += 1
        batch, self._items = self._items[:count], self._items[count:]
        self._taken.extend(batch)
        self.queued_bytes -= size
        if not self._items:
            self._has_work.clear()
        if not self.is_full:
            self._has_room.set()
        return batch

    def resolve(self, count: int) -> None:
        """Marks the next ``count`` writes as done (committed or dropped)."""
        for _ in range(min(count, len(self._taken))):
            write = self._taken.popleft()
            key = (write.db, write.sample_id)
            if self._by_key.get(key) is write:
                del self._by_key[key]
        self._resolved += count
        self._resolved_moved.set()
        if not self._items:
            self._idle.set()

    def drop(self, db: bytes) -> None:
        """Takes a dataset's writes out of the queue (resolving them): it is being dropped."""
        kept = [w for w in self._items if w.db != db]
        self._resolved += len(self._items) - len(kept)
        self._resolved_moved.set()
        self._items = kept
        self._by_key = {key: w for key, w in self._by_key.items() if key[0] != db}
        self.queued_bytes = sum(len(w.value) for w in kept)
        if not self.is_full:
            self._has_room.set()

    def waiting(self, db: bytes, sample_id: int) -> PendingWrite | None:
        """The latest write of ``sample_id`` to ``db`` not committed yet (in the queue, or being committed), if any."""
        return self._by_key.get((db, sample_id))

    async def wait_for_work(self) -> None:
        await self._has_work.wait()

    async def wait_for_room(self) -> None:
        await self._has_room.wait()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def resolved(self, ticket: int) -> bool:
        return self._resolved >= ticket

    async def wait_resolution(self) -> None:
        """Returns once some write is resolved (or :meth:`wake_all` was called)."""
        self._resolved_moved.clear()
        await self._resolved_moved.wait()

    def wake_all(self) -> None:
        """Wakes everyone waiting on the queue: the writer is gone."""
        self._idle.set()
        self._has_room.set()
        self._resolved_moved.set()
