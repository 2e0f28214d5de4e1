"""Shared-memory segments through which the daemon hands over payloads.

The client owns its segments and copies each payload out at the offset the
reply gives (verifying its checksum). Where its daemon takes them, each is a
sealed memfd that the daemon writes into with a plain memcpy (see
:mod:`dataquay.client.wire.memfd`). Otherwise the client creates one under
/dev/shm and names it in a Read. Once the daemon has opened such a segment,
its file is unlinked, so a client that dies leaves nothing behind: the
daemon drops its own file when it sees the process gone. A client killed before that point leaves a name,
which the daemon's reaper or the next client of the same user removes. A
daemon that cannot use a segment (another host, another user, a restart) just
answers inline, and the client then makes a new one next time.

One segment serves one call at a time; a process has as many as it has
concurrent calls, each created on first need and sized to what that call
reads (a power of two of at least 1 MiB, at most DATAQUAY_SHM_BYTES): a
sealed segment's pages are all allocated when it is made (20-180 ms for 64
MiB on a 2-core VM), so a process's first read does not pay for 64 MiB it
may never use. A call that needs more than a free segment holds replaces it
with a larger one.

A call may hand its payloads over without a copy (:meth:`SegmentPool.lend`):
they are then views into its segment, which stays out of the pool, so that
no later read writes over them, until the last view cut from it is released;
at most MAX_LENT_SEGMENTS at once.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dataquay.client.errors import SegmentRefusedError
from dataquay.client.wire.memfd import MemfdSegment, daemon_socket_of, fd_socket_path
from dataquay.client.wire.security import CredentialsError, check_daemon_socket

log = logging.getLogger("dataquay.client")

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^dataquay-(\d{1,10})-[A-Za-z0-9_]{1,32}$")
#: Most bytes of one segment (DATAQUAY_SHM_BYTES); samples beyond it come inline.
DEFAULT_SEGMENT_BYTES = 64 << 20
#: The smallest segment made, so that small reads do not each grow it a little.
MIN_SEGMENT_BYTES = 1 << 20
#: Segments a process keeps lent at once: a step's batch and a loader's
#: read-ahead. A read past them copies its payloads, so views held for long
#: cost copies, not a segment (and the daemon's mapping of it) each.
MAX_LENT_SEGMENTS = 8


def segment_pid(name: str) -> int | None:
    """The process that created segment ``name``, or None if it is not a segment name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def process_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale_segments() -> None:
    """Unlinks this user's segments whose process has exited."""
    remove_orphaned(segment_pid)


def remove_orphaned(owner_pid: Callable[[str], int | None]) -> None:
    """Unlinks this user's files in SHM_DIR whose owner, the process
    ``owner_pid`` reads from a file's name, has exited."""
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return
    uid = os.getuid()
    for entry in entries:
        pid = owner_pid(entry.name)
        try:
            if pid is None or process_alive(pid) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            os.unlink(entry.path)
        except OSError:
            continue  # gone meanwhile


