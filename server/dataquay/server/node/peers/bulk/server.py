"""The daemon's bulk listener: peers' reads answered near the socket's speed.

gRPC costs a peer hit a copy into a protobuf message, framing, and an event
loop turn per message: a tenth of what a TCP socket carries here. This
listener answers the same peer reads (this cache only, the rest flagged
missing) over a plain framed stream (:mod:`.frames`): each connection has a
thread of its own that reads a request, looks the values up in LMDB with
``buffers=True`` and sends each payload straight out of the map with
``sendmsg`` (no copy; the GIL is released for the send), a few MiB per read
transaction so that a slow reader never pins old pages for long; one that
stops reading gets the rest as a copy once the map must grow.

What the request names is checked as a gRPC Read is (dataset, manifest
version, batch size, id range): in the connection's thread where the dataset
is registered here and its database open, else on the event loop. An exchange stream takes
a connection for itself (:mod:`.exchange_stream`). Under TLS exchanges stay
on gRPC: a TLS socket cannot be read and written from two threads at once.
Nothing is buffered here:
the socket's own buffers bound what one connection holds. Bad input
(garbage, a wrong token, an oversized request, a connection that stalls in
its handshake or mid-request) closes the connection, counted by reason and
logged at a bounded rate (:mod:`.refusals`); a thread per connection means
one such connection never holds up another. The number of connections is
capped, and so is the number one remote host may hold before it has proved
the token: connections that never speak cannot take the slots peers need.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES, stored_checksum
from dataquay.server.errors import DataquayError
from dataquay.server.node.cache.store import Store
from dataquay.server.node.peers.bulk.client import THREADS
from dataquay.server.node.peers.bulk.exchange_stream import ExchangeStream, Receive
from dataquay.server.node.peers.bulk.frames import (
    END,
    EXCHANGE,
    EXCHANGE_UNAVAILABLE,
    HELLO,
    HELLO_MAGIC,
    MAC_BYTES,
    MAP_SEND_SECONDS,
    MAX_REQUEST_BYTES,
    MISSING,
    NONCE_BYTES,
    OK,
    READ,
    REQUEST,
    REQUEST_MAGIC,
    SAMPLE,
    BulkError,
    client_proof,
    error_frame,
    parse_read,
    recv_bytes,
    recv_exactly,
    send_all,
    send_buffers,
    server_proof,
)
from dataquay.server.node.peers.bulk.refusals import RefusalLog

#: Time a new connection has to finish TLS and prove it holds the token.
HANDSHAKE_SECONDS = 5.0
#: Time a connection may sit between requests before it is closed.
IDLE_SECONDS = 300.0
#: Time one receive or send of a request may make no progress.
STALL_SECONDS = 30.0
#: Connections served at once; more are closed at once.
MAX_CONNECTIONS = 256
#: Connections one remote host may hold before they prove the token; more
#: are closed at once. A peer daemon opens at most its bulk client's THREADS
#: at once, so a peer never meets this cap, while a host that opens silent
#: connections holds this many slots at most, for HANDSHAKE_SECONDS each.
MAX_HANDSHAKES_PER_HOST = THREADS
#: Payload bytes sent under one LMDB read transaction.
SEND_BYTES = 16 << 20

#: Checks a read request and returns the cache database to read: (dataset, manifest id, ids).
Resolve = Callable[[str, str, np.ndarray], Coroutine[Any, Any, str]]
#: The same check without waiting: the cache database, or None where it would have to wait.
ResolveNow = Callable[[str, str, np.ndarray], str | None]
#: Whether this node may yet bring some of a cache database's ids (PeerAnswers.may_bring); thread-safe.
MayBring = Callable[[str, np.ndarray], bool]
#: Those it has or brings, as (tier, payload, checksum) by id (ReadService.read_coming): (dataset, manifest id, ids).
ReadComing = Callable[[str, str, np.ndarray], Coroutine[Any, Any, dict[int, tuple[str, bytes | memoryview, int]]]]


class BulkServer:
    """The bulk listener of one daemon.

    Args:
        token: the node token ("" when the cluster has none).
        tls: this server's TLS context, None for plain TCP.
        resolve: checks a request (on the event loop) and names its cache database.
        store: the cache the payloads are sent from.
        served: called on the event loop with (samples, bytes) of each answered request.
        receive: answers an exchange stream; None takes none (no directory).
        max_value: the largest cache value an exchange may send.
        resolve_now: the same check in the connection's thread, None where
            it would have to wait (then ``resolve`` runs on the event loop):
            two thread hand-offs fewer per read.
        coming: with ``read_coming``, what a read finds missing here but this
            node's staging is about to bring from the PFS is
            answered once they have (the gRPC Read's rule, :mod:`..reads.service`).
    """

    def __init__(
        self,
        token: str,
        tls: ssl.SSLContext | None,
        resolve: Resolve,
        store: Store,
        served: Callable[[int, int], None],
        receive: Receive | None = None,
        max_value: int = 1 << 30,
        max_connections: int = MAX_CONNECTIONS,
        resolve_now: ResolveNow | None = None,
        coming: tuple[MayBring, ReadComing] | None = None,
    ) -> None:
        self.resolve_now = resolve_now
        self.coming = coming
        self.receive = receive
        self.max_value = max_value
        self.exchange_samples = 0
        self.token = token
        self.tls = tls
        self.resolve = resolve
        self.store = store
        self.served = served
        self.max_connections = max_connections
        self.served_samples = 0
        self.served_bytes = 0
        self.refusals = RefusalLog()
        self._handshaking: Counter[str] = Counter()
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closing = False

    def bind(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (port 0 picks one); returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        return int(listener.getsockname()[1])

    async def serve(self) -> None:
        """Accepts connections until cancelled, a thread each."""
        assert self._listener is not None
        self._loop = asyncio.get_running_loop()
        while True:
            conn, address = await self._loop.sock_accept(self._listener)
            host, peer = address[0], f"{address[0]}:{address[1]}"
            with self._lock:
                full = len(self._connections) >= self.max_connections
                host_full = self._handshaking[host] >= MAX_HANDSHAKES_PER_HOST
                if not full and not host_full:
                    self._handshaking[host] += 1
            if full or host_full:
                self._refuse(
                    conn,
                    peer,
                    "full" if full else "host_full",
                    f"more than {self.max_connections} bulk connections at once"
                    if full
                    else f"more than {MAX_HANDSHAKES_PER_HOST} connections from {host} in their handshake",
                )
                continue
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn, host, peer), name=f"bulk-{peer}", daemon=True)
            with self._lock:
                self._connections[conn] = thread
            thread.start()

    @property
    def refused(self) -> int:
        """Connections closed for bad input or because the listener was full."""
        return self.refusals.total

    def close(self, timeout: float = 5.0) -> None:
        """Stops listening and ends every connection; returns once their
        threads are out of the cache (the store may then close)."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            connections = list(self._connections.items())
        for conn, _thread in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _conn, thread in connections:
            thread.join(timeout)
        self.refusals.flush()

    # ------------------------------------------------------------ one connection

    def _serve(self, conn: socket.socket, host: str, peer: str) -> None:
        sock = conn
        handshaking = True
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            if self.tls is not None:
                sock = self.tls.wrap_socket(conn, server_side=True)
            self._handshake(sock)
            self._handshake_over(host)
            handshaking = False
            while self._request(sock):
                pass
        except (BulkError, OSError, ValueError) as exc:
            if not self._closing:
                self._refuse(sock, peer, "handshake" if handshaking else "request", str(exc) or type(exc).__name__)
        finally:
            if handshaking:
                self._handshake_over(host)
            with self._lock:
                self._connections.pop(conn, None)
            sock.close()

    def _handshake_over(self, host: str) -> None:
        """Gives back the handshake slot a connection from ``host`` held."""
        with self._lock:
            self._handshaking[host] -= 1
            if not self._handshaking[host]:
                del self._handshaking[host]

    def _refuse(self, sock: socket.socket, peer: str, reason: str, detail: str) -> None:
        """Closes ``sock``; counts it under ``reason`` (one of a few words) and logs it now and then."""
        sock.close()
        flush_in = self.refusals.refused(reason, peer, detail)
        if flush_in is not None and self._loop is not None and not self._closing:
            self._loop.call_soon_threadsafe(self._loop.call_later, flush_in, self.refusals.flush)

    def _handshake(self, sock: socket.socket) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(HELLO.pack(HELLO_MAGIC, nonce))
        answer = recv_bytes(sock, NONCE_BYTES + MAC_BYTES)
        theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not secrets.compare_digest(proof, client_proof(self.token, nonce, theirs)):
            raise BulkError("the client does not hold the node token")
        sock.sendall(server_proof(self.token, nonce, theirs))

    def _request(self, sock: socket.socket) -> bool:
        """Answers one request; False when the client closed between requests."""
        sock.settimeout(IDLE_SECONDS)
        header = bytearray(REQUEST.size)
        try:
            first = sock.recv_into(header)
        except TimeoutError:
            return False  # idle too long between requests: closed quietly, its client reconnects
        if not first:
            return False
        sock.settimeout(STALL_SECONDS)
        recv_exactly(sock, memoryview(header)[first:])
        magic, kind, length = REQUEST.unpack(header)
        if magic != REQUEST_MAGIC:
            raise BulkError("not a bulk request (bad magic)")
        if kind not in (READ, EXCHANGE):
            raise BulkError(f"unknown bulk request kind {kind}")
        if length > MAX_REQUEST_BYTES:
            raise BulkError(f"request of {length} bytes exceeds the limit of {MAX_REQUEST_BYTES}")
        body = recv_bytes(sock, length)
        if kind == EXCHANGE:
            self._exchange(sock, body)
            return False
        self._read(sock, *parse_read(body))
        return True

    def _read(self, sock: socket.socket, dataset: str, manifest_id: str, ids: np.ndarray) -> None:
        assert self._loop is not None
        try:
            db = self.resolve_now(dataset, manifest_id, ids) if self.resolve_now is not None else None
            if db is None:
                db = asyncio.run_coroutine_threadsafe(self.resolve(dataset, manifest_id, ids), self._loop).result(
                    STALL_SECONDS
                )
        except DataquayError as exc:
            send_buffers(sock, error_frame(exc))
            return
        distinct = list(dict.fromkeys(ids.tolist()))
        if not isinstance(sock, ssl.SSLSocket):
            sock.settimeout(MAP_SEND_SECONDS)
        samples = nbytes = 0
        at = 0
        missing: list[int] = []
        while at < len(distinct):
            at, sent = self._send_group(sock, db, distinct, at, missing)
            samples, nbytes = samples + sent[0], nbytes + sent[1]
        found = self._coming(dataset, manifest_id, db, missing)
        frames: list[bytes | memoryview] = []
        for sample_id in missing:
            if sample_id in found:
                _, payload, digest = found[sample_id]
                frames += [SAMPLE.pack(OK, sample_id, len(payload), digest), payload]
                samples, nbytes = samples + 1, nbytes + len(payload)
            else:
                frames.append(SAMPLE.pack(MISSING, sample_id, 0, 0))
        _send(sock, [*frames, SAMPLE.pack(END, samples, 0, 0)])
        with self._lock:
            self.served_samples += samples
            self.served_bytes += nbytes
        self._loop.call_soon_threadsafe(self.served, samples, nbytes)

    def _coming(
        self, dataset: str, manifest_id: str, db: str, missing: list[int]
    ) -> dict[int, tuple[str, bytes | memoryview, int]]:
        """Those of ``missing`` this node has or brings since it looked (see ``coming``)."""
        if self.coming is None or not missing:
            return {}
        may_bring, read_coming = self.coming
        ids = np.array(missing, dtype=np.int64)
        if not may_bring(db, ids):
            return {}
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(read_coming(dataset, manifest_id, ids), self._loop).result()

    def _send_group(
        self, sock: socket.socket, db: str, ids: list[int], at: int, missing: list[int]
    ) -> tuple[int, tuple[int, int]]:
        """Sends the frames of ``ids[at:]`` up to SEND_BYTES of payload under one
        read transaction, adding to ``missing`` those this cache does not hold;
        returns where the next group starts and (samples, bytes) sent.

        A client that stops reading must not hold the map's growth (and with
        it every commit) back: what the socket has not taken when a growth
        waits goes as a copy, out of the read transaction. A TLS socket has no
        ``sendmsg`` to give up between calls, so under TLS the group is copied
        before it is sent (encrypting copies it anyway).
        """
        buffers: list[bytes | memoryview] = []
        samples = group = 0
        with self.store.value_views(db) as get:
            while at < len(ids) and group < SEND_BYTES:
                sample_id = ids[at]
                at += 1
                value = get(sample_id)
                if value is None or len(value) < CHECKSUM_BYTES:
                    missing.append(sample_id)
                    continue
                buffers += [
                    SAMPLE.pack(OK, sample_id, len(value) - CHECKSUM_BYTES, stored_checksum(value)),
                    value[CHECKSUM_BYTES:],
                ]
                group += len(value) - CHECKSUM_BYTES
                samples += 1
            if isinstance(sock, ssl.SSLSocket):
                rest = [bytes(buffer) for buffer in buffers]
            else:
                rest = send_all(sock, buffers, STALL_SECONDS, self.store.map_readers.growth_waiting)
        _send(sock, rest)
        return at, (samples, group)

    # ------------------------------------------------------------ exchange

    def _exchange(self, sock: socket.socket, body: bytes) -> None:
        """Hands one exchange stream to the receiver until the sender's END."""
        assert self._loop is not None
        if self.receive is None or self.tls is not None:
            reason = (
                "this daemon takes exchanges over gRPC only"
                if self.tls is not None
                else ("this daemon runs without a directory (--directory); exchanges need one")
            )
            send_buffers(sock, error_frame(DataquayError(reason), EXCHANGE_UNAVAILABLE))
            return
        stream = ExchangeStream(self._loop, self.receive, self.max_value, self._taken_in, IDLE_SECONDS, STALL_SECONDS)
        stream.run(sock, body)

    def _taken_in(self, samples: int) -> None:
        with self._lock:
            self.exchange_samples += samples


def _send(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Sends a read's frames that hold no view into the map, on a plain
    socket (its sends timing out every :data:`MAP_SEND_SECONDS`) or a TLS one."""
    if isinstance(sock, ssl.SSLSocket):
        send_buffers(sock, buffers)
    else:
        send_all(sock, buffers, STALL_SECONDS)
