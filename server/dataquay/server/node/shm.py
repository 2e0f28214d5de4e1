"""Shared-memory hand-off of payloads to clients on the daemon's node.

A gRPC message costs a copy into the socket, a copy out, and protobuf framing;
for samples of 100 KiB and more that caps a local read near 1 GB/s. A client on
the same node can instead name a segment of its own under /dev/shm: the daemon
maps it once, copies payloads into it, and replies with offsets. The client
copies each payload out and checks its xxh3, so a stale or foreign write can
never turn into a wrong sample.

Segments are named ``dataquay-<pid>-<token>``. The daemon keeps a bounded set
of mappings and drops those whose process has exited, since a mapping keeps
the segment's memory alive after the client unlinked it; it unlinks the names
that clients of its own user died before unlinking.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from dataquay.client.shm import SHM_DIR, process_alive, remove_stale_segments, segment_pid

#: Payload offsets are aligned so that numpy can view them without copying.
ALIGN = 64
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


class ShmSegments:
    """The client segments this daemon has mapped, least recently used first."""

    def __init__(self, max_segments: int = 256) -> None:
        self.max_segments = max_segments
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def get(self, name: str, size: int) -> mmap.mmap | None:
        """The mapping of segment ``name`` (at least ``size`` bytes), or None if unusable."""
        if segment_pid(name) is None or size <= 0:
            return None
        mapped = self._maps.get(name)
        if mapped is not None and len(mapped) >= size:
            self._maps.move_to_end(name)
            return mapped
        try:
            fd = os.open(SHM_DIR / name, _OPEN_FLAGS)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < size:
                return None
            mapped = mmap.mmap(fd, size)
        except OSError:
            return None
        finally:
            os.close(fd)
        self._forget(name)
        self._maps[name] = mapped
        while len(self._maps) > self.max_segments:
            self._forget(next(iter(self._maps)))
        return mapped

    def reap(self) -> int:
        """Unmaps the segments of processes that exited, and unlinks the names
        such processes of this user left; returns how many were unmapped."""
        dead = [n for n in self._maps if not process_alive(segment_pid(n) or 0)]
        for name in dead:
            self._forget(name)
        remove_stale_segments()
        return len(dead)

    def close(self) -> None:
        for name in list(self._maps):
            self._forget(name)

    def _forget(self, name: str) -> None:
        mapped = self._maps.pop(name, None)
        if mapped is not None:
            mapped.close()


def write_payloads(segment: mmap.mmap | None, payloads: Sequence[bytes | memoryview]) -> list[int | None]:
    """Copies payloads into ``segment`` where they fit: their offsets, None
    for each that must go inline (all of them without a segment)."""
    if segment is None:
        return [None] * len(payloads)
    offsets = list(place((len(p) for p in payloads), len(segment)))
    for payload, offset in zip(payloads, offsets):
        if offset is not None:
            segment[offset : offset + len(payload)] = payload
    return offsets


def place(payload_sizes: Iterable[int], capacity: int) -> Iterator[int | None]:
    """Offsets for payloads laid out one after another; None for one that does not fit."""
    pos = 0
    for size in payload_sizes:
        if pos + size > capacity:
            yield None
            continue
        yield pos
        pos = (pos + size + ALIGN - 1) // ALIGN * ALIGN
