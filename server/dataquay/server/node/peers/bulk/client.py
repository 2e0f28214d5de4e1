"""Reads from peers' bulk listeners (:mod:`.server`), a few connections kept per peer.

A read runs in a thread of its own pool: it sends the request and receives
each payload with ``recv_into`` straight into where its caller wants it (the
:class:`Landing`'s place: a trainer's sealed segment, so that the kernel's
copy out of the socket is the only one) or else into a buffer of the length
the manifest gives (one per sample: a buffer for a whole batch of large
samples would be past glibc's mmap threshold, :mod:`dataquay.client.malloc`,
and page-fault afresh every batch), checks its xxh3 once, there. A payload
received where it goes is then only marked so from the bulk thread
(``received``); one in a buffer of its own is handed to the landing's
``arrived`` on the event loop, so that the caller can pass it on while the
rest of the batch is still on the wire: what landed while the loop was busy
goes in one call, so a busy loop is woken once, not once per payload. A frame that names an id
not asked for, or a length other than the manifest's, ends the connection:
a peer that garbles one frame cannot be trusted with the next. A
connection that answered cleanly goes back to its peer's pool.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dataquay.client.wire.records import checksum
from dataquay.server.node.peers.bulk.frames import (
    END,
    ERROR,
    HELLO,
    HELLO_MAGIC,
    MAC_BYTES,
    MAX_ERROR_BYTES,
    MISSING,
    NONCE_BYTES,
    OK,
    SAMPLE,
    BulkError,
    client_proof,
    read_request,
    receive_timeout,
    recv_all,
    recv_bytes,
    server_proof,
)

#: Idle connections kept per peer.
POOL_SIZE = 4
#: Reads in flight at once, over all peers.
THREADS = 16
#: Time to connect and finish the handshake.
CONNECT_SECONDS = 5.0


class Landing(Protocol):
    """Where a read's payloads go as they come off the wire, or out of this
    node's cache (:meth:`copy_in`)."""

    def place(self, sample_id: int, length: int) -> memoryview | None:
        """A writable view of ``length`` bytes to receive ``sample_id`` into,
        or None for a buffer of its own. Called from a bulk thread."""

    def received(self, sample_id: int) -> None:
        """Called from the bulk thread once the payload received into the
        view ``place`` gave passed its checksum there: it is where it goes,
        so the event loop is not woken for it."""

    def failed(self, sample_id: int) -> None:
        """Called from the bulk thread when the payload received into the view
        ``place`` gave failed its checksum: that room may be given out again."""

    def arrived(self, landed: list[tuple[int, memoryview, int]]) -> None:
        """Called on the event loop with payloads received into buffers of
        their own that arrived intact: [(id, payload, checksum)]. One that
        failed its checksum is never handed over."""

    def copy_in(self, sample_id: int, payload: memoryview) -> memoryview | None:
        """Copies a payload this node read from its own cache (a view into
        the map, checked) to where it goes: the view it lies in there, or None
        where it is to be copied into bytes of its own. Called on the event
        loop, inside the read transaction."""


class BulkRefusedError(BulkError):
    """The peer answered the request with an error status (unknown dataset, bad id)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class BulkTimeoutError(BulkError):
    """The peer did not answer within the read's deadline."""


class _StaleError(BulkError):
    """A connection closed before its first reply frame: a pooled one the peer dropped."""


@dataclass
class BulkRead:
    """What one read brought: intact payloads by id, and how many failed their checksum."""

    samples: dict[int, tuple[memoryview, int]] = field(default_factory=dict)
    bytes: int = 0
    bad_checksums: int = 0
    frames: int = 0


