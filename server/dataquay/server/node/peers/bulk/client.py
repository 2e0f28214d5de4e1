"""Reads from peers' bulk listeners (:mod:`.server`), a few connections kept per peer.

A read runs in a thread of its own pool. Before it asks, every payload it
asks for has its place: room the :class:`Landing` gives (a trainer's sealed
segment, so that the kernel's copy out of the socket is the only copy), or
else a buffer of the length the manifest gives (one per sample: a buffer for
a whole batch of large samples would be past glibc's mmap threshold,
:mod:`dataquay.client.malloc`, and page-fault afresh every batch). The reply
is then received into those places, each xxh3 checked there, by the
compiled loop of :mod:`.replies` where it was built, without the GIL. What
was received where it goes is marked so from the bulk thread (``received``),
so the event loop is not woken for it. A frame that names an id not asked
for, or a length other than the manifest's, ends the connection: a peer that
garbles one frame cannot be trusted with the next. A connection that
answered cleanly goes back to its peer's pool.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dataquay.server.node.peers.bulk.frames import (
    HELLO,
    HELLO_MAGIC,
    MAC_BYTES,
    MAX_ERROR_BYTES,
    NONCE_BYTES,
    SAMPLE,
    BulkError,
    client_proof,
    read_request,
    recv_before,
    recv_bytes,
    server_proof,
    timeout_until,
)
from dataquay.server.node.peers.bulk.replies import Got, Outcome, Reply, receive_reply

#: Idle connections kept per peer.
POOL_SIZE = 4
#: Reads in flight at once, over all peers.
THREADS = 16
#: Time to connect and finish the handshake.
CONNECT_SECONDS = 5.0


class Landing(Protocol):
    """Where a read's payloads go as they come off the wire, or out of this
    node's cache (:meth:`copy_in`)."""

    def reserve(self, ids: np.ndarray, lengths: np.ndarray) -> list[memoryview | None]:
        """A writable view of ``lengths[k]`` bytes to receive ``ids[k]`` into,
        or None for a buffer of its own, for each of a read's ids. Called from
        a bulk thread before the read."""

    def received(self, ids: list[int]) -> None:
        """Called from the bulk thread once the payloads of ``ids``, received
        into the views ``reserve`` gave, passed their checksums there: they
        are where they go, so the event loop is not woken for them."""

    def copy_in(self, ids: Sequence[int], values: list[memoryview | None]) -> list[memoryview | None]:
        """Copies the payloads of cache values this node read from its own
        cache (views into the map, each with its checksum) to where they go,
        checking each there: the view of each intact copy there, or None
        for one to be checked and copied into bytes of its own (or absent).
        Called on the event loop, inside the read transaction."""


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
        return await loop.run_in_executor(
            self.threads, self._read, address, request, ids, lengths, time.monotonic() + deadline, landing
        )

    def close(self) -> None:
        with self._lock:
            idle = [sock for pool in self._idle.values() for sock in pool]
            self._idle.clear()
        for sock in idle:
            sock.close()
        self.threads.shutdown(wait=False, cancel_futures=True)

    def _read(
        self, address: str, request: bytes, ids: np.ndarray, lengths: np.ndarray, end: float, landing: Landing | None
    ) -> BulkRead:
        wanted = np.unique(ids)
        sizes = lengths[wanted]
        places = landing.reserve(wanted, sizes) if landing is not None else [None] * len(wanted)
        # A buffer of its own for each payload, not one for the batch: past glibc's mmap threshold
        # (dataquay.client.malloc) a batch's buffer would page-fault afresh every batch.
        targets = [
            memoryview(bytearray(size)) if place is None else place for place, size in zip(places, sizes.tolist())
        ]
        sock, reused = self._take(address, end)
        try:
            reply = self._read_on(address, sock, request, wanted, targets, end)
        except _StaleError:
            if not reused:
                raise
            # The peer closed an idle connection (restarted, or it idled out): once more, on a new one.
            sock = self._connect(address, end)
            reply = self._read_on(address, sock, request, wanted, targets, end)
        out = BulkRead(frames=reply.frames, bad_checksums=int(np.count_nonzero(reply.got == Got.CORRUPT)))
        intact = np.flatnonzero(reply.got == Got.INTACT)
        in_place = []
        for k, sample_id, digest in zip(intact.tolist(), wanted[intact].tolist(), reply.digests[intact].tolist()):
            out.samples[sample_id] = (targets[k], digest)
            out.bytes += len(targets[k])
            if places[k] is not None:
                in_place.append(sample_id)
        if landing is not None and in_place:
            landing.received(in_place)
        return out

    def _read_on(
        self,
        address: str,
        sock: socket.socket,
        request: bytes,
        wanted: np.ndarray,
        targets: list[memoryview],
        end: float,
    ) -> Reply:
        """One read on ``sock``, which goes back to the pool after it, or is closed if it failed."""
        try:
            reply = self._exchange(sock, request, wanted, targets, end)
            if reply.outcome != Outcome.ENDED:
                at = bisect.bisect_left(wanted.tolist(), reply.sample_id)
                raise _failure(address, sock, reply, len(targets[at]) if at < len(targets) else 0)
        except TimeoutError:
            sock.close()
            raise BulkTimeoutError(f"bulk read from {address} missed its deadline") from None
        except BaseException:
            sock.close()
            raise
        self._give(address, sock)
        return reply

    def _exchange(
        self, sock: socket.socket, request: bytes, wanted: np.ndarray, targets: list[memoryview], end: float
    ) -> Reply:
        header = bytearray(SAMPLE.size)
        try:
            timeout_until(sock, end)
            sock.sendall(request)
            recv_before(sock, memoryview(header), end)
        except (BulkError, ConnectionError) as exc:
            raise _StaleError(f"the bulk connection was closed before it answered: {exc}") from None
        return receive_reply(sock, header, wanted, targets, end)

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


def _failure(address: str, sock: socket.socket, reply: Reply, expected: int) -> BulkError:
    """The error a reply that did not end cleanly raises: for a refusal,
    with the peer's message (read off ``sock``, which is closed after);
    ``expected`` is the manifest's length of the sample it ended on."""
    sample_id, status, length = reply.sample_id, reply.status, reply.length
    if reply.outcome == Outcome.TIMED_OUT:
        return BulkTimeoutError(f"bulk read from {address} missed its deadline")
    if reply.outcome == Outcome.REFUSED:
        if length > MAX_ERROR_BYTES:
            return BulkError(f"error message of {length} bytes")
        try:
            message = recv_bytes(sock, length)
        except (OSError, BulkError) as exc:
            return BulkError(f"the peer refused the read, and its message was cut short: {exc}")
        return BulkRefusedError(sample_id, message.decode(errors="replace"))
    if reply.outcome == Outcome.UNASKED:
        return BulkError(f"the peer sent sample {sample_id}, which was not asked for (or twice)")
    if reply.outcome == Outcome.BAD_FRAME:
        return BulkError(
            f"bad frame for sample {sample_id}: status {status}, {length} bytes where the manifest says {expected}"
        )
    if reply.outcome == Outcome.CLOSED:
        return BulkError("the peer closed the bulk connection")
    return BulkError(f"bulk read from {address} failed: {os.strerror(length)}")
