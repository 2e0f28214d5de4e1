"""Which file system a path or an open file is on (statfs's f_type)."""

from __future__ import annotations

import ctypes
import os

#: statfs magic of file systems that keep their files in memory (tmpfs, ramfs).
IN_MEMORY = frozenset((0x01021994, 0x858458F6))

_STATFS_BYTES = 256  # more than struct statfs takes; its first field is f_type
_libc = ctypes.CDLL(None, use_errno=True)


def file_system_type(target: str | os.PathLike[str] | int) -> int:
    """The statfs magic of the file system of a path or a file descriptor (0 if unknown)."""
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if isinstance(target, int):
        done = _libc.fstatfs(target, buffer)
    else:
        done = _libc.statfs(os.fsencode(target), buffer)
    return ctypes.c_ulong.from_buffer(buffer).value if done == 0 else 0