class BulkClient:
    """Bulk connections to peers, by address."""

    def __init__(self, token: str, tls: ssl.SSLContext | None) -> None:
        self.token = token
        self.tls = tls
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        #: The threads that block on bulk sockets (reads, and exchange streams).
        self.threads = ThreadPoolExecutor(THREADS, thread_name_prefix="bulk")

    async def read(
        self,
        address: str,
        dataset: str,
        manifest_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        deadline: float,
        landing: Landing | None = None,
    ) -> BulkRead:
        """The samples of ``ids`` that the peer at ``address`` holds.

        ``lengths`` are the payload lengths of the dataset's samples by id.
        Raises BulkTimeoutError past ``deadline`` seconds, BulkRefusedError
        for a request the peer refused and BulkError for any other failure.
        """
        loop = asyncio.get_running_loop()
        request = read_request(dataset, manifest_id, ids)

        landed: list[tuple[int, memoryview, int]] = []
        lock = threading.Lock()

        def drain() -> None:
            assert landing is not None
            with lock:
                batch = landed[:]
                landed.clear()
            landing.arrived(batch)

        def hand_over(sample_id: int, payload: memoryview, digest: int) -> None:
            with lock:
                landed.append((sample_id, payload, digest))
                if len(landed) > 1:
                    return  # a drain is scheduled and not run yet
            loop.call_soon_threadsafe(drain)

        return await loop.run_in_executor(
            self.threads,
            self._read,
            address,
            request,
            ids,
            lengths,
            time.monotonic() + deadline,
            landing,
            hand_over if landing is not None else None,
        )

    def close(self) -> None:
        with self._lock:
            idle = [sock for pool in self._idle.values() for sock in pool]
            self._idle.clear()
        for sock in idle:
            sock.close()
        self.threads.shutdown(wait=False, cancel_futures=True)

    def _read(
        self,
        address: str,
        request: bytes,
        ids: np.ndarray,
        lengths: np.ndarray,
        end: float,
        landing: Landing | None,
        arrived: Callable[[int, memoryview, int], None] | None,
    ) -> BulkRead:
        sock, reused = self._take(address, end)
        try:
            return self._read_on(address, sock, request, ids, lengths, end, landing, arrived)
        except _StaleError:
            if not reused:
                raise
            # The peer closed an idle connection (restarted, or it idled out): once more, on a new one.
            sock = self._connect(address, end)
            return self._read_on(address, sock, request, ids, lengths, end, landing, arrived)

    def _read_on(
        self,
        address: str,
        sock: socket.socket,
        request: bytes,
        ids: np.ndarray,
        lengths: np.ndarray,
        end: float,
        landing: Landing | None,
        arrived: Callable[[int, memoryview, int], None] | None,
    ) -> BulkRead:
        """One read on ``sock``, which goes back to the pool after it, or is closed if it failed."""
        try:
            out = self._exchange(sock, request, ids, lengths, end, landing, arrived)
        except TimeoutError:
            sock.close()
            raise BulkTimeoutError(f"bulk read from {address} missed its deadline") from None
        except BaseException:
            sock.close()
            raise
        self._give(address, sock)
        return out

    def _exchange(
        self,
        sock: socket.socket,
        request: bytes,
        ids: np.ndarray,
        lengths: np.ndarray,
        end: float,
        landing: Landing | None,
        arrived: Callable[[int, memoryview, int], None] | None,
    ) -> BulkRead:
        wanted = np.unique(ids)
        expected = dict(zip(wanted.tolist(), lengths[wanted].tolist()))
        header = bytearray(SAMPLE.size)
        out = BulkRead()
        try:
            _timeout(sock, end)
            sock.sendall(request)
            _recv(sock, memoryview(header), end)
        except (BulkError, ConnectionError) as exc:
            raise _StaleError(f"the bulk connection was closed before it answered: {exc}") from None
        frames = _Frames(sock, end)
        head = memoryview(header)
        ahead = True  # the header holds the next frame's
        while True:
            if not ahead:
                frames.recv(head)
            ahead = False
            out.frames += 1
            status, sample_id, length, digest = SAMPLE.unpack(header)
            if status == END:
                return out
            if status == ERROR:
                if length > MAX_ERROR_BYTES:
                    raise BulkError(f"error message of {length} bytes")
                message = bytearray(length)
                frames.recv(memoryview(message))
                raise BulkRefusedError(sample_id, message.decode(errors="replace"))
            size = expected.pop(sample_id, None)
            if size is None:
                raise BulkError(f"the peer sent sample {sample_id}, which was not asked for (or twice)")
            if status == MISSING:
                continue
            if status != OK or length != size:
                raise BulkError(
                    f"bad frame for sample {sample_id}: status {status}, {length} bytes where the manifest says {size}"
                )
            target = landing.place(sample_id, length) if landing is not None else None
            payload = target if target is not None else memoryview(bytearray(length))
            frames.recv(payload, head)
            ahead = True
            if checksum(payload) != digest:
                out.bad_checksums += 1
                if landing is not None and target is not None:
                    landing.failed(sample_id)
                continue
            out.samples[sample_id] = (payload, digest)
            out.bytes += length
            if landing is not None and target is not None:
                landing.received(sample_id)
            elif arrived is not None:
                arrived(sample_id, payload, digest)

    def _take(self, address: str, end: float) -> tuple[socket.socket, bool]:
        """A connection to ``address``, and whether it was used before."""
        with self._lock:
            pool = self._idle.get(address)
            if pool:
                return pool.pop(), True
        return self._connect(address, end), False

    def _give(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            pool = self._idle.setdefault(address, [])
            if len(pool) < POOL_SIZE:
                pool.append(sock)
                return
        sock.close()

    def connect(self, address: str, timeout: float = CONNECT_SECONDS) -> socket.socket:
        """A new connection to ``address``, handshake done (for a stream of its own)."""
        return self._connect(address, time.monotonic() + timeout)

    def _connect(self, address: str, end: float) -> socket.socket:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        timeout = min(CONNECT_SECONDS, max(end - time.monotonic(), 0.001))
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        except TimeoutError:
            raise BulkTimeoutError(f"cannot connect to the bulk listener {address} in time") from None
        except (OSError, ValueError) as exc:
            raise BulkError(f"cannot connect to the bulk listener {address}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=host)
            hello = recv_bytes(sock, HELLO.size)
            magic, nonce = HELLO.unpack(hello)
            if magic != HELLO_MAGIC:
                raise BulkError(f"{address} is not a bulk listener")
            mine = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(mine + client_proof(self.token, nonce, mine))
            proof = recv_bytes(sock, MAC_BYTES)
            if not secrets.compare_digest(proof, server_proof(self.token, nonce, mine)):
                raise BulkError(f"the bulk listener {address} does not hold the node token")
        except TimeoutError:
            sock.close()
            raise BulkTimeoutError(f"the bulk listener {address} did not finish its handshake in time") from None
        except (OSError, BulkError) as exc:
            sock.close()
            if isinstance(exc, BulkError):
                raise
            raise BulkError(f"handshake with the bulk listener {address} failed: {exc}") from None
        return sock


class _Frames:
    """Receives a reply's frames on ``sock`` until ``end``.

    A payload and the header after it come in one ``recvmsg_into`` with
    MSG_WAITALL on a blocking socket whose own receive timeout bounds each
    call: one system call per sample, where a Python timeout costs a
    ``poll`` and an ``ioctl`` around each receive. A TLS socket has no
    ``recvmsg_into`` and takes its views one by one.
    """

    def __init__(self, sock: socket.socket, end: float) -> None:
        self.sock = sock
        self.end = end
        self.plain = not isinstance(sock, ssl.SSLSocket)
        if self.plain:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(None)
            receive_timeout(sock, left)

    def recv(self, *views: memoryview) -> None:
        """Fills ``views`` in order."""
        if not self.plain:
            for view in views:
                _recv(self.sock, view, self.end)
            return
        recv_all(self.sock, views, self.end)


def _timeout(sock: socket.socket, end: float) -> None:
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _recv(sock: socket.socket, view: memoryview, end: float) -> None:
    """Fills ``view`` before ``end`` (TimeoutError past it)."""
    while view:
        _timeout(sock, end)
        got = sock.recv_into(view)
        if not got:
            raise BulkError("the peer closed the bulk connection")
        view = view[got:]
