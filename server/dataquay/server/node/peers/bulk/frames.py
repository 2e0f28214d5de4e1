"""The bulk data path's wire format: handshake, requests, per-sample frames.

A connection starts with TLS when the cluster has certificates (the same
rules as gRPC's TCP port), then proves both ends hold the node token (which
only daemons hold: a trainer's cluster token opens no bulk connection)
without sending it: the server sends a random nonce, the client answers with
a nonce of its own and an HMAC-SHA256 of both under the token, and the server
answers with an HMAC of both in the other order. An eavesdropper learns no
token and a replayed answer fails against a fresh nonce. Then::

    request:  [b"DQBR"][u8 kind][u32 body length][body]
    READ body: [u16 len][dataset utf-8][u16 len][manifest id utf-8][u32 n][n x u64 id]
    reply:    per sample [u8 status][u64 id][u64 length][u64 xxh3][payload],
              then [END][u64 samples sent][0][0]; or [ERROR][u64 gRPC code][u64 length][0][message]

The receiver takes a chunk's body in one buffer, its values views of it
(no copy per value); a body length of 0 (a sender before it) has each
frame read in turn.

All integers little-endian. A READ is answered in request order with every
distinct id once; MISSING carries no payload. A connection serves requests
one after another and is reused by its client.

An EXCHANGE (the per-epoch exchange's stream, see
:mod:`dataquay.server.node.exchange.sender`) takes the connection for
itself, both ways at once::

    request:  [b"DQBR"][EXCHANGE][u32 length][ExchangeMessage with the offer, protobuf]
    sender:   [CHUNK][u64 count][u64 body length][0], then the body: count x
              [OK][u64 id][u64 length][0][cache value]; [END][0][0][0] once it has sent everything
    receiver: [REPLY][0][u64 length][0][ExchangeReply, protobuf] (the offer's answer, then one
              per chunk once committed); [END] after the last; or [ERROR] as for a READ
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from dataquay.client.wire.status_codes import code_number, status_of
from dataquay.server.errors import DataquayError

HELLO_MAGIC = b"DQB1"
REQUEST_MAGIC = b"DQBR"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
HELLO = struct.Struct("<4s32s")
REQUEST = struct.Struct("<4sBI")
SAMPLE = struct.Struct("<BQQQ")
#: Request kinds.
READ, EXCHANGE = 1, 2
#: Frame statuses.
OK, MISSING, END, ERROR, CHUNK, REPLY = 0, 1, 2, 3, 4, 5
#: The code of the ERROR frame that answers an exchange a listener does not
#: take (TLS, no directory): the sender goes over gRPC instead.
EXCHANGE_UNAVAILABLE = code_number(grpc.StatusCode.UNAVAILABLE)
#: Most samples in one exchange chunk, and the largest reply taken.
MAX_CHUNK_SAMPLES = 1 << 16
#: Largest exchange chunk body taken (or one sample's frame, if larger).
MAX_CHUNK_BYTES = 64 << 20
MAX_REPLY_BYTES = 16 << 20
#: Largest request body taken: 64k ids and two names, with room to spare.
MAX_REQUEST_BYTES = 1 << 20
#: Longest error message taken.
MAX_ERROR_BYTES = 4096
#: Iovecs passed to one sendmsg (under every OS's IOV_MAX).
IOV_BATCH = 512
#: The send timeout of a socket that sends out of the map (:func:`send_all`):
#: how long a growth of the map may wait on it.
MAP_SEND_SECONDS = 0.02
#: struct timeval, as SO_RCVTIMEO and SO_SNDTIMEO take it.
TIMEVAL = struct.Struct("@ll")


@dataclass(frozen=True)
class ExchangeChunk:
    """One chunk of an exchange stream as it came over the bulk path: (id,
    cache value) pairs whose checksums held, and how many did not (left out)."""

    samples: list[tuple[int, bytes | memoryview]]
    bad_checksums: int = 0


class BulkError(DataquayError):
    """A bulk connection that cannot go on: closed, garbled, refused, too slow."""


def client_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"server" + client_nonce + server_nonce, hashlib.sha256).digest()


def read_request(dataset: str, manifest_id: str, ids: np.ndarray) -> bytes:
    """A READ request, header included."""
    name, manifest = dataset.encode(), manifest_id.encode()
    body = b"".join(
        [
            struct.pack("<H", len(name)),
            name,
            struct.pack("<H", len(manifest)),
            manifest,
            struct.pack("<I", len(ids)),
            np.ascontiguousarray(ids, dtype="<u8").tobytes(),
        ]
    )
    return REQUEST.pack(REQUEST_MAGIC, READ, len(body)) + body


def parse_read(body: bytes) -> tuple[str, str, np.ndarray]:
    """(dataset, manifest id, ids) of a READ body; raises BulkError for a malformed one."""
    try:
        at = 0
        names = []
        for _ in range(2):
            (size,) = struct.unpack_from("<H", body, at)
            names.append(body[at + 2 : at + 2 + size].decode())
            at += 2 + size
        (count,) = struct.unpack_from("<I", body, at)
        at += 4
    except (struct.error, UnicodeDecodeError) as exc:
        raise BulkError(f"malformed read request: {exc}") from None
    if len(body) != at + 8 * count:
        raise BulkError(f"malformed read request: {len(body)} bytes do not hold {count} ids")
    return names[0], names[1], np.frombuffer(body, dtype="<u8", count=count, offset=at)


def chunk_frames(samples: Sequence[tuple[int, bytes | memoryview]]) -> list[bytes | memoryview]:
    """An exchange chunk's frames: its header with the body's length, then each sample's."""
    frames: list[bytes | memoryview] = [b""]
    body = 0
    for sample_id, value in samples:
        frames += [SAMPLE.pack(OK, sample_id, len(value), 0), value]
        body += SAMPLE.size + len(value)
    frames[0] = SAMPLE.pack(CHUNK, len(samples), body, 0)
    return frames


