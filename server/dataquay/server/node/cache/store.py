"""The node's cache: one LMDB environment, one named sub-database per dataset.

Policy ("MinIO"): a sample is inserted once and never evicted for capacity.
When the map reaches the configured capacity, or the file system under it has
no space left, the store stops inserting and misses keep being served from the
PFS. "Full" is measured, not a latch: the pages the trees use are counted
after every commit and delete, and :class:`CacheSpace` keeps the account of
what is used, reserved and free. A full file system is re-checked now and
then, since space there may come back from outside the cache.

The environment, its map and how the map grows over the cache file (allocated
ahead, so that LMDB writes through the map) are :mod:`.file`'s. Which
ids each dataset holds is kept in memory too (:mod:`.cached_ids`), by the writer.

Threading: LMDB allows one writer. All writes go through one writer task that
batches queued values into large transactions run in a dedicated thread
(:mod:`.store_writer`). The daemon's own reads are short and run on the
event-loop thread, so the map can be grown from that thread at a moment when
no transaction is open in this process, which is what LMDB requires; the bulk
path's threads, which send values straight out of the map, hold its growth
back while they read (:class:`~.cache_file.MapReaders`). Clients
in other processes read the same environment read-only and pick up a grown
map by themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from dataquay.client.wire.record_loops import sample_keys
from dataquay.client.wire.records import decode_value, sample_key, stored_checksum
from dataquay.server.dirs import ensure_private_dir
from dataquay.server.errors import StartupError
from dataquay.server.node.cache.dir import lock_cache_dir
from dataquay.server.node.cache.file import CacheFile, MapReaders
from dataquay.server.node.cache.space import CacheSpace
from dataquay.server.node.cache.store_writer import StoreWriter, stat_bytes
from dataquay.server.node.cache.write_queue import PendingWrite

#: A sample found in the cache: its payload (checked) and checksum.
Hit = tuple[bytes | memoryview, int]


class Store:
    """LMDB cache with a single batched writer and the MinIO capacity policy."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = Path(path).absolute()
        self.space = CacheSpace(capacity)
        self._file = CacheFile(self.path)
        self._lock_fd: int | None = None
        self._dbs: dict[bytes, lmdb._Database] = {}
        #: Every write goes through it.
        self.writer = StoreWriter(self.path, self._file, self.space, self._dbs)

    # ----------------------------------------------------------- lifecycle

    def open(self) -> None:
        """Opens (or creates) the environment; a killed daemon's cache is reused as is."""
        ensure_private_dir(self.path, "cache dir")
        self._lock_fd = lock_cache_dir(self.path)
        try:
            self._open_env()
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open_env(self) -> None:
        if not self.capacity:
            self.space.capacity = self._file.default_capacity()
        try:
            env = self._file.open(self.capacity)
            self.writer.open_meta()
            for db_name in self.writer.payload_bytes:
                self._dbs[db_name] = env.open_db(db_name, create=False)
                self.writer.load_cached(db_name, self._dbs[db_name])
            self.space.live_bytes = self.writer.count_live_bytes()
        except (lmdb.Error, OSError) as exc:
            self._file.close()
            raise StartupError(f"cannot open the LMDB cache in {self.path}: {exc}") from exc
        if self.space.at_capacity:
            self.writer.mark_full()

    def close(self) -> None:
        """Syncs and closes; queued writes must have been flushed before."""
        self.writer.close()
        self._file.close()
        self._unlock()

    @property
    def is_open(self) -> bool:
        return self._file.is_open

    @property
    def writemap(self) -> bool:
        """Whether LMDB writes through its map (see :mod:`.file`)."""
        return self._file.writemap

    @property
    def env(self) -> lmdb.Environment:
        return self._file.env

    @property
    def map_readers(self) -> MapReaders:
        """The threads reading the map off the event loop (:meth:`value_views`)."""
        return self._file.readers

    # ------------------------------------------------------------- datasets

    def dataset_open(self, db: str) -> bool:
        """Whether the dataset's sub-database is open (:meth:`open_dataset`)."""
        return db.encode() in self._dbs

    async def open_dataset(self, db: str) -> None:
        """Creates the dataset's sub-database if needed (in the writer thread)."""
        name = db.encode()
        if name in self._dbs:
            return

        def open_db() -> lmdb._Database:
            handle = self.env.open_db(name)
            self.writer.load_cached(name, handle)
            return handle

        async with self.writer.lock:
            handle = await self.writer.run(open_db)
        self._dbs[name] = handle

    async def grow_to_hold(self, nbytes: int) -> None:
        """Grows the map ahead of ``nbytes`` of pages to come (between write transactions)."""
        async with self.writer.lock:
            await self._file.grow_to_hold(nbytes, self.space.capacity)

    async def drop_dataset(self, db: str) -> int:
        """Deletes the dataset's cached samples; returns how many there were."""
        name = db.encode()
        queued = len(self.writer.queue)
        self.writer.queue.drop(name)
        self.writer.unstored_writes += queued - len(self.writer.queue)
        if name not in self._dbs:
            if not await self.writer.run(lambda: self._db_exists(name)):
                return 0
            await self.open_dataset(db)
        del self._dbs[name]
        entries = await self.writer.drop(name)
        self.writer.unstored_writes += entries  # written, and gone again
        self.space.disk_full = False
        await self.space.changed(freed=True)
        return entries

    async def carry_over(self, old_db: str, new_db: str, old_ids: np.ndarray, new_ids: np.ndarray) -> tuple[int, int]:
        """Moves cached samples of a dataset's old version to their ids in its
        new one (no PFS read); returns the (samples, payload bytes) moved."""
        if old_db.encode() not in self._dbs or not len(old_ids):
            return 0, 0
        await self.open_dataset(new_db)
        old, new = old_db.encode(), new_db.encode()
        return await self.writer.move((old, self._dbs[old]), (new, self._dbs[new]), old_ids, new_ids)

    def _db_exists(self, name: bytes) -> bool:
        with self.env.begin() as txn:
            return txn.get(name) is not None

    # ---------------------------------------------------------------- reads

    def get_values(self, db: str, ids: Sequence[int]) -> list[bytes | None]:
        """The stored value (checksum, then payload) of each id whose checksum
        holds, None for misses and corrupt values: what the exchange ships."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            return [None] * len(ids)
        out: list[bytes | None] = []
        with self.env.begin(db=handle, buffers=True) as txn:
            get = txn.get
            for sample_id in ids:
                value = get(sample_key(sample_id))
                out.append(None if value is None or decode_value(value) is None else bytes(value))
        return out

    def get_many(
        self,
        db: str,
        ids: Sequence[int],
        into: Callable[[Sequence[int], list[memoryview | None]], list[memoryview | None]] | None = None,
    ) -> tuple[list[Hit | None], list[int]]:
        """(payload, checksum) of each id, None for misses; and the ids found
        corrupt. Each payload is checked, then copied out of the map: by
        ``into(ids, values)``, which copies and checks them where they go and
        gives back the view of each intact copy, else into bytes."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            return [None] * len(ids), []
        out: list[Hit | None] = []
        corrupt: list[int] = []
        with self.env.begin(db=handle, buffers=True) as txn:
            get = txn.get
            values = [get(key) for key in sample_keys(ids)]
            copies = into(ids, values) if into is not None else [None] * len(values)
            for sample_id, value, copy in zip(ids, values, copies):
                if value is None:
                    out.append(None)
                elif copy is not None:
                    out.append((copy, stored_checksum(value)))
                elif (payload := decode_value(value)) is None:
                    corrupt.append(sample_id)
                    out.append(None)
                else:
                    out.append((bytes(payload), stored_checksum(value)))
        return out, corrupt

    @contextmanager
    def value_views(self, db: str) -> Iterator[Callable[[int], memoryview | None]]:
        """A lookup of stored values (checksum, then payload) as views into the
        map, valid until the block ends: what the bulk path sends without a
        copy, off the event loop (the map does not grow meanwhile). Checksums
        are not checked here; the receiver checks them."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            yield lambda _sample_id: None
            return
        with self._file.readers.reading(), self.env.begin(db=handle, buffers=True) as txn:
            get = txn.get
            yield lambda sample_id: get(sample_key(sample_id))

    def queued_values(self, db: str, ids: Iterable[int]) -> dict[int, bytes | memoryview]:
        """The values of ``ids`` queued for the writer and not committed yet
        (read from the PFS or a peer moments ago), by id."""
        name = db.encode()
        waiting = self.writer.queue.waiting
        return {i: write.value for i in ids if (write := waiting(name, i)) is not None}

    def cached_mask(self, db: str, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` are in the cache (committed; see :mod:`.cached_ids`)."""
        return self.writer.cached.mask(db.encode(), ids)

    def dataset_usage(self, db: str) -> tuple[int, int]:
        """(entries, payload bytes) cached for a dataset."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            return 0, 0
        with self.env.begin() as txn:
            entries = int(txn.stat(handle)["entries"])
        return entries, self.writer.payload_bytes.get(db.encode(), 0)

    def tree_bytes(self, db: str) -> int:
        """Bytes of the pages a dataset's tree uses: what deleting from it frees."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            return 0
        with self.env.begin() as txn:
            return stat_bytes(txn.stat(handle))

    def usage(self) -> tuple[int, int]:
        """(bytes of the pages the cache uses, entries over all datasets)."""
        with self.env.begin() as txn:
            entries = sum(int(txn.stat(h)["entries"]) for h in self._dbs.values())
        return self.space.live_bytes, entries

    @property
    def capacity(self) -> int:
        return self.space.capacity

    @property
    def full(self) -> bool:
        """Whether inserts stop (see :attr:`CacheSpace.full`)."""
        return self.space.full

    @property
    def disk_full(self) -> bool:
        """Full because the file system had no space left, not at the map's capacity."""
        return self.space.disk_full

    # --------------------------------------------------------------- writes

    @property
    def inserts_dropped(self) -> int:
        """Values the cache did not take (full, or the queue was)."""
        return self.writer.inserts_dropped

    @property
    def unstored_writes(self) -> int:
        """See :attr:`StoreWriter.unstored_writes`."""
        return self.writer.unstored_writes

    @property
    def corrupt_repaired(self) -> int:
        return self.writer.corrupt_repaired

    @property
    def write_errors(self) -> int:
        """Batches the writer dropped for a failure other than a full map or disk."""
        return self.writer.write_errors

    @property
    def last_write_error(self) -> str:
        return self.writer.last_write_error

    def backlog(self) -> float:
        """How full the write queue is, 0 to 1."""
        return self.writer.queue.backlog()

    def offer(self, write: PendingWrite, past_bound: bool = False) -> bool:
        """Queues a write without waiting; False (and counted) when it cannot be taken.

        Reads use this: a request is never slowed down to wait for the cache.
        ``past_bound`` queues it even when the queue is full (a read of a sample
        staging left to it: dropped, staging would read it again).
        """
        if self.writer.stopped or self._refuses(write) or (self.writer.queue.is_full and not past_bound):
            self.writer.inserts_dropped += 1
            return False
        self.writer.queue.push(write)
        return True

    async def put(self, write: PendingWrite) -> None:
        """Queues a write, waiting while the queue is full (staging back-pressure)."""
        await self.put_many([write])

    async def put_many(self, writes: list[PendingWrite]) -> None:
        """Queues ``writes`` after one wait for room (the queue may pass its
        bound by one call's writes, which the caller bounds); a write the full
        cache has no room for is dropped and counted."""
        queue = self.writer.queue
        self.writer.check()
        while queue.is_full:
            await queue.wait_for_room()
            self.writer.check()
        kept = [w for w in writes if not self._refuses(w)]
        self.writer.inserts_dropped += len(writes) - len(kept)
        self.writer.unstored_writes += len(writes) - len(kept)
        queue.push_many(kept)

    def _refuses(self, write: PendingWrite) -> bool:
        """Whether the cache has no room for ``write`` (before it is queued)."""
        if self.full and not write.kept_when_full and not self.writer.room_again():
            return True
        return write.leaves_room and self.space.reserve_reached

    async def put_all(self, writes: Iterable[PendingWrite]) -> int:
        """Queues ``writes`` like :meth:`put_many`; returns a ticket for :meth:`committed`."""
        await self.put_many(list(writes))
        return self.writer.queue.queued_count

    async def committed(self, ticket: int) -> None:
        """See :meth:`StoreWriter.committed`."""
        await self.writer.committed(ticket)

    async def flush(self) -> None:
        """See :meth:`StoreWriter.flush`."""
        await self.writer.flush()

    async def discard(self, db: str, ids: np.ndarray) -> int:
        """Deletes ``ids`` from a dataset's cache (samples this node gave away);
        returns how many were there."""
        name = db.encode()
        handle = self._dbs.get(name)
        if handle is None or not len(ids):
            return 0
        removed = await self.writer.delete(name, handle, ids)
        await self.space.changed(freed=bool(removed))
        return removed

    def recheck_space(self) -> None:
        """See :meth:`StoreWriter.recheck_space`."""
        self.writer.recheck_space()

    async def run_writer(self) -> None:
        """See :meth:`StoreWriter.run_writer`."""
        await self.writer.run_writer()

    async def run_syncer(self, interval: float = 5.0) -> None:
        """See :meth:`StoreWriter.run_syncer`."""
        await self.writer.run_syncer(interval)
