"""Sealed memfd segments: shared memory that a client cannot take back from under its daemon.

The daemon copies a reply's payloads into a segment of its client. Through a
mapping that is one memcpy; but a store into a mapping of a file that the
client shrank, or whose page the kernel cannot supply, kills the daemon with
SIGBUS. Segments under /dev/shm are therefore written with ``pwrite``, which
costs about 15% of a peer hit (bench/peers.py). A memfd can be sealed, and its
descriptor handed to another process:

1. The client creates one, sizes it, allocates all its pages
   (``posix_fallocate``) and seals it against shrinking and growing.
2. It sends the descriptor to its daemon over a unix socket next to the
   daemon's own (``<socket>.fds``, trusted by the same checks), with the
   cluster token and the size, in one SCM_RIGHTS message.
3. The daemon checks that it got a memfd of the kernel's shared memory (not a
   file, not a hugetlb memfd) of that size and so sealed, maps it, and then
   seals it itself against writes other than through mappings that exist
   (F_SEAL_FUTURE_WRITE, which also forbids punching holes) and against any
   further change of seals (F_SEAL_SEAL). Last it checks that every page is
   allocated. It answers with the segment's name, ``memfd:<token>``, which
   Read requests carry in ``shm_name``, or with why it refused.

From then on nobody can shrink the segment or free one of its pages, so the
daemon's stores always find their page. The client maps its segment read
only and keeps the connection open: when it closes the segment or exits, the
daemon sees the connection end and unmaps. A client whose daemon has no fd
socket (its kernel cannot seal memfds, or the daemon is reached over TCP), or
that its daemon refused, hands payloads over through /dev/shm.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import socket
import weakref

from dataquay.client.errors import SegmentRefusedError
from dataquay.client.wire.batch_reads import REPLY_BYTES
from dataquay.client.wire.channels import grpc_target

#: The fd socket is the daemon's socket path with this suffix.
FD_SOCKET_SUFFIX = ".fds"
#: Segment names in ReadRequest.shm_name that the daemon handed out.
PREFIX = "memfd:"
#: Linux 5.1; Python's fcntl module does not name it.
F_SEAL_FUTURE_WRITE = 0x0010
#: What the client seals; the daemon adds F_SEAL_FUTURE_WRITE and F_SEAL_SEAL once it has mapped the segment.
CLIENT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: Longest message either side sends on the fd socket.
MESSAGE_BYTES = 1024
#: How long a client waits for the daemon to answer, and a daemon for a client's message.
HANDSHAKE_SECONDS = 5.0

_live: weakref.WeakSet[MemfdSegment] = weakref.WeakSet()


def fd_socket_path(daemon_socket: str) -> str:
    """Where the daemon listening on unix socket ``daemon_socket`` takes segments."""
    return daemon_socket + FD_SOCKET_SUFFIX


def daemon_socket_of(address: str) -> str | None:
    """The socket path of a daemon address, or None for HOST:PORT."""
    target = grpc_target(address)
    if not target.startswith("unix:"):
        return None
    return target.removeprefix("unix:").removeprefix("//")


def request_message(size: int, token: str) -> bytes:
    return json.dumps({"size": size, "token": token}).encode()


def parse_request(data: bytes) -> tuple[int, str]:
    """(size, token) of a client's message.

    Raises:
        ValueError: it is not one.
    """
    fields = json.loads(data)
    if not isinstance(fields, dict):
        raise ValueError("not an object")
    size, token = fields.get("size"), fields.get("token", "")
    if type(size) is not int or not isinstance(token, str):
        raise ValueError("size must be an integer and token a string")
    return size, token


def reply_message(segment: str = "", error: str = "", busy: bool = False, reads: int = 0) -> bytes:
    """The daemon's answer: the segment's name and the most ids of a batch
    read it answers on the connection (``reads``, 0 for none; see
    :mod:`.batch_reads`), or why not (``busy``: try again later)."""
    if segment:
        return json.dumps({"segment": segment, "reads": reads}).encode()
    return json.dumps({"error": error, "busy": busy}).encode()


def parse_reply(data: bytes) -> tuple[str, int]:
    """The segment name in the daemon's answer, and the most ids of a batch
    read it answers on the connection (0 from a daemon that answers none).

    Raises:
        SegmentRefusedError: the daemon refused, saying why, or gave no answer.
        BlockingIOError: the daemon is busy with other clients' segments; worth another try later.
    """
    try:
        fields = json.loads(data) if data else {}
    except ValueError:
        fields = {}
    if not isinstance(fields, dict):
        fields = {}
    segment = fields.get("segment")
    if isinstance(segment, str) and segment.startswith(PREFIX):
        reads = fields.get("reads")
        return segment, reads if type(reads) is int and reads > 0 else 0
    error = str(fields.get("error") or "the daemon ended the exchange without an answer")
    if fields.get("busy") is True:
        raise BlockingIOError(errno.EAGAIN, error)
    raise SegmentRefusedError(error)


class MemfdSegment:
    """One sealed memfd segment that the daemon at ``fd_socket`` mapped.

    Raises:
        SegmentRefusedError: the daemon refused it.
        OSError: this kernel cannot make one, memory is short, or the daemon
            is not there or busy (BlockingIOError).
    """

    #: Never a name under /dev/shm (see :class:`dataquay.client.wire.shm.Segment`).
    linked = False

    def __init__(self, size: int, fd_socket: str, token: str) -> None:
        self.size = size
        fd = os.memfd_create(f"dataquay-{os.getpid()}", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, CLIENT_SEALS)
            self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            try:
                self._sock, self.name, self.read_ids = _register(fd, size, fd_socket, token)
            except BaseException:
                self.map.close()
                raise
        finally:
            os.close(fd)
        self.closed = False
        _live.add(self)

    def daemon_mapped(self) -> None:
        """The daemon mapped it before it named it: nothing to do."""

    def read(self, request: bytes, timeout: float) -> bytes:
        """The daemon's reply to a batch read ``request`` (:mod:`.batch_reads`) on
        this segment's connection; b"" if the daemon ended the connection.

        Raises:
            OSError: the connection failed, or no reply came within ``timeout``
                seconds (TimeoutError); the segment is not to be used again.
        """
        self._sock.settimeout(timeout)
        self._sock.send(request)
        return self._sock.recv(REPLY_BYTES)

    def close(self) -> None:
        """Unmaps it here; the daemon unmaps it as the connection ends."""
        _live.discard(self)
        self._sock.close()
        self.map.close()
        self.closed = True


def _register(fd: int, size: int, fd_socket: str, token: str) -> tuple[socket.socket, str, int]:
    """Hands ``fd`` to the daemon: the connection that keeps it mapped there,
    its name and the most ids of a batch read the daemon answers on it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(HANDSHAKE_SECONDS)
        sock.connect(fd_socket)
        socket.send_fds(sock, [request_message(size, token)], [fd])
        name, reads = parse_reply(sock.recv(MESSAGE_BYTES))
    except BaseException:
        sock.close()
        raise
    return sock, name, reads


def _close_inherited() -> None:
    """A forked child lets go of its parent's connections (not of the
    mappings), so that the parent's segments end with the parent."""
    for segment in list(_live):
        segment._sock.close()
        segment.closed = True
        _live.discard(segment)


os.register_at_fork(after_in_child=_close_inherited)
