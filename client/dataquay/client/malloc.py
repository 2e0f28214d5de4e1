"""Keeps glibc from handing large freed blocks back to the kernel.

Samples are 100 KiB to MiBs. By default glibc serves such blocks with fresh
mmaps, or trims them off the heap when freed, so every new sample buffer pays
one page fault per 4 KiB page; on virtual machines that makes a copy of a
110 KiB sample 5-7x slower than the memcpy itself. Raising the mmap and trim
thresholds keeps those pages in the process for reuse. The cost is that the
heap does not shrink below what a few batches needed, which a daemon or a
training process does not mind.

The thresholds govern one heap only. Each thread that allocates gets an
arena of its own, of 64 MiB heaps that glibc unmaps whenever the top one
empties, whatever the thresholds say; a daemon whose threads take in
chunks of MiBs and hand them to others makes and unmaps such heaps all the
time, and zeroes every page of each new one (numpy asks for huge pages
there), which cost the exchange half its CPU. So the daemon keeps to one
arena, which its GIL serializes anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: Blocks above this still get their own mmap (a manifest, a huge sample).
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 512 << 20


def tune_malloc(arenas: int | None = None) -> bool:
    """Raises glibc's thresholds once per process, and caps its arenas at
    ``arenas`` where given (call it before the process starts threads); False
    where there is no glibc.

    Set DATAQUAY_TUNE_MALLOC=0 to leave the allocator alone.
    """
    if os.environ.get("DATAQUAY_TUNE_MALLOC", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    settings = [(_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    if arenas is not None:
        settings.append((_M_ARENA_MAX, arenas))
    return all(mallopt(option, value) for option, value in settings)
