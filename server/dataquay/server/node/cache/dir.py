"""The cache directory as the OS sees it: which daemon holds it, and whether
the file system under it has room.

One daemon per cache directory: a second daemon on the same LMDB would resize
the map under the first. The lock is an flock, so the kernel lets go of a
killed daemon's lock and a restart needs no cleanup.

Room: LMDB reports a commit's short write as EIO, not ENOSPC, so whether a
failed commit failed for lack of space is decided by the free space too. Space
freed outside the cache (other files deleted) can come back at any time, so a
cache full for lack of disk space looks at its file system again now and then.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

import lmdb

from dataquay.server.dirs import FILE_MODE
from dataquay.server.errors import StartupError

#: Held (flock) by the daemon that owns the cache dir, and holds its pid.
LOCK_FILE = "daemon.lock"
#: Free space under which a failed commit is taken for a full file system,
#: beyond the batch itself: LMDB also rewrites branch and free-list pages.
DISK_SLACK_BYTES = 1 << 20
#: How long a full file system is left alone before its free space is looked at again.
DISK_RETRY_SECONDS = 2.0


def lock_cache_dir(path: Path) -> int:
    """Takes ``path`` for this process alone and writes its pid into the lock
    file; returns the descriptor, whose closing lets go.

    Raises:
        StartupError: another daemon holds it (the message names its pid), or
            the lock file cannot be opened.
    """
    lock_path = path / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        raise StartupError(f"cannot open the lock file {lock_path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise StartupError(f"cannot lock {lock_path}: {exc.strerror}") from exc
        raise StartupError(
            f"cache dir {path} is in use by another daemon (pid {holder}); stop it or give this one its own --cache-dir"
        ) from None
    os.fchmod(fd, FILE_MODE)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class FileSystemRoom:
    """Free space on the cache's file system, and when to look at it again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._retry_at = 0.0

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def failed_for_space(self, exc: lmdb.Error, batch_bytes: int) -> bool:
        """Whether a commit of ``batch_bytes`` that raised ``exc`` failed for lack of space."""
        if isinstance(exc, lmdb.DiskError):
            return True
        try:
            return self.free_bytes() < batch_bytes + DISK_SLACK_BYTES
        except OSError:
            return False

    def back_off(self) -> None:
        """Leaves the file system alone for :data:`DISK_RETRY_SECONDS` after it was found full."""
        self._retry_at = time.monotonic() + DISK_RETRY_SECONDS

    def recheck_now(self) -> None:
        self._retry_at = 0.0

    def has_room_again(self) -> bool:
        """Whether, after the back-off, the file system has room for a write
        again; looks at most every :data:`DISK_RETRY_SECONDS`."""
        if time.monotonic() < self._retry_at:
            return False
        self.back_off()
        return self.free_bytes() >= DISK_SLACK_BYTES
