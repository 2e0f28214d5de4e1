"""The cache's file and the LMDB map over it: how large the map is, how it
grows, and whether LMDB writes through it.

With ``writemap`` LMDB writes its pages straight into a shared map of the data
file, not through a copy and a ``pwrite`` per page run: commits several times
faster here (bench/experiments/wire.py measures it). A write through the map
into a hole of the file on a full disk is a
SIGBUS that kills the daemon, so the map only ever covers blocks allocated
ahead (``fallocate``): the whole file before the environment opens, and each
growth before the map grows over it. LMDB with ``writemap`` sets the file's
size to the map's itself (a sparse ``ftruncate``); allocating first makes
that a no-op. On a file system short of space the map grows only as far as
its free space allows, and the store reports full as a failed commit does
without ``writemap``. Where ``fallocate`` is not supported, or holds no
overwrite (a copy-on-write file system writes each page anew, and may find
the disk full then), the environment opens without ``writemap``, as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import mmap
import os
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from enum import Enum
from pathlib import Path

import lmdb

from dataquay.client.file_systems import file_system_type
from dataquay.server.dirs import FILE_MODE, close_to_others
from dataquay.server.node.cache.dir import DISK_SLACK_BYTES, FileSystemRoom

log = logging.getLogger("dataquay.store")

MiB = 1 << 20
DATA_FILE = "data.mdb"
#: LMDB's lock file: a reader takes a slot in it, so a reader must be able to write it.
LMDB_LOCK_FILE = "lock.mdb"
#: Named sub-databases: one per registered dataset (replaced ones are dropped), and the meta data.
MAX_DBS = 1024 + 1
#: Reader slots shared by the daemon and every client process on the node.
MAX_READERS = 4096
#: A new map's size without ``writemap``: a sparse file takes no blocks for it.
INITIAL_MAP = 256 * MiB
#: A new map's size over a file allocated ahead, whose every byte takes a
#: block: small, so an idle or nearly empty cache (a node of a small job, a
#: test's daemon) holds little disk; it doubles as the cache fills.
ALLOCATED_INITIAL_MAP = 8 * MiB
#: The map a new environment opens with under ``writemap``: room for LMDB's
#: two meta pages, which it writes with ``pwrite``. A file allocated before
#: them would read as an invalid environment, so the map grows over an
#: allocated file only once they are written.
_LEAST_MAP = 64 * 1024
#: :meth:`CacheFile.grow_to_hold` adds 1/HOLD_MARGIN to the bytes it is told
#: to come: estimates of LMDB's pages are within a few percent, and one
#: page too few would have the map grow again as the last values land.
HOLD_MARGIN = 16
_PROBE_FILE = ".allocate-probe"
#: File systems that write a changed block elsewhere (copy on write), by
#: statfs magic: a block allocated ahead does not hold its overwrites there.
COPY_ON_WRITE = {0x9123683E: "btrfs", 0x2FC12FC1: "zfs", 0xCA451A4E: "bcachefs"}

# glibc's posix_fallocate emulates a file system without fallocate by writing
# a byte into every block, which allocates nothing on a copy-on-write one:
# the system call is asked directly, so such a file system says so.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


class Allocation(Enum):
    """How allocating a range of the cache file ahead went."""

    DONE = "done"
    NO_SPACE = "no space"
    UNSUPPORTED = "unsupported"


class Growth(Enum):
    """How growing the map went."""

    GREW = "grew"
    AT_LIMIT = "at limit"
    NO_SPACE = "no space"


def allocate(fd: int, offset: int, length: int) -> Allocation:
    """Allocates ``length`` bytes of the file from ``offset`` (extending it).

    Raises:
        OSError: fallocate failed for a reason other than space or support.
    """
    if length <= 0 or _libc.fallocate(fd, 0, offset, length) == 0:
        return Allocation.DONE
    code = ctypes.get_errno()
    if code in (errno.ENOSPC, errno.EDQUOT):
        return Allocation.NO_SPACE
    if code in (errno.EOPNOTSUPP, errno.ENOSYS):
        return Allocation.UNSUPPORTED
    raise OSError(code, os.strerror(code))


def writes_through_map(allocated: Allocation, fs_type: int) -> bool:
    """Whether LMDB may write through its map, given how allocating the file
    (or, for a new environment, a probe) went and the file system's type:
    only over a file without holes whose blocks take its overwrites, where a
    write never needs a block the disk may not have."""
    return allocated is Allocation.DONE and fs_type not in COPY_ON_WRITE


def grown_size(current: int, limit: int, room: int | None, wanted: int = 0) -> int:
    """The map's next size: ``wanted`` if given, else double; up to ``limit``,
    and by ``room`` bytes at most where the file is allocated ahead (None:
    without writemap)."""
    target = min(limit, wanted or 2 * current)
    if room is not None:
        target = min(target, current + room)
    return max(current, target)


class MapReaders:
    """Threads that read the map off the event loop (the bulk path sends
    values straight out of it), kept apart from the map's growth.

    LMDB grows a map by unmapping it and mapping it again, maybe elsewhere:
    a thread inside a read transaction then would read unmapped memory and
    kill the daemon. A growth holds new readers back and waits, off the
    event loop's back, until those reading are done; they wait while the map
    moves. The event loop's own reads need nothing: growth runs on its thread.
    """

    #: How often a growth looks again whether the readers are done.
    POLL_SECONDS = 0.001

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reading = 0
        self._moving = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read transaction off the event loop (and every use of its views)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._moving)
            self._reading += 1
        try:
            yield
        finally:
            with self._cond:
                self._reading -= 1

    def growth_waiting(self) -> bool:
        """Whether a growth waits for the readers: one that holds views over a
        long wait (a send to a slow peer) should copy what it still needs and let go."""
        return self._moving

    @asynccontextmanager
    async def still(self) -> AsyncIterator[None]:
        """No thread reads the map inside this block (on the event loop)."""
        with self._cond:
            self._moving = True
        try:
            while True:
                with self._cond:
                    if not self._reading:
                        break
                await asyncio.sleep(self.POLL_SECONDS)
            yield
        finally:
            with self._cond:
                self._moving = False
                self._cond.notify_all()


class CacheFile:
    """The cache's LMDB environment over its data file: opening, and the map's growth."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data_file = path / DATA_FILE
        self.room = FileSystemRoom(path)
        self.readers = MapReaders()
        #: Whether LMDB writes through its map (over a file allocated ahead).
        self.writemap = False
        self._fd: int | None = None
        self._env: lmdb.Environment | None = None

    def existing_bytes(self) -> int:
        """The size of the data file a daemon before this one left (0 if none)."""
        return self.data_file.stat().st_size if self.data_file.exists() else 0

    def default_capacity(self) -> int:
        """The capacity when none is set: 80% of what the file system holds
        besides other files (the cache file's own bytes count as free)."""
        return int((shutil.disk_usage(self.path).free + self.existing_bytes()) * 0.8)

    def open(self, capacity: int) -> lmdb.Environment:
        """Opens (or creates) the environment with a map of the capacity, up
        to :data:`ALLOCATED_INITIAL_MAP` allocated ahead where the file system
        can, else up to :data:`INITIAL_MAP`.

        Raises:
            lmdb.Error: LMDB cannot open the environment.
            OSError: the data file cannot be opened or allocated.
        """
        existing = self.existing_bytes()
        self._fd = os.open(self.data_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            # An existing file is allocated whole first: a hole left in it
            # (a file written without writemap) would take a write through the map.
            allocated = allocate(self._fd, 0, existing) if existing else self._probe()
            self.writemap = writes_through_map(allocated, file_system_type(self.path))
            target = max(existing, min(capacity, ALLOCATED_INITIAL_MAP if self.writemap else INITIAL_MAP))
            self._env = self._open_env((existing or _LEAST_MAP) if self.writemap else target)
            if self.writemap and not existing and allocate(self._fd, 0, self.map_size) is not Allocation.DONE:
                # No room even for the least map: written through as before.
                self._env.close()
                self.writemap = False
                self._env = self._open_env(max(existing, min(capacity, INITIAL_MAP)))
            for name in (DATA_FILE, LMDB_LOCK_FILE):
                if existing:
                    close_to_others(self.path / name)
                else:
                    (self.path / name).chmod(FILE_MODE)
            if self.writemap:
                self._grow_to(min(target, self.map_size + self._room_beyond(DISK_SLACK_BYTES)))
        except BaseException:
            self.close()
            raise
        if not self.writemap:
            log.info(
                "the cache file cannot be allocated ahead (or its file system copies on write): "
                "LMDB writes it without writemap",
                extra={"fields": {"cache_dir": str(self.path)}},
            )
        return self._env

    def _open_env(self, map_size: int) -> lmdb.Environment:
        return lmdb.open(
            str(self.path),
            map_size=map_size,
            writemap=self.writemap,
            max_dbs=MAX_DBS,
            max_readers=MAX_READERS,
            # Durability comes from the PFS, not from fsync: a killed process
            # loses nothing (the page cache holds every commit), and the
            # store's periodic sync bounds what a node crash can lose.
            sync=False,
            metasync=False,
            readahead=True,
            meminit=False,
            mode=FILE_MODE,
        )

    def _probe(self) -> Allocation:
        """Whether the file system allocates ahead, asked of a scratch file
        (a new environment's file must stay empty until LMDB writes it)."""
        probe = self.path / _PROBE_FILE
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            return allocate(fd, 0, 4096)
        finally:
            os.close(fd)
            probe.unlink()

    def close(self) -> None:
        """Syncs and closes the environment, and lets go of the file."""
        if self._env is not None:
            self._env.sync(True)
            self._env.close()
            self._env = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def is_open(self) -> bool:
        return self._env is not None

    @property
    def env(self) -> lmdb.Environment:
        if self._env is None:
            raise RuntimeError("store is not open")
        return self._env

    @property
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    async def grow(self, limit: int, slack: int = DISK_SLACK_BYTES, wanted: int = 0) -> Growth:
        """Doubles the map (or grows it to ``wanted``) up to ``limit``,
        allocating the file first under ``writemap``, where it leaves ``slack``
        bytes of the file system free (a delete, which frees space, may take
        them). Runs on the event loop between write transactions, once no
        other thread reads the map."""
        current = self.map_size
        if current >= limit:
            return Growth.AT_LIMIT
        async with self.readers.still():
            room = self._room_beyond(slack) if self.writemap else None
            return self._grow_to(grown_size(current, limit, room, wanted))

    async def grow_ahead(self, limit: int) -> None:
        """Grows the map once it is half used, so no large transaction is
        redone; a file system short of space is found by the commit that needs it."""
        if self._used_bytes() > self.map_size // 2:
            await self.grow(limit)

    async def grow_to_hold(self, more: int, limit: int) -> None:
        """Grows the map at once so that ``more`` bytes to come (an exchange's
        offer) leave it at most half used, as :meth:`grow_ahead` keeps it,
        rather than doubling it again and again while they arrive: each
        growth allocates, remaps and faults the map's pages in anew."""
        wanted = 2 * (self._used_bytes() + more + more // HOLD_MARGIN)
        if wanted > self.map_size:
            await self.grow(limit, wanted=wanted)

    def _used_bytes(self) -> int:
        """The map up to its last page in use: what LMDB has written so far."""
        return (int(self.env.info()["last_pgno"]) + 1) * int(self.env.stat()["psize"])

    def _room_beyond(self, slack: int) -> int:
        """Whole pages of the file system's free space beyond ``slack`` bytes
        (what other writers may need): how far the map may grow at most under writemap."""
        return max(0, self.room.free_bytes() - slack) // mmap.PAGESIZE * mmap.PAGESIZE

    def _grow_to(self, size: int) -> Growth:
        current = self.map_size
        if size <= current:
            return Growth.NO_SPACE
        if self.writemap and self._fd is not None:
            if allocate(self._fd, current, size - current) is not Allocation.DONE:
                # Gives back what a failed allocation took: the map ends where it did.
                os.ftruncate(self._fd, current)
                return Growth.NO_SPACE
        self.env.set_mapsize(size)
        log.debug("grew the cache map", extra={"fields": {"map_bytes": size, "writemap": self.writemap}})
        return Growth.GREW
