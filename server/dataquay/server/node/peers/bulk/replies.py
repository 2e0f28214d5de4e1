"""The asking end of a bulk READ's reply: its frames received into the places given for them.

Every payload the reply carries goes straight where its caller wants it (a
trainer's sealed segment, or a buffer of its own), so that the kernel's copy
out of the socket is the only copy, and its xxh3 is checked there. The loop
is compiled (``replies.c``, ``dataquay.server._replies``) where it was built:
it receives the whole reply without the GIL, one ``recvmsg`` per payload
(with the next frame's header), where the same loop in Python costs about as
much CPU per byte as the kernel's copy (bench/cpu_per_gb.py). A TLS socket,
or an install without the extension, takes the loop in Python below, which
answers alike (tests/test_bulk_replies.py runs both).

A reply ends at its END frame, at an ERROR frame (the peer refused the read),
or at the first frame that cannot be trusted: an id not asked for or sent
twice, a status that is not a sample's, or a length other than the
manifest's. A peer that garbles one frame cannot be trusted with the next,
so the caller closes the connection.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from dataquay.client.wire.records import checksum
from dataquay.server.node.peers.bulk.frames import (
    END,
    ERROR,
    MISSING,
    OK,
    SAMPLE,
    BulkError,
    receive_timeout,
    recv_all,
    recv_before,
)

try:
    from dataquay.server import _replies

    COMPILED = True
except ImportError:
    COMPILED = False


class Got(IntEnum):
    """What became of each asked id."""

    NOT_SENT = 0
    INTACT = 1
    MISSING = 2
    CORRUPT = 3


_INTACT, _MISSING, _CORRUPT = int(Got.INTACT), int(Got.MISSING), int(Got.CORRUPT)


class Outcome(IntEnum):
    """How a reply ended."""

    ENDED = 0
    REFUSED = 1
    UNASKED = 2
    BAD_FRAME = 3
    CLOSED = 4
    TIMED_OUT = 5
    FAILED = 6


@dataclass
class Reply:
    """One reply, received: per asked id what became of it (``Got``) and
    the xxh3 its frame carried; how it ended and the frame it ended on."""

    got: np.ndarray
    digests: np.ndarray
    outcome: Outcome
    frames: int
    #: The last frame's status, id (an ERROR frame's gRPC code) and length
    #: (for FAILED, the errno).
    status: int
    sample_id: int
    length: int


def receive_reply(
    sock: socket.socket, header: bytearray, ids: np.ndarray, targets: list[memoryview], end: float
) -> Reply:
    """Receives the frames of a READ reply whose first header is in
    ``header`` into ``targets`` (one per id of the sorted, distinct ``ids``,
    each exactly the manifest's length), until it ends or ``end``
    (``time.monotonic()``) passes. The socket is left blocking, each receive
    bounded by the kernel's receive timeout; after an ERROR frame its
    message is next on it."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    digests = np.zeros(len(ids), dtype=np.uint64)
    got = np.zeros(len(ids), dtype=np.uint8)
    plain = not isinstance(sock, ssl.SSLSocket)
    if plain:
        left = end - time.monotonic()
        if left <= 0:
            return Reply(got, digests, Outcome.TIMED_OUT, 0, 0, 0, 0)
        sock.settimeout(None)
        receive_timeout(sock, left)
    if plain and COMPILED:
        ended = _replies.receive_frames(sock.fileno(), header, ids, targets, digests, got, end)
    else:
        ended = _receive(sock, plain, header, ids, targets, digests, got, end)
    outcome, frames, status, sample_id, length = ended
    return Reply(got, digests, Outcome(outcome), frames, status, sample_id, length)


def _receive(
    sock: socket.socket,
    plain: bool,
    header: bytearray,
    ids: np.ndarray,
    targets: list[memoryview],
    digests: np.ndarray,
    got: np.ndarray,
    end: float,
) -> tuple[int, int, int, int, int]:
    """The loop of ``replies.c`` in Python: (outcome, frames, status, id, length)."""
    index = {sample_id: k for k, sample_id in enumerate(ids.tolist())}
    done: dict[int, tuple[int, int]] = {}  # k: (what became of it, its digest)
    head = memoryview(header)
    frames, ahead = 0, True  # the header holds the next frame's
    status = sample_id = length = 0
    try:
        while True:
            if not ahead:
                _fill(sock, plain, (head,), end)
            ahead = False
            frames += 1
            status, sample_id, length, digest = SAMPLE.unpack(header)
            if status == END:
                return Outcome.ENDED, frames, status, sample_id, length
            if status == ERROR:
                return Outcome.REFUSED, frames, status, sample_id, length
            k = index.get(sample_id)
            if k is None or k in done:
                return Outcome.UNASKED, frames, status, sample_id, length
            if status == MISSING:
                done[k] = (_MISSING, 0)
                continue
            if status != OK or length != len(targets[k]):
                return Outcome.BAD_FRAME, frames, status, sample_id, length
            _fill(sock, plain, (targets[k], head), end)
            ahead = True
            done[k] = (_INTACT if checksum(targets[k]) == digest else _CORRUPT, digest)
    except TimeoutError:
        return Outcome.TIMED_OUT, frames, status, sample_id, length
    except BulkError:
        return Outcome.CLOSED, frames, status, sample_id, length
    except OSError as exc:
        return Outcome.FAILED, frames, status, sample_id, exc.errno or 0
    finally:
        for k, (became, digest) in done.items():
            got[k], digests[k] = became, digest


def _fill(sock: socket.socket, plain: bool, views: tuple[memoryview, ...], end: float) -> None:
    if plain:
        recv_all(sock, views, end)
        return
    for view in views:
        recv_before(sock, view, end)
