"""Shared-memory hand-off of payloads to clients on the daemon's node.

A gRPC message costs a copy into the socket, a copy out, and protobuf framing;
for samples of 100 KiB and more that caps a local read near 1 GB/s. A client on
the same node can instead name a segment of its own under /dev/shm: the daemon
maps it once, copies payloads into it, and replies with offsets. The client
copies each payload out and checks its xxh3, so a stale or foreign write can
never turn into a wrong sample.

Segments are named ``dataquay-<pid>-<token>``. The daemon keeps a bounded set
of open segments and drops those whose process has exited, since an open file
keeps the segment's memory alive after the client unlinked it; it unlinks the
names that clients of its own user died before unlinking.

The daemon writes with ``pwrite`` on the segment's file, never through a
mapping: a client may shrink its segment (ftruncate) at any time, or /dev/shm
may be full, and a store into a mapping past the file's end or into a page
tmpfs cannot allocate kills the whole daemon with SIGBUS, which Python cannot
catch. ``pwrite`` fails with an error instead (ENOSPC), or extends a shrunk
file. The segment's size is checked right before the writes so that one a
client shrank is answered inline rather than grown back; a shrink between that
check and a write just grows the file again, with no harm to the daemon.
Measured on the 2-core development machine, ``pwrite`` copies 2-11 GB/s
against 12-34 GB/s for a mapping (3 KB to 1 MiB payloads, warm pages): the
same order, and far above what the socket carries.

Sealed memfd segments (:mod:`dataquay.client.wire.memfd`, handed over on the fd
socket) are written through a mapping with a plain memcpy, because nothing
can make a store into one fault: it cannot shrink (F_SEAL_SHRINK), no page of
it can be freed (every page is allocated before the daemon takes it, and
F_SEAL_FUTURE_WRITE, which the daemon adds after mapping it, forbids punching
holes and any new writable mapping), and it lives on the kernel's internal
shared-memory mount, which has no size limit (a hugetlb memfd, whose pool
can run dry, is refused). What is left is the machine itself: a page swapped
out and not read back in for want of memory, which the OOM killer settles as
for any memory of the daemon. Segments are named ``memfd:<token>`` by the
daemon; a client owns its segments one connection each, so they are unmapped
as soon as it closes one or exits.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from dataquay.client.errors import SegmentRefusedError
from dataquay.client.wire.memfd import CLIENT_SEALS, F_SEAL_FUTURE_WRITE, PREFIX
from dataquay.client.wire.shm import SHM_DIR, process_alive, remove_stale_segments, segment_pid

log = logging.getLogger("dataquay.daemon")

#: Payload offsets are aligned so that numpy can view them without copying.
ALIGN = 64
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
#: Largest memfd segment mapped (clients use 64 MiB unless told otherwise).
MAX_MEMFD_BYTES = 1 << 30
#: Memfd segments one client process may have mapped; its oldest goes first.
MAX_MEMFD_PER_PROCESS = 16
#: What the daemon seals once it has mapped a segment.
DAEMON_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_REFUSED_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


@dataclass
class _Mapped:
    """A memfd segment this daemon mapped for client process ``pid``."""

    map: mmap.mmap
    size: int
    pid: int
    on_drop: Callable[[], None]
    #: The memfd's owner: the user whose process made it.
    uid: int = -1


class ShmSegments:
    """The client segments this daemon holds open or mapped, least recently used first.

    Not thread-safe: used from the event loop's thread.
    """

    def __init__(self, max_segments: int = 256, max_memfd: int = 128) -> None:
        self.max_segments = max_segments
        self.max_memfd = max_memfd
        self._files: OrderedDict[str, int] = OrderedDict()
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self.memfd_dev, self.memfd_problem = _memfd_support()

    @property
    def mapped(self) -> int:
        """How many memfd segments are mapped."""
        return len(self._maps)

    def adopt(self, fd: int, size: int, pid: int, on_drop: Callable[[], None]) -> str:
        """Maps the sealed memfd ``fd`` of ``size`` bytes that process ``pid``
        sent, and seals it against hole punching; returns its name. The caller
        keeps ``fd`` (and closes it). ``on_drop`` is called once the segment
        is unmapped (evicted, or at :meth:`drop`).

        Raises:
            SegmentRefusedError: why it is not a segment the daemon can write into safely.
        """
        if self.memfd_problem is not None:
            raise SegmentRefusedError(f"this daemon maps no memfd segments: {self.memfd_problem}")
        self._check_memfd(fd, size)
        try:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise SegmentRefusedError(f"the segment cannot be mapped for writing: {exc.strerror}") from None
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, DAEMON_SEALS)
            allocated = os.fstat(fd).st_blocks * 512
        except OSError as exc:
            mapped.close()
            raise SegmentRefusedError(f"the segment cannot be sealed against hole punching: {exc.strerror}") from None
        if allocated < size:
            mapped.close()
            raise SegmentRefusedError(
                f"the segment has {allocated} of its {size} bytes allocated; allocate them all (fallocate) first"
            )
        name = PREFIX + secrets.token_hex(16)
        self._maps[name] = _Mapped(mapped, size, pid, on_drop, os.fstat(fd).st_uid)
        own = [n for n, m in self._maps.items() if m.pid == pid]
        if pid and len(own) > MAX_MEMFD_PER_PROCESS:
            self.drop(own[0])
        while len(self._maps) > self.max_memfd:
            self.drop(next(iter(self._maps)))
        return name

    def drop(self, name: str) -> None:
        """Unmaps memfd segment ``name`` (its client let go of it, or room is needed).

        A read still receiving into it holds views of its mapping
        (:mod:`.forward`): the mapping then goes with the last of them."""
        held = self._maps.pop(name, None)
        if held is not None:
            try:
                held.map.close()
            except BufferError:
                pass
            held.on_drop()

    def mapping(self, name: str) -> mmap.mmap | None:
        """The daemon's mapping of memfd segment ``name``; None for a /dev/shm
        segment or one not mapped. A store into it cannot fault (see above)."""
        held = self._maps.get(name)
        return held.map if held is not None else None

    def owner(self, name: str) -> int | None:
        """The uid whose segment ``name`` is (a memfd's maker, a /dev/shm
        file's owner); None for no segment of a client or one gone."""
        held = self._maps.get(name)
        if held is not None:
            return held.uid
        if name.startswith(PREFIX) or segment_pid(name) is None:
            return None
        try:
            return os.stat(SHM_DIR / name, follow_symlinks=False).st_uid
        except OSError:
            return None

    def _check_memfd(self, fd: int, size: int) -> None:
        """Refuses anything but a memfd of the kernel's shared memory of
        ``size`` bytes, sealed against shrinking and growing, still open to
        the daemon's seals and writes."""
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise SegmentRefusedError(f"the descriptor cannot be inspected: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode) or info.st_dev != self.memfd_dev:
            raise SegmentRefusedError(
                "the descriptor is not a memfd of the kernel's shared memory (a file, a socket or a hugetlb memfd)"
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise SegmentRefusedError("the memfd does not allow sealing (create it with MFD_ALLOW_SEALING)") from None
        if seals & CLIENT_SEALS != CLIENT_SEALS:
            raise SegmentRefusedError(
                "the memfd is not sealed against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW)"
            )
        if seals & _REFUSED_SEALS:
            raise SegmentRefusedError(
                "the memfd is sealed against writes or further seals; seal only F_SEAL_SHRINK and F_SEAL_GROW"
            )
        if not 0 < size <= MAX_MEMFD_BYTES:
            raise SegmentRefusedError(f"a segment of {size} bytes; this daemon maps 1 to {MAX_MEMFD_BYTES} bytes")
        if info.st_size != size:
            raise SegmentRefusedError(f"the memfd holds {info.st_size} bytes, not the {size} announced")

    def get(self, name: str, size: int) -> int | None:
        """The open file of segment ``name`` (at least ``size`` bytes when
        opened), or None if unusable."""
        if segment_pid(name) is None or size <= 0:
            return None
        fd = self._files.get(name)
        if fd is not None:
            self._files.move_to_end(name)
            return fd
        try:
            fd = os.open(SHM_DIR / name, _OPEN_FLAGS)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
        except OSError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_size < size:
            os.close(fd)
            return None
        self._files[name] = fd
        while len(self._files) > self.max_segments:
            self._forget(next(iter(self._files)))
        return fd

    def write(
        self, name: str, size: int, payloads: Sequence[bytes | memoryview], start: int = 0
    ) -> tuple[list[int | None], int]:
        """Copies payloads into segment ``name`` of ``size`` bytes from offset
        ``start`` on, where they fit: their offsets, None for each that must go
        inline (all of them when the segment is unusable, shrank or cannot take
        the bytes), and where the next payloads of the same reply may start."""
        if name.startswith(PREFIX):
            return self._write_mapped(name, size, payloads, start)
        fd = self.get(name, size)
        inline: list[int | None] = [None] * len(payloads)
        if fd is None:
            return inline, start
        offsets = list(place((len(p) for p in payloads), size, start))
        end = max((o + len(p) for p, o in zip(payloads, offsets) if o is not None), default=start)
        try:
            held = os.fstat(fd).st_size
            if held < end:
                log.warning(
                    "shared memory segment shrank; answering inline",
                    extra={"fields": {"segment": name, "bytes": held, "needed": end}},
                )
                return inline, start
            for payload, offset in zip(payloads, offsets):
                if offset is not None and os.pwrite(fd, payload, offset) != len(payload):
                    raise OSError(f"short write at offset {offset}")
        except OSError as exc:
            log.warning(
                "cannot write to a shared memory segment; answering inline",
                extra={"fields": {"segment": name, "error": str(exc)}},
            )
            return inline, start
        return offsets, aligned(end)

    def _write_mapped(
        self, name: str, size: int, payloads: Sequence[bytes | memoryview], start: int
    ) -> tuple[list[int | None], int]:
        held = self._maps.get(name)
        if held is None:
            return [None] * len(payloads), start
        self._maps.move_to_end(name)
        offsets = list(place((len(p) for p in payloads), min(size, held.size), start))
        end = start
        for payload, offset in zip(payloads, offsets):
            if offset is not None:
                end = offset + len(payload)
                held.map[offset:end] = payload
        return offsets, aligned(end)

    def read_own(self, name: str, size: int, offset: int, length: int) -> bytes | None:
        """The ``length`` bytes at ``offset`` of segment ``name`` (``size``
        bytes), where it belongs to this daemon's user, who could write the
        cache directly anyway; None for another user's segment or one gone,
        shrunk or too small."""
        if offset < 0 or length < 0 or offset + length > size:
            return None
        held = self._maps.get(name)
        if held is not None:
            if held.uid != os.getuid() or offset + length > held.size:
                return None
            return held.map[offset : offset + length]
        fd = self.get(name, size) if not name.startswith(PREFIX) else None
        if fd is None:
            return None
        try:
            if os.fstat(fd).st_uid != os.getuid():
                return None
            payload = os.pread(fd, length, offset)
        except OSError:
            return None
        return payload if len(payload) == length else None

    def reap(self) -> int:
        """Closes the segments of processes that exited, and unlinks the names
        such processes of this user left; returns how many were closed."""
        dead = [n for n in self._files if not process_alive(segment_pid(n) or 0)]
        for name in dead:
            self._forget(name)
        remove_stale_segments()
        return len(dead)

    def close(self) -> None:
        for name in list(self._files):
            self._forget(name)
        for name in list(self._maps):
            self.drop(name)

    def _forget(self, name: str) -> None:
        fd = self._files.pop(name, None)
        if fd is not None:
            os.close(fd)


def place(payload_sizes: Iterable[int], capacity: int, start: int = 0) -> Iterator[int | None]:
    """Offsets for payloads laid out one after another from ``start``; None for one that does not fit."""
    pos = start
    for size in payload_sizes:
        offset = fit(pos, size, capacity)
        if offset is not None:
            pos = aligned(offset + size)
        yield offset


def fit(pos: int, size: int, capacity: int) -> int | None:
    """``pos``, where a payload of ``size`` bytes placed there ends within ``capacity``; else None."""
    return pos if pos + size <= capacity else None


def aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _memfd_support() -> tuple[int, str | None]:
    """(the device of this kernel's memfds, None) where memfd segments can be
    sealed as :meth:`ShmSegments.adopt` needs; else (0, why not)."""
    try:
        fd = os.memfd_create("dataquay-probe", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:
        return 0, f"no memfd_create ({exc})"
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        with mmap.mmap(fd, mmap.PAGESIZE):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, CLIENT_SEALS | DAEMON_SEALS)
        return os.fstat(fd).st_dev, None
    except OSError as exc:
        return 0, f"this kernel cannot seal a memfd against writes while it is mapped (Linux 5.1+): {exc.strerror}"
    finally:
        os.close(fd)
