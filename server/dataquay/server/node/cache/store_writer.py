"""The cache's one writer: what takes the write queue into LMDB, and what
happens when the map or the file system under it runs out of room.

LMDB allows one writer. Every write transaction (batches of queued values,
deletes, dropped datasets, new sub-databases) runs in one dedicated thread,
one at a time under one lock, so that :class:`~.store.Store` serves reads on
the event-loop thread while the writer grows the map between transactions.
The writer also keeps the books the trees' changes need: each dataset's
payload bytes in the meta data, the pages the trees use, and whether the
cache is full.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES, sample_key
from dataquay.server.errors import CacheWriterError
from dataquay.server.node.cache.cached_ids import CachedIds, ids_of_keys
from dataquay.server.node.cache.file import CacheFile, Growth
from dataquay.server.node.cache.space import CacheSpace
from dataquay.server.node.cache.write_queue import PendingWrite, WriteQueue
from dataquay.server.planning.capacity import refill_margin
from dataquay.server.task_group import WRITER_NICENESS, lower_thread_priority

log = logging.getLogger("dataquay.store")

T = TypeVar("T")

MiB = 1 << 20
#: The sub-database of per-dataset meta data (payload bytes), beside the datasets' own.
META_DB = b"__meta__"
#: How far the map may grow beyond the room for scattered free pages (at
#: most; a 16th of a smaller cache) so that a delete in a full map finds the
#: pages it needs, and a write whose room was reserved finds the pages LMDB
#: keeps aside (those the last transactions freed, which it reuses only later).
HOUSEKEEPING_BYTES = 1 * MiB
#: A cache that keeps filling is said to be full at most this often.
FULL_LOG_SECONDS = 60.0
#: Samples one transaction moves to a dataset's new version.
MOVE_BATCH = 1024


class StoreWriter:
    """The single batched writer of a :class:`~.store.Store`, and its books.

    Args:
        path: the cache directory (for messages).
        file: the cache file, whose map grows as the trees do.
        space: the account of what the cache uses, reserves and has free.
        dbs: the store's open sub-databases by name, which the writer writes into.
    """

    def __init__(self, path: Path, file: CacheFile, space: CacheSpace, dbs: dict[bytes, lmdb._Database]) -> None:
        self.path = path
        self.space = space
        self.queue = WriteQueue()
        #: Serialises write transactions with the map's growth.
        self.lock = asyncio.Lock()
        #: Payload bytes cached per dataset, as recorded in the meta data.
        self.payload_bytes: dict[bytes, int] = {}
        self.meta: lmdb._Database
        self.inserts_dropped = 0
        self.corrupt_repaired = 0
        #: Batches dropped for a failure other than a full map or disk.
        self.write_errors = 0
        #: Writes put (:meth:`Store.put_many`) that are not in the cache after
        #: all (refused, dropped, their batch failed, their dataset deleted):
        #: a caller that saw this count stand still while its writes were
        #: committed need not look them up.
        self.unstored_writes = 0
        self.last_write_error = ""
        self.stopped = False
        #: What each dataset holds, kept as the writer commits.
        self.cached = CachedIds()
        self._dbs = dbs
        self._file = file
        self._room = file.room
        self._full_logged_at = -FULL_LOG_SECONDS
        self._dirty = False
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="dataquay-lmdb-writer", initializer=lower_thread_priority, initargs=(WRITER_NICENESS,)
        )

    def open_meta(self) -> None:
        """Reads the meta data of the environment just opened: each dataset's payload bytes."""
        env = self._file.env
        self.meta = env.open_db(META_DB)
        with env.begin(db=self.meta) as txn:
            for key, value in txn.cursor():
                self.payload_bytes[bytes(key)] = int.from_bytes(value, "little")

    def load_cached(self, name: bytes, handle: lmdb._Database) -> None:
        """Reads which ids a dataset's sub-database holds into :attr:`cached`
        (at open, or in the writer thread)."""
        with self._file.env.begin(db=handle) as txn:
            keys = b"".join(txn.cursor().iternext(keys=True, values=False))
        self.cached.reset(name, ids_of_keys(keys))

    def close(self) -> None:
        """Waits for the transaction in the writer thread, if any, to end."""
        self._thread.shutdown(wait=True)

    async def run(self, work: Callable[[], T]) -> T:
        """Runs ``work`` in the writer thread (under :attr:`lock` where it writes)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def count_live_bytes(self) -> int:
        """Pages of every tree (samples, their sub-databases, the meta data) and the two meta pages."""
        env = self._file.env
        with env.begin() as txn:
            # A copy: the loop thread may add a dataset meanwhile.
            stats = [env.stat(), txn.stat(self.meta), *(txn.stat(h) for h in tuple(self._dbs.values()))]
        return sum(stat_bytes(s) for s in stats) + 2 * stats[0]["psize"]

    # ------------------------------------------------------------- deletes

    async def drop(self, name: bytes) -> int:
        """Deletes a dataset's sub-database; returns how many samples it held."""
        env = self._file.env

        def drop() -> int:
            with env.begin(write=True) as txn:
                # Opened afresh: a drop that failed (a full map) closed the handle.
                handle = env.open_db(name, txn=txn, create=False)
                entries = int(txn.stat(handle)["entries"])
                txn.drop(handle, delete=True)
                txn.delete(name, db=self.meta)
            self.cached.drop(name)
            self.space.live_bytes = self.count_live_bytes()  # room again at once, for what waits for it
            return entries

        async with self.lock:
            entries = await self._deleting(drop)
        self.payload_bytes.pop(name, None)
        return entries

    async def delete(self, name: bytes, handle: lmdb._Database, ids: np.ndarray) -> int:
        """Deletes ``ids`` from a dataset's sub-database; returns how many were there."""
        env = self._file.env

        def delete() -> int:
            removed = freed = 0
            # A view of each value, for its length: popping it would copy every byte that goes.
            with env.begin(write=True, db=handle, buffers=True) as txn:
                cursor = txn.cursor()
                for sample_id in ids.tolist():
                    if cursor.set_key(sample_key(sample_id)):
                        removed += 1
                        freed += len(cursor.value()) - CHECKSUM_BYTES
                        cursor.delete()
                total = max(0, self.payload_bytes.get(name, 0) - freed)
                txn.put(name, total.to_bytes(8, "little"), db=self.meta)
            self.cached.remove(name, ids)
            # LMDB reuses the pages a transaction freed only once a later one
            # has committed: this one lets the next insert use them.
            with env.begin(write=True, db=self.meta) as txn:
                txn.put(name, total.to_bytes(8, "little"))
            self.payload_bytes[name] = total
            self.space.live_bytes = self.count_live_bytes()
            return removed

        async with self.lock:
            removed = await self._deleting(delete)
        self._dirty = True
        return removed

    async def move(
        self,
        old: tuple[bytes, lmdb._Database],
        new: tuple[bytes, lmdb._Database],
        old_ids: np.ndarray,
        new_ids: np.ndarray,
    ) -> tuple[int, int]:
        """Moves the values of ``old_ids`` of one sub-database to ``new_ids``
        of another (a dataset's unchanged samples into its new version), a
        transaction per batch, each as many pages freed as taken; returns the
        (samples, payload bytes) moved."""
        env = self._file.env
        (old_name, old_handle), (new_name, new_handle) = old, new

        def move(olds: list[int], news: list[int]) -> tuple[int, int]:
            moved, nbytes = [], 0
            with env.begin(write=True) as txn:
                for old_id, new_id in zip(olds, news):
                    value = txn.pop(sample_key(old_id), db=old_handle)
                    if value is not None and txn.put(sample_key(new_id), value, db=new_handle, overwrite=False):
                        moved.append(new_id)
                        nbytes += len(value) - CHECKSUM_BYTES
                old_total = max(0, self.payload_bytes.get(old_name, 0) - nbytes)
                new_total = self.payload_bytes.get(new_name, 0) + nbytes
                txn.put(old_name, old_total.to_bytes(8, "little"), db=self.meta)
                txn.put(new_name, new_total.to_bytes(8, "little"), db=self.meta)
            self.cached.remove(old_name, np.asarray(olds, dtype=np.int64))
            self.cached.add(new_name, np.asarray(moved, dtype=np.int64))
            self.payload_bytes[old_name], self.payload_bytes[new_name] = old_total, new_total
            self.space.live_bytes = self.count_live_bytes()
            return len(moved), nbytes

        samples = nbytes = 0
        for start in range(0, len(old_ids), MOVE_BATCH):
            olds, news = old_ids[start : start + MOVE_BATCH].tolist(), new_ids[start : start + MOVE_BATCH].tolist()
            async with self.lock:
                done = await self._deleting(lambda: move(olds, news))
            samples, nbytes = samples + done[0], nbytes + done[1]
        self._dirty = True
        return samples, nbytes

    async def _deleting(self, delete: Callable[[], T]) -> T:
        """Runs ``delete`` in the writer thread. A delete needs pages too (LMDB
        copies what it changes): in a full map it fails, so the map grows
        once (past the capacity by HOUSEKEEPING_BYTES at most, into the file
        system's last free bytes if need be), and it runs again."""
        try:
            return await self.run(delete)
        except lmdb.MapFullError:
            if await self._file.grow(self._housekeeping_limit, slack=0) is not Growth.GREW:
                raise
            return await self.run(delete)

    @property
    def _scattered_limit(self) -> int:
        """How far the map grows for any write that the capacity has room for
        (:meth:`.space.CacheSpace.within_limits`): LMDB puts a large value on
        a run of free pages next to each other, and the free pages that copies
        on write leave scattered may hold no such run. The refill margin: the
        room staging leaves below the capacity, so as far as staging fills the
        map, scattered pages can cost it."""
        return self.space.capacity + refill_margin(self.space.capacity)

    @property
    def _housekeeping_limit(self) -> int:
        return self._scattered_limit + min(HOUSEKEEPING_BYTES, self.space.capacity // 16)

    # ---------------------------------------------------------------- room

    def recheck_space(self) -> None:
        """Takes a full file system for having room again if it has free space
        now, without waiting for the back-off: what an explicit request (a new
        staging run) does, since the user may just have freed space."""
        self._room.recheck_now()
        if self.space.full:
            self.room_again()

    def room_again(self) -> bool:
        """Whether a cache full for lack of disk space may take writes again
        (see :class:`FileSystemRoom`); a commit that fails again marks it full again."""
        if not self.space.disk_full or not self._room.has_room_again():
            return False
        self.space.disk_full = False
        log.info("the cache file system has room again: inserting resumes")
        return True

    def mark_full(self, disk: bool = False, reserved: bool = False) -> None:
        """Stops inserts: the map is at its capacity, or (``disk``) the file system has no space left."""
        was_full = self.space.full
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
                if disk
                else "cache is full: no more inserts, misses are served from the PFS",
                extra={"fields": {"capacity_bytes": self.space.capacity, "cache_dir": str(self.path)}},
            )

    # ------------------------------------------------------------- inserts

    async def flush(self) -> None:
        """Returns once everything queued before the call is committed (or
        dropped); raises :class:`CacheWriterError` if the writer has stopped."""
        await self.queue.wait_idle()
        if len(self.queue):
            self.check()

    async def committed(self, ticket: int) -> None:
        """Returns once the writer has committed everything queued up to ``ticket``.

        What the cache could not take (at capacity) is dropped, not waited
        for: callers that must know check :meth:`Store.cached_mask` afterwards.
        """
        while not self.queue.resolved(ticket):
            self.check()
            await self.queue.wait_resolution()

    def check(self) -> None:
        """Raises :class:`CacheWriterError` if the writer has stopped."""
        if self.stopped:
            raise CacheWriterError(f"the cache writer of {self.path} has stopped; cache writes are not taken")

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
                await self.queue.wait_for_work()
                async with self.lock:
                    batch = self.queue.take_batch()
                    stored = 0
                    try:
                        stored = await self._commit_growing(loop, batch)
                        await self._file.grow_ahead(self.space.capacity)
                    except Exception as exc:
                        self._write_failed(exc, len(batch))
                    finally:
                        self.unstored_writes += len(batch) - stored
                        self.queue.resolve(len(batch))
        finally:
            self.stopped = True
            self.queue.wake_all()

    def _write_failed(self, exc: Exception, count: int) -> None:
        self.write_errors += 1
        self.last_write_error = str(exc) or type(exc).__name__
        self.inserts_dropped += count
        log.error(
            "cache write failed: its values are dropped, misses are served from the PFS",
            exc_info=exc,
            extra={"fields": {"cache_dir": str(self.path), "samples": count}},
        )

    async def run_syncer(self, interval: float = 5.0) -> None:
        """Flushes committed pages to disk now and then, bounding a node
        crash's loss. Beside the writer, not in its thread: a sync writes
        back seconds of commits, and every insert (an exchange's receiver,
        staging) would wait for it meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if self._dirty:
                self._dirty = False
                sync = loop.run_in_executor(None, self._sync)
                try:
                    await asyncio.shield(sync)
                except asyncio.CancelledError:
                    await sync  # the store closes only once no sync is in its map
                    raise

    def _sync(self) -> None:
        with self._file.readers.reading():  # a growth of the map waits for the sync
            self._file.env.sync(True)

    async def _commit_growing(self, loop: asyncio.AbstractEventLoop, batch: list[PendingWrite]) -> int:
        """Commits ``batch``, growing the map as needed; when the map is at
        capacity or the disk is full, commits what fits. Returns how many of
        its writes are in the cache now."""
        batch = [w for w in batch if w.db in self._dbs]
        if self.space.full:
            kept = [w for w in batch if w.kept_when_full]
            self.inserts_dropped += len(batch) - len(kept)
            batch = kept
        within, at_capacity = self.space.within_limits(batch)
        self.inserts_dropped += len(batch) - len(within)
        if at_capacity:
            self.mark_full()
        batch = within
        stored = 0
        while batch:
            try:
                await loop.run_in_executor(self._thread, self._commit, batch)
                return stored + len(batch)
            except lmdb.MapFullError:
                grown = await self._file.grow(self.space.capacity)
                if grown is Growth.AT_LIMIT:  # live pages within the capacity: free ones scattered, or copies
                    reserved = all(w.reserved for w in batch)
                    grown = await self._file.grow(self._housekeeping_limit if reserved else self._scattered_limit)
                if grown is Growth.GREW:
                    continue
                # The map is at its limit, or its file could not be allocated further.
                disk = grown is Growth.NO_SPACE
            except lmdb.Error as exc:
                if not self._room.failed_for_space(exc, sum(len(w.value) for w in batch)):
                    raise
                disk = True
            if len(batch) == 1:
                self.mark_full(disk, reserved=batch[0].reserved)
                if not batch[0].reserved:  # a reserved write is written again (see ExchangeReceiver)
                    self.inserts_dropped += 1
                return stored
            half = len(batch) // 2
            stored += await self._commit_growing(loop, batch[:half])
            batch = [w for w in batch[half:] if w.kept_when_full] if self.space.full else batch[half:]
        return stored

    def _commit(self, batch: Iterable[PendingWrite]) -> None:
        """One write transaction for ``batch``; runs in the writer thread.

        Inserts go through LMDB's C loop (putmulti), the values already cached
        left out by :attr:`cached`: the per-sample Python work of single puts
        would otherwise cap the writer well below LMDB's speed.
        """
        groups: dict[tuple[bytes, bool], dict[int, bytes | memoryview]] = defaultdict(dict)
        for write in batch:
            groups[(write.db, write.repair)][write.sample_id] = write.value
        committed: list[tuple[bytes, np.ndarray]] = []
        added: dict[bytes, int] = defaultdict(int)
        repaired = 0
        with self._file.env.begin(write=True) as txn:
            for (name, repair), values in groups.items():
                ids = np.fromiter(values, dtype=np.int64, count=len(values))
                committed.append((name, ids))
                cursor = txn.cursor(self._dbs[name])
                if repair:
                    cursor.putmulti([(sample_key(i), v) for i, v in values.items()], overwrite=True)
                    repaired += len(values)
                    continue
                new = ids[~self.cached.mask(name, ids)].tolist()
                cursor.putmulti([(sample_key(i), values[i]) for i in new], overwrite=False)
                added[name] += sum(len(values[i]) for i in new) - CHECKSUM_BYTES * len(new)
            for name, delta in added.items():
                total = self.payload_bytes.get(name, 0) + delta
                txn.put(name, total.to_bytes(8, "little"), db=self.meta)
        for name, ids in committed:
            self.cached.add(name, ids)
        for name, delta in added.items():
            self.payload_bytes[name] = self.payload_bytes.get(name, 0) + delta
        self.corrupt_repaired += repaired
        self.space.live_bytes = self.count_live_bytes()
        self._dirty = True


def stat_bytes(stat: Mapping[str, Any]) -> int:
    """Bytes of the pages a tree uses, from its LMDB stat: what deleting all of it frees."""
    return (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