def parse_chunk(body: memoryview, count: int, max_value: int) -> list[tuple[int, bytes | memoryview]]:
    """(id, cache value) of each of ``count`` sample frames filling ``body``,
    the values views of it; raises BulkError for frames that do not."""
    samples: list[tuple[int, bytes | memoryview]] = []
    at = 0
    for _ in range(count):
        try:
            status, sample_id, length, _ = SAMPLE.unpack_from(body, at)
        except struct.error:
            raise BulkError(f"exchange chunk body of {len(body)} bytes ends inside a frame header") from None
        at += SAMPLE.size
        if status != OK or length > max_value or at + length > len(body):
            raise BulkError(f"bad exchange sample frame: status {status}, {length} bytes")
        samples.append((sample_id, body[at : at + length]))
        at += length
    if at != len(body):
        raise BulkError(f"exchange chunk body of {len(body)} bytes holds {at} bytes of {count} samples")
    return samples


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``; raises BulkError when the peer closes first."""
    while view:
        got = sock.recv_into(view)
        if not got:
            raise BulkError("the peer closed the bulk connection")
        view = view[got:]


def timeout_until(sock: socket.socket, end: float) -> None:
    """Sets ``sock``'s Python timeout to what is left until ``end``
    (``time.monotonic()``); TimeoutError when nothing is."""
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def recv_before(sock: socket.socket, view: memoryview, end: float) -> None:
    """Fills ``view`` from ``sock`` (plain or TLS) before ``end``: TimeoutError
    past it, BulkError when the peer closes first."""
    while view:
        timeout_until(sock, end)
        got = sock.recv_into(view)
        if not got:
            raise BulkError("the peer closed the bulk connection")
        view = view[got:]


def recv_bytes(sock: socket.socket, size: int) -> bytes:
    out = bytearray(size)
    recv_exactly(sock, memoryview(out))
    return bytes(out)


def send_now(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> list[bytes]:
    """Sends what the socket takes of ``buffers`` without waiting (a blocking
    socket, see :func:`kernel_timeouts`, sent to with MSG_DONTWAIT) and
    returns a copy of the rest, for buffers that do not outlive the caller
    (views into the map)."""
    if isinstance(sock, ssl.SSLSocket) or sock.gettimeout() is not None:
        return [bytes(b) for b in buffers]
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    at = 0
    while at < len(views):
        try:
            sent = sock.sendmsg(views[at : at + IOV_BATCH], (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        at = _past(views, at, sent)
    return [bytes(v) for v in views[at:]]


def send_all(
    sock: socket.socket, buffers: Sequence[bytes | memoryview], stall: float, let_go: Callable[[], bool] | None = None
) -> list[bytes]:
    """Sends ``buffers`` on a socket whose sends time out shortly
    (:data:`MAP_SEND_SECONDS`): a blocking one under the kernel's timeout
    (:func:`kernel_timeouts`), where the kernel sends them whole as the peer
    takes them, a few system calls for a chunk, or one under Python's.
    Between calls ``let_go()`` may ask for the buffers back (views into the
    map, which is about to grow): then the rest is returned as a copy, to
    send once the read transaction is over. Raises TimeoutError when nothing
    went for ``stall`` seconds."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    at = 0
    moved = time.monotonic()
    while at < len(views):
        try:
            sent = sock.sendmsg(views[at : at + IOV_BATCH])
        except (BlockingIOError, TimeoutError):  # the socket's send timeout, nothing sent
            sent = 0
        if sent:
            at, moved = _past(views, at, sent), time.monotonic()
        elif time.monotonic() - moved > stall:
            raise TimeoutError
        if at < len(views) and let_go is not None and let_go():
            return [bytes(v) for v in views[at:]]
    return []