class Segment:
    """One mapped segment; ``name`` is what a ReadRequest carries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.name = f"dataquay-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
            self.closed = False
        except OSError:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.linked = True

    def daemon_mapped(self) -> None:
        """The daemon holds its own mapping now: the name is no longer needed."""
        if self.linked:
            self.path.unlink(missing_ok=True)
            self.linked = False

    def close(self) -> None:
        if self.linked:
            self.path.unlink(missing_ok=True)
            self.linked = False
        self.map.close()
        self.closed = True


class SegmentPool:
    """The segments of this process, handed out one per call: sealed memfd
    segments where the daemon at ``daemon_address`` takes them (with ``token``),
    else segments under /dev/shm."""

    def __init__(self, size: int | None = None, daemon_address: str = "", token: str = "") -> None:
        self.size = size or int(os.environ.get("DATAQUAY_SHM_BYTES", DEFAULT_SEGMENT_BYTES))
        daemon_socket = daemon_socket_of(daemon_address) if daemon_address else None
        self._fd_socket = fd_socket_path(daemon_socket) if daemon_socket else None
        self._token = token
        # Reentrant: a lent segment comes back when its views are collected,
        # which the garbage collector may do inside any allocation, this lock held.
        self._lock = threading.RLock()
        self._free: list[Segment | MemfdSegment] = []
        #: Segments whose payloads were handed over as views, by id; True: close it on return.
        self._lent: dict[int, bool] = {}
        self._closed = False
        self._pid = os.getpid()
        self._broken = self.size <= 0 or not SHM_DIR.is_dir()
        if not self._broken:
            remove_stale_segments()

    def size_for(self, nbytes: int) -> int:
        """The size of a segment made for a call that reads ``nbytes``."""
        return min(self.size, max(MIN_SEGMENT_BYTES, 1 << max(nbytes - 1, 0).bit_length()))

    @contextmanager
    def segment(self, nbytes: int = 0) -> Iterator[Segment | MemfdSegment | None]:
        """A segment for one call that reads ``nbytes``, or None where shared memory cannot be used."""
        seg = self._take(self.size_for(nbytes))
        try:
            yield seg
        finally:
            if seg is not None and not seg.closed:
                with self._lock:
                    if self._pid == os.getpid() and id(seg) not in self._lent:
                        self._free.append(seg)

    def lend(self, seg: Segment | MemfdSegment) -> memoryview | None:
        """A read-only view of the whole of ``seg`` to cut payloads from
        without a copy, or None where MAX_LENT_SEGMENTS are lent already
        (the payloads are then copied). ``seg`` leaves the pool: it comes
        back (or is closed, if discarded or the pool closed meanwhile) once
        this view and every view cut from it are released, so no read
        writes over a payload while anything still refers to it."""
        with self._lock:
            if len(self._lent) >= MAX_LENT_SEGMENTS:
                return None
            self._lent[id(seg)] = False
        owner = np.frombuffer(seg.map, np.uint8)
        owner.flags.writeable = False  # a /dev/shm segment is mapped writable here
        # Every view cut from the memoryview holds ``owner``, and ``owner`` numpy's own
        # memoryview of the map: collected after the last view, with the map's export released.
        weakref.finalize(owner.base, self._returned, seg, os.getpid()).atexit = False
        return owner.data

    def _returned(self, seg: Segment | MemfdSegment, pid: int) -> None:
        if os.getpid() != pid:
            return  # a forked child's copy of the parent's views
        with self._lock:
            discarded = self._lent.pop(id(seg), True)
            keep = not (discarded or self._closed or seg.closed) and self._pid == pid
            if keep:
                self._free.append(seg)
        if not keep and not seg.closed:
            seg.close()

    def discard(self, seg: Segment | MemfdSegment) -> None:
        """Drops a segment the daemon could not use (it answered inline);
        a lent one as its views are released."""
        with self._lock:
            if id(seg) in self._lent:
                self._lent[id(seg)] = True
                return
        seg.close()

    def close(self) -> None:
        """Closes the free segments; lent ones close as their views are released."""
        with self._lock:
            self._closed = True
            segments, self._free = self._free, []
        if self._pid == os.getpid():
            for seg in segments:
                seg.close()

    def _take(self, size: int) -> Segment | MemfdSegment | None:
        """A free segment of at least ``size`` bytes, else a new one of ``size``
        (a smaller free one is dropped, so a process keeps one per concurrent call)."""
        outgrown = None
        with self._lock:
            if self._pid != os.getpid():
                # A forked child: the parent's segments are the parent's.
                self._pid, self._free, self._lent = os.getpid(), [], {}
            if self._broken:
                return None
            for i, seg in enumerate(self._free):
                if seg.size >= size:
                    return self._free.pop(i)
            if self._free:
                outgrown = self._free.pop()
        if outgrown is not None:
            outgrown.close()
        sealed = self._memfd_segment(size)
        if sealed is not None:
            return sealed
        try:
            return Segment(size)
        except OSError as exc:
            log.warning("shared memory unavailable (%s); samples come through the socket", exc)
            self._broken = True
            return None

    def _memfd_segment(self, size: int) -> MemfdSegment | None:
        """A sealed memfd segment the daemon mapped, or None to use /dev/shm:
        for good where the daemon refuses them, this time only where it cannot
        be reached (restarting), is busy with other clients' segments, or
        memory is short."""
        fd_socket = self._fd_socket
        if fd_socket is None or not os.path.exists(fd_socket):
            return None  # a daemon without an fd socket, or one reached over TCP
        try:
            check_daemon_socket(fd_socket)
            return MemfdSegment(size, fd_socket, self._token)
        except (SegmentRefusedError, CredentialsError) as exc:
            log.warning("sealed shared memory refused (%s); samples come through /dev/shm", exc)
            self._fd_socket = None
        except OSError as exc:
            log.debug("no sealed shared memory this time (%s); using /dev/shm", exc)
        return None
