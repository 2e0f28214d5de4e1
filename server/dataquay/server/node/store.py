"""The node's cache: one LMDB environment, one named sub-database per dataset.

Policy ("MinIO"): a sample is inserted once and never evicted for capacity.
When the map reaches the configured capacity, or the file system under it has
no space left, the store stops inserting and misses keep being served from the
PFS. "Full" is measured, not a latch: the pages the trees use are counted
after every commit and delete, and :class:`CacheSpace` keeps the account of
what is used, reserved and free. A full file system is re-checked now and
then, since space there may come back from outside the cache.

The environment, its map and how the map grows over the cache file (allocated
ahead, so that LMDB writes through the map) are :mod:`.cache_file`'s.

Threading: LMDB allows one writer. All writes go through one writer task that
batches queued values into large transactions run in a dedicated thread. The
daemon's own reads are short and run on the event-loop thread, so the map can
be grown from that thread at a moment when no transaction is open in this
process, which is what LMDB requires. Clients in other processes read the same
environment read-only and pick up a grown map by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from dataquay.client.records import CHECKSUM_BYTES, decode_value, sample_key, stored_checksum
from dataquay.server.dirs import ensure_private_dir
from dataquay.server.errors import CacheWriterError, StartupError
from dataquay.server.node.cache_dir import lock_cache_dir
from dataquay.server.node.cache_file import CacheFile, Growth
from dataquay.server.node.cache_space import CacheSpace
from dataquay.server.node.write_queue import PendingWrite, WriteQueue
from dataquay.server.task_group import WRITER_NICENESS, lower_thread_priority

log = logging.getLogger("dataquay.store")

MiB = 1 << 20
_META_DB = b"__meta__"
#: How far the map may grow beyond the capacity (at most; a 16th of a smaller
#: cache) so that a delete in a full map finds the pages it needs, and a write
#: whose room was reserved finds the pages LMDB keeps aside (those the last
#: transactions freed, which it reuses only later).
HOUSEKEEPING_BYTES = 1 * MiB
#: A cache that keeps filling is said to be full at most this often.
FULL_LOG_SECONDS = 60.0


class Store:
    """LMDB cache with a single batched writer and the MinIO capacity policy."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = Path(path).absolute()
        self.space = CacheSpace(capacity)
        self._full_logged_at = -FULL_LOG_SECONDS
        self.inserts_dropped = 0
        self.corrupt_repaired = 0
        #: Batches the writer dropped for a failure other than a full map or disk.
        self.write_errors = 0
        self.last_write_error = ""
        self._writer_stopped = False
        self._file = CacheFile(self.path)
        self._lock_fd: int | None = None
        self._dbs: dict[bytes, lmdb._Database] = {}
        self._payload_bytes: dict[bytes, int] = {}
        self._queue = WriteQueue()
        self._writer = ThreadPoolExecutor(
            1, thread_name_prefix="dataquay-lmdb-writer",
            initializer=lower_thread_priority, initargs=(WRITER_NICENESS,),
        )
        self._write_lock = asyncio.Lock()
        self._dirty = False
        self._room = self._file.room

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
            meta = env.open_db(_META_DB)
            with env.begin(db=meta) as txn:
                for key, value in txn.cursor():
                    self._payload_bytes[bytes(key)] = int.from_bytes(value, "little")
            self._meta = meta
            for db_name in self._payload_bytes:
                self._dbs[db_name] = env.open_db(db_name, create=False)
            self.space.live_bytes = self._count_live_bytes()
        except (lmdb.Error, OSError) as exc:
            self._file.close()
            raise StartupError(f"cannot open the LMDB cache in {self.path}: {exc}") from exc
        if self.space.at_capacity:
            self._mark_full()

    def close(self) -> None:
        """Syncs and closes; queued writes must have been flushed before."""
        self._writer.shutdown(wait=True)
        self._file.close()
        self._unlock()

    @property
    def is_open(self) -> bool:
        return self._file.is_open

    @property
    def writemap(self) -> bool:
        """Whether LMDB writes through its map (see :mod:`.cache_file`)."""
        return self._file.writemap

    @property
    def env(self) -> lmdb.Environment:
        return self._file.env

    # ------------------------------------------------------------- datasets

    def dataset_open(self, db: str) -> bool:
        """Whether the dataset's sub-database is open (:meth:`open_dataset`)."""
        return db.encode() in self._dbs

    async def open_dataset(self, db: str) -> None:
        """Creates the dataset's sub-database if needed (in the writer thread)."""
        name = db.encode()
        if name in self._dbs:
            return
        async with self._write_lock:
            handle = await asyncio.get_running_loop().run_in_executor(
                self._writer, lambda: self.env.open_db(name)
            )
        self._dbs[name] = handle

    async def drop_dataset(self, db: str) -> int:
        """Deletes the dataset's cached samples; returns how many there were."""
        name = db.encode()
        self._queue.drop(name)
        if name not in self._dbs:
            exists = await asyncio.get_running_loop().run_in_executor(
                self._writer, self._db_exists, name
            )
            if not exists:
                return 0
            await self.open_dataset(db)
        del self._dbs[name]

        def drop() -> int:
            with self.env.begin(write=True) as txn:
                # Opened afresh: a drop that failed (a full map) closed the handle.
                handle = self.env.open_db(name, txn=txn, create=False)
                entries = int(txn.stat(handle)["entries"])
                txn.drop(handle, delete=True)
                txn.delete(name, db=self._meta)
            return entries

        async with self._write_lock:
            entries = await self._deleting(drop)
        self._payload_bytes.pop(name, None)
        self.space.disk_full = False
        await self.space.changed(freed=True)
        return entries

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

    def get_many(self, db: str, ids: Sequence[int]) -> tuple[list[tuple[bytes, int] | None], list[int]]:
        """(payload, checksum) of each id, None for misses; and the ids found corrupt."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            return [None] * len(ids), []
        out: list[tuple[bytes, int] | None] = []
        corrupt: list[int] = []
        with self.env.begin(db=handle, buffers=True) as txn:
            get = txn.get
            for sample_id in ids:
                value = get(sample_key(sample_id))
                if value is None:
                    out.append(None)
                    continue
                payload = decode_value(value)
                if payload is None:
                    corrupt.append(sample_id)
                    out.append(None)
                else:
                    out.append((bytes(payload), stored_checksum(value)))
        return out, corrupt

    @contextmanager
    def value_views(self, db: str) -> Iterator[Callable[[int], memoryview | None]]:
        """A lookup of stored values (checksum, then payload) as views into the
        map, valid until the block ends: what the bulk path sends without a
        copy. Checksums are not checked here; the receiver checks them."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            yield lambda _sample_id: None
            return
        with self.env.begin(db=handle, buffers=True) as txn:
            get = txn.get
            yield lambda sample_id: get(sample_key(sample_id))

    def queued_values(self, db: str, ids: Iterable[int]) -> dict[int, bytes]:
        """The values of ``ids`` queued for the writer and not taken by it yet
        (read from the PFS or a peer moments ago), by id."""
        name = db.encode()
        waiting = self._queue.waiting
        return {i: write.value for i in ids if (write := waiting(name, i)) is not None}

    def cached_mask(self, db: str, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` are in the cache (a key lookup, no value is read)."""
        handle = self._dbs.get(db.encode())
        mask = np.zeros(len(ids), dtype=bool)
        if handle is None:
            return mask
        with self.env.begin(db=handle, buffers=True) as txn:
            cursor = txn.cursor()
            for i, sample_id in enumerate(ids.tolist()):
                mask[i] = cursor.set_key(sample_key(sample_id))
        return mask

    def dataset_usage(self, db: str) -> tuple[int, int]:
        """(entries, payload bytes) cached for a dataset."""
        handle = self._dbs.get(db.encode())
        if handle is None:
            return 0, 0
        with self.env.begin() as txn:
            entries = int(txn.stat(handle)["entries"])
        return entries, self._payload_bytes.get(db.encode(), 0)

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

    def _count_live_bytes(self) -> int:
        """Pages of every tree (samples, their sub-databases, the meta data) and the two meta pages."""
        env = self.env
        with env.begin() as txn:
            # A copy: the loop thread may add a dataset meanwhile.
            stats = [env.stat(), txn.stat(self._meta), *(txn.stat(h) for h in tuple(self._dbs.values()))]
        pages = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats) + 2
        return pages * stats[0]["psize"]

    # --------------------------------------------------------------- writes

    def backlog(self) -> float:
        """How full the write queue is, 0 to 1."""
        return self._queue.backlog()

    def offer(self, write: PendingWrite) -> bool:
        """Queues a write without waiting; False (and counted) when it cannot be taken.

        Reads use this: a request is never slowed down to wait for the cache.
        """
        if self._writer_stopped or self._refuses(write) or self._queue.is_full:
            self.inserts_dropped += 1
            return False
        self._queue.push(write)
        return True

    async def put(self, write: PendingWrite) -> None:
        """Queues a write, waiting while the queue is full (staging back-pressure)."""
        self._check_writer()
        while self._queue.is_full:
            await self._queue.wait_for_room()
            self._check_writer()
        if self._refuses(write):
            self.inserts_dropped += 1
            return
        self._queue.push(write)

    async def put_many(self, writes: list[PendingWrite]) -> None:
        """Queues ``writes`` like :meth:`put`, after one wait for room: the
        queue may pass its bound by one call's writes, which the caller bounds."""
        self._check_writer()
        while self._queue.is_full:
            await self._queue.wait_for_room()
            self._check_writer()
        kept = [w for w in writes if not self._refuses(w)]
        self.inserts_dropped += len(writes) - len(kept)
        self._queue.push_many(kept)

    def _refuses(self, write: PendingWrite) -> bool:
        """Whether the cache has no room for ``write`` (before it is queued)."""
        if self.full and not write.kept_when_full and not self._room_again():
            return True
        return write.leaves_room and self.space.reserve_reached

    async def put_all(self, writes: Iterable[PendingWrite]) -> int:
        """Queues ``writes`` like :meth:`put`; returns a ticket for :meth:`committed`."""
        for write in writes:
            await self.put(write)
        return self._queue.queued_count

    async def committed(self, ticket: int) -> None:
        """Returns once the writer has committed everything queued up to ``ticket``.

        What the cache could not take (at capacity) is dropped, not waited
        for: callers that must know check :meth:`cached_mask` afterwards.
        """
        while not self._queue.resolved(ticket):
            self._check_writer()
            await self._queue.wait_resolution()

    async def discard(self, db: str, ids: np.ndarray) -> int:
        """Deletes ``ids`` from a dataset's cache (samples this node gave away);
        returns how many were there."""
        name = db.encode()
        handle = self._dbs.get(name)
        if handle is None or not len(ids):
            return 0

        def delete() -> int:
            removed = freed = 0
            with self.env.begin(write=True, db=handle) as txn:
                for sample_id in ids.tolist():
                    key = sample_key(sample_id)
                    value = txn.pop(key)
                    if value is not None:
                        removed += 1
                        freed += len(value) - CHECKSUM_BYTES
                total = max(0, self._payload_bytes.get(name, 0) - freed)
                txn.put(name, total.to_bytes(8, "little"), db=self._meta)
            # LMDB reuses the pages a transaction freed only once a later one
            # has committed: this one lets the next insert use them.
            with self.env.begin(write=True, db=self._meta) as txn:
                txn.put(name, total.to_bytes(8, "little"))
            self._payload_bytes[name] = total
            self.space.live_bytes = self._count_live_bytes()
            return removed

        async with self._write_lock:
            removed = await self._deleting(delete)
        self._dirty = True
        await self.space.changed(freed=bool(removed))
        return removed

    async def _deleting(self, delete: Callable[[], int]) -> int:
        """Runs ``delete`` in the writer thread. A delete needs pages too (LMDB
        copies what it changes): in a full map it fails, so the map grows
        once (past the capacity by HOUSEKEEPING_BYTES at most, into the file
        system's last free bytes if need be), and it runs again."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._writer, delete)
        except lmdb.MapFullError:
            if self._file.grow(self._housekeeping_limit, slack=0) is not Growth.GREW:
                raise
            return await loop.run_in_executor(self._writer, delete)

    @property
    def _housekeeping_limit(self) -> int:
        return self.capacity + min(HOUSEKEEPING_BYTES, self.capacity // 16)

    def recheck_space(self) -> None:
        """Takes a full file system for having room again if it has free space
        now, without waiting for the back-off: what an explicit request (a new
        staging run) does, since the user may just have freed space."""
        self._room.recheck_now()
        if self.full:
            self._room_again()

    def _room_again(self) -> bool:
        """Whether a cache full for lack of disk space may take writes again
        (see :class:`FileSystemRoom`); a commit that fails again marks it full again."""
        if not self.disk_full or not self._room.has_room_again():
            return False
        self.space.disk_full = False
        log.info("the cache file system has room again: inserting resumes")
        return True

    async def flush(self) -> None:
        """Returns once everything queued before the call is committed (or
        dropped); raises :class:`CacheWriterError` if the writer has stopped."""
        await self._queue.wait_idle()
        if len(self._queue):
            self._check_writer()

    async def run_writer(self) -> None:
        """The single writer: commits queued values in large transactions, forever.

        A batch that fails for a reason other than a full map or disk is
        dropped, logged and counted in :attr:`write_errors`, and the writer
        goes on: nothing waits on a writer that is gone. Should the writer
        end all the same, everything waiting on it is woken and fails with
        :class:`CacheWriterError`.
        """
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._queue.wait_for_work()
                async with self._write_lock:
                    batch = self._queue.take_batch()
                    try:
                        await self._commit_growing(loop, batch)
                        self._file.grow_ahead(self.capacity)
                    except Exception as exc:
                        self._write_failed(exc, len(batch))
                    finally:
                        self._queue.resolve(len(batch))
        finally:
            self._writer_stopped = True
            self._queue.wake_all()

    def _write_failed(self, exc: Exception, count: int) -> None:
        self.write_errors += 1
        self.last_write_error = str(exc) or type(exc).__name__
        self.inserts_dropped += count
        log.error(
            "cache write failed: its values are dropped, misses are served from the PFS",
            exc_info=exc, extra={"fields": {"cache_dir": str(self.path), "samples": count}},
        )

    def _check_writer(self) -> None:
        if self._writer_stopped:
            raise CacheWriterError(f"the cache writer of {self.path} has stopped; cache writes are not taken")

    async def run_syncer(self, interval: float = 5.0) -> None:
        """Flushes committed pages to disk now and then, bounding a node crash's loss."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if self._dirty:
                self._dirty = False
                async with self._write_lock:
                    await loop.run_in_executor(self._writer, self.env.sync, True)

    async def _commit_growing(self, loop: asyncio.AbstractEventLoop, batch: list[PendingWrite]) -> None:
        """Commits ``batch``, growing the map as needed; when the map is at
        capacity or the disk is full, commits what fits."""
        batch = [w for w in batch if w.db in self._dbs]
        if self.full:
            kept = [w for w in batch if w.kept_when_full]
            self.inserts_dropped += len(batch) - len(kept)
            batch = kept
        within = self.space.within_limits(batch)
        self.inserts_dropped += len(batch) - len(within)
        batch = within
        while batch:
            try:
                await loop.run_in_executor(self._writer, self._commit, batch)
                return
            except lmdb.MapFullError:
                grown = self._file.grow(self.capacity)
                if grown is Growth.AT_LIMIT and all(w.reserved for w in batch):
                    grown = self._file.grow(self._housekeeping_limit)
                if grown is Growth.GREW:
                    continue
                # The map is at its limit, or its file could not be allocated further.
                disk = grown is Growth.NO_SPACE
            except lmdb.Error as exc:
                if not self._room.failed_for_space(exc, sum(len(w.value) for w in batch)):
                    raise
                disk = True
            if len(batch) == 1:
                self._mark_full(disk, reserved=batch[0].reserved)
                if not batch[0].reserved:  # a reserved write is written again (see ExchangeReceiver)
                    self.inserts_dropped += 1
                return
            half = len(batch) // 2
            await self._commit_growing(loop, batch[:half])
            batch = [w for w in batch[half:] if w.kept_when_full] if self.full else batch[half:]

    def _mark_full(self, disk: bool = False, reserved: bool = False) -> None:
        was_full = self.full
        if disk:
            self._room.back_off()
            self.space.disk_full = True
        else:
            self.space.map_filled(reserved)
        # A cache that gives samples away fills and frees again and again: say it once a while.
        now = time.monotonic()
        if not was_full and now - self._full_logged_at >= FULL_LOG_SECONDS:
            self._full_logged_at = now
            log.warning(
                "cache file system is full: no more inserts until it has space, misses are served from the PFS"
                if disk else "cache is full: no more inserts, misses are served from the PFS",
                extra={"fields": {"capacity_bytes": self.capacity, "cache_dir": str(self.path)}},
            )

    def _commit(self, batch: Iterable[PendingWrite]) -> None:
        """One write transaction for ``batch``; runs in the writer thread.

        Inserts go through LMDB's C loops (getmulti to find what is already
        cached, putmulti to insert the rest): the per-sample Python work of
        single puts would otherwise cap the writer well below LMDB's speed.
        """
        groups: dict[tuple[bytes, bool], list[tuple[bytes, bytes]]] = defaultdict(list)
        for write in batch:
            groups[(write.db, write.repair)].append((sample_key(write.sample_id), write.value))
        added: dict[bytes, int] = defaultdict(int)
        repaired = 0
        with self.env.begin(write=True) as txn:
            for (name, repair), items in groups.items():
                cursor = txn.cursor(self._dbs[name])
                if repair:
                    cursor.putmulti(items, overwrite=True)
                    repaired += len(items)
                    continue
                present = {bytes(key) for key, _ in cursor.getmulti([key for key, _ in items])}
                new = list({key: value for key, value in items if key not in present}.items())
                cursor.putmulti(new, overwrite=False)
                added[name] += sum(len(value) for _, value in new) - CHECKSUM_BYTES * len(new)
            for name, delta in added.items():
                total = self._payload_bytes.get(name, 0) + delta
                txn.put(name, total.to_bytes(8, "little"), db=self._meta)
        for name, delta in added.items():
            self._payload_bytes[name] = self._payload_bytes.get(name, 0) + delta
        self.corrupt_repaired += repaired
        self.space.live_bytes = self._count_live_bytes()
        self._dirty = True