def kernel_timeouts(sock: socket.socket, receive: float, send: float = MAP_SEND_SECONDS) -> None:
    """Makes ``sock`` blocking, each receive and send bounded by the
    kernel's own timeout (SO_RCVTIMEO, SO_SNDTIMEO): a Python timeout costs
    a ``poll`` before every call. A call past its timeout raises
    BlockingIOError, or returns what it moved so far."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(receive))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send))


def receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Sets the kernel's receive timeout of a socket set up by :func:`kernel_timeouts`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def recv_all(sock: socket.socket, views: Sequence[memoryview], end: float | None = None) -> None:
    """Fills ``views`` in order from a socket set up by :func:`kernel_timeouts`:
    one ``recvmsg_into`` with MSG_WAITALL as a rule, where a Python timeout
    costs a ``poll`` and a call per segment that arrived. Raises TimeoutError
    past the receive timeout with nothing received, or past ``end``."""
    left = [view for view in views if len(view)]
    at = 0
    while at < len(left):
        try:
            got = sock.recvmsg_into(left[at : at + IOV_BATCH], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:  # the socket's receive timeout
            raise TimeoutError from None
        if not got:
            raise BulkError("the peer closed the bulk connection")
        if end is not None and time.monotonic() > end:
            raise TimeoutError
        at = _past(left, at, got)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return TIMEVAL.pack(whole, max(int((seconds - whole) * 1e6), 1 if not whole else 0))


def _past(views: list[memoryview], at: int, sent: int) -> int:
    """The index of the first view not wholly sent, after ``sent`` more bytes
    went from ``views[at]`` on (a view sent in part is cut to its rest)."""
    while sent:
        if sent >= len(views[at]):
            sent -= len(views[at])
            at += 1
        else:
            views[at] = views[at][sent:]
            sent = 0
    return at


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Sends ``buffers`` in order, as few syscalls as the socket allows:
    sendmsg with iovecs on a plain socket (no copy of the payloads), one
    sendall each on a TLS socket, which has no sendmsg."""
    if isinstance(sock, ssl.SSLSocket):
        for buffer in buffers:
            sock.sendall(buffer)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    at = 0
    while at < len(views):
        at = _past(views, at, sock.sendmsg(views[at : at + IOV_BATCH]))


def error_frame(exc: DataquayError, code: int | None = None) -> list[bytes]:
    """An ERROR frame: the gRPC status code the error maps to (or ``code``) and its message."""
    message = str(exc).encode()[:MAX_ERROR_BYTES]
    return [SAMPLE.pack(ERROR, code_number(status_of(exc)[0]) if code is None else code, len(message), 0), message]
