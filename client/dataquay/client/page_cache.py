"""Reading a file's bytes only if the page cache holds them, without a read
from storage.

A read with ``RWF_NOWAIT`` alone does not do it: since Linux 5.9, where the
cache lacks the bytes it starts their read-ahead before it fails with EAGAIN,
so every "not cached" costs a read from storage, the very read that caching
behind a trainer exists to spare the PFS (and, on a busy node, a read that
completes in time makes a "cached" of a sample that was not). So
:func:`read_cached` asks first. ``cachestat(2)`` (Linux 6.5) counts a range's
cached pages and reads nothing, but the kernel answers it only on files the
caller owns or may write. Where it does not answer (a daemon reading other
users' datasets, an older kernel), the range's first page is read alone
without waiting, on a file advised random access, so that a "not cached"
costs one page of read-ahead rather than the range's.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

from dataquay.client.file_systems import IN_MEMORY, file_system_type

PAGE = mmap.PAGESIZE
#: cachestat's number: new system calls share one number on every architecture but alpha.
_CACHESTAT = 451
#: What a read without waiting fails with when the page cache lacks the data,
#: or the file system does not support such reads.
_NOT_CACHED = frozenset((errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL))
_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long
# syscall(2) takes each argument as a long.
_syscall.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Counts(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


#: Until a kernel without it says ENOSYS (the number means another call elsewhere than Linux).
_has_cachestat = sys.platform == "linux"


def pages(offset: int, length: int) -> int:
    """How many pages the ``length`` bytes at ``offset`` touch."""
    return (offset + length - 1) // PAGE - offset // PAGE + 1 if length > 0 else 0


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of the ``length`` bytes at ``offset`` the page cache
    holds; None where the kernel will not say (not this user's file, no
    ``cachestat``). Reads nothing."""
    global _has_cachestat
    if length <= 0 or not _has_cachestat:  # a length of 0 would ask for the rest of the file
        return None
    counts = _Counts()
    if _syscall(_CACHESTAT, fd, ctypes.byref(_Range(offset, length)), ctypes.byref(counts), 0) == 0:
        return int(counts.nr_cache)
    if ctypes.get_errno() == errno.ENOSYS:
        _has_cachestat = False
    return None


def read_cached(fd: int, offset: int, length: int) -> memoryview | None:
    """The ``length`` bytes at ``offset`` if the page cache holds all of
    them, else None; never waits for storage, and a "not cached" reads at
    most one page from it."""
    if length <= 0:
        return memoryview(bytearray())
    held = cached_pages(fd, offset, length)
    if held is not None and held < pages(offset, length):
        return None
    if held is None:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a miss reads ahead only the page asked for
        except OSError:
            pass  # advice only: the probe stays right, a miss just reads further ahead
        first = min(length, PAGE - offset % PAGE)
        if first < length and _read_nowait(fd, offset, first) is None:
            return None
    return _read_nowait(fd, offset, length)


def _read_nowait(fd: int, offset: int, length: int) -> memoryview | None:
    buf = bytearray(length)
    try:
        got = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except OSError as exc:
        # tmpfs cannot read without waiting, and a read there never waits for storage.
        if exc.errno == errno.EOPNOTSUPP and file_system_type(fd) in IN_MEMORY:
            got = os.preadv(fd, [buf], offset)
        elif exc.errno in _NOT_CACHED:
            return None
        else:
            raise
    return memoryview(buf) if got == length else None
