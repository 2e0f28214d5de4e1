"""The asking end of a bulk READ: a reply's frames received into the places
given for them, each payload checked there, and every way a peer can end or
garble a reply met with one clear outcome. The compiled loop and its Python
twin answer alike, on a real socket pair standing in for the peer."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dataquay.client.wire.records import checksum
from dataquay.server.node.peers.bulk import replies
from dataquay.server.node.peers.bulk.frames import END, ERROR, MISSING, OK, SAMPLE, kernel_timeouts
from dataquay.server.node.peers.bulk.replies import Got, Outcome, Reply, receive_reply

LOOPS = [
    pytest.param(True, id="c", marks=pytest.mark.skipif(not replies.COMPILED, reason="the C extension is not built")),
    pytest.param(False, id="python"),
]


@pytest.fixture(params=LOOPS)
def compiled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    monkeypatch.setattr(replies, "COMPILED", request.param)
    yield request.param


def frame(status: int, sample_id: int, payload: bytes = b"", digest: int | None = None) -> bytes:
    length = len(payload)
    return SAMPLE.pack(status, sample_id, length, checksum(payload) if digest is None else digest) + payload


def receive(stream: bytes, ids: list[int], lengths: list[int], timeout: float = 5.0) -> tuple[Reply, list[bytearray]]:
    """``stream`` sent by a peer thread, received as a reply to ``ids``; the peer closes once it has sent it."""
    asker, peer = socket.socketpair()
    targets = [bytearray(n) for n in lengths]
    with asker, peer:
        kernel_timeouts(asker, receive=timeout)

        def send() -> None:
            peer.sendall(stream)
            peer.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        header = bytearray(SAMPLE.size)
        asker.recv_into(header, SAMPLE.size, socket.MSG_WAITALL)
        reply = receive_reply(
            asker, header, np.array(ids, dtype=np.int64), [memoryview(t) for t in targets], time.monotonic() + timeout
        )
        sender.join()
    return reply, targets


def test_the_compiled_loop_reads_the_frames_python_writes() -> None:
    if not replies.COMPILED:
        pytest.skip("the C extension is not built")
    from dataquay.server import _replies

    assert _replies.HEADER_BYTES == SAMPLE.size
    assert (_replies.FRAME_OK, _replies.FRAME_MISSING, _replies.FRAME_END, _replies.FRAME_ERROR) == (
        OK,
        MISSING,
        END,
        ERROR,
    )


def test_a_reply_lands_every_payload_in_its_place_checked_there(compiled: bool) -> None:
    payloads = {3: b"x" * 70_000, 9: b"", 12: bytes(range(256)) * 40, 40: b"y" * 5}
    ids = [*sorted(payloads), 41]
    # Out of order, one missing, one corrupt on the wire (its digest is another payload's).
    stream = b"".join(
        [
            frame(OK, 12, payloads[12]),
            frame(MISSING, 41),
            frame(OK, 3, payloads[3]),
            frame(OK, 9, payloads[9]),
            frame(OK, 40, payloads[40], digest=checksum(b"z" * 5)),
            frame(END, 4),
        ]
    )
    reply, targets = receive(stream, ids, [len(payloads.get(i, b"")) for i in ids])
    assert reply.outcome == Outcome.ENDED and reply.frames == 6
    assert reply.got.tolist() == [Got.INTACT, Got.INTACT, Got.INTACT, Got.CORRUPT, Got.MISSING]
    assert [bytes(t) for t in targets[:3]] == [payloads[3], payloads[9], payloads[12]]
    assert reply.digests[:3].tolist() == [checksum(payloads[i]) for i in (3, 9, 12)]


def test_an_id_not_asked_for_or_sent_twice_ends_the_reply(compiled: bool) -> None:
    for stream, last in [
        (frame(OK, 1, b"a") + frame(OK, 7, b"b") + frame(END, 2), 7),
        (frame(OK, 1, b"a") + frame(OK, 1, b"a") + frame(END, 2), 1),
        (frame(MISSING, 2) + frame(OK, 2, b"b") + frame(END, 2), 2),
        (frame(OK, 1, b"a") + frame(OK, 2**64 - 1, b"b"), 2**64 - 1),
    ]:
        reply, _ = receive(stream, [1, 2], [1, 1])
        assert (reply.outcome, reply.sample_id, reply.frames) == (Outcome.UNASKED, last, 2)


def test_a_length_other_than_the_manifests_or_a_stray_status_ends_the_reply(compiled: bool) -> None:
    reply, targets = receive(frame(OK, 1, b"abc") + frame(END, 1), [1], [4])
    assert (reply.outcome, reply.status, reply.sample_id, reply.length) == (Outcome.BAD_FRAME, OK, 1, 3)
    assert targets == [bytearray(4)]  # nothing received into a place of the wrong size
    reply, _ = receive(SAMPLE.pack(7, 1, 1, 0) + b"a", [1], [1])
    assert (reply.outcome, reply.status) == (Outcome.BAD_FRAME, 7)


def test_a_refusal_leaves_its_message_next_on_the_socket(compiled: bool) -> None:
    message = b"no such dataset"
    asker, peer = socket.socketpair()
    with asker, peer:
        kernel_timeouts(asker, receive=5)
        peer.sendall(SAMPLE.pack(ERROR, 5, len(message), 0) + message)
        header = bytearray(SAMPLE.size)
        asker.recv_into(header, SAMPLE.size, socket.MSG_WAITALL)
        reply = receive_reply(asker, header, np.array([1]), [memoryview(bytearray(1))], time.monotonic() + 5)
        assert (reply.outcome, reply.sample_id, reply.length) == (Outcome.REFUSED, 5, len(message))
        assert asker.recv(64) == message


def test_a_peer_that_closes_or_stalls_midway_ends_the_reply_clearly_not_by_hanging(compiled: bool) -> None:
    payload = b"p" * 100_000
    # Closed inside a payload, and between frames.
    for stream in [frame(OK, 1, payload)[:50_000], frame(OK, 1, payload)]:
        reply, _ = receive(stream, [1, 2], [len(payload), 1])
        assert reply.outcome == Outcome.CLOSED
    # Silent: the deadline ends it, not the kernel's receive timeout alone.
    asker, peer = socket.socketpair()
    with asker, peer:
        kernel_timeouts(asker, receive=30)
        peer.sendall(frame(OK, 1, payload)[: SAMPLE.size + 10])
        header = bytearray(SAMPLE.size)
        asker.recv_into(header, SAMPLE.size, socket.MSG_WAITALL)
        started = time.monotonic()
        reply = receive_reply(asker, header, np.array([1]), [memoryview(bytearray(len(payload)))], started + 0.3)
        assert reply.outcome == Outcome.TIMED_OUT
        assert time.monotonic() - started < 10


def test_the_reply_loop_benchmark_receives_every_byte_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    monkeypatch.setattr(replies, "COMPILED", replies.COMPILED)  # each way sets it
    import reply_loop

    # Each reply is checked whole and intact inside: a way that lost a byte would fail there.
    for way in ["raw", "python", *(["compiled"] if replies.COMPILED else [])]:
        for threads in (1, reply_loop.THREADS):
            cpu, wall = reply_loop.measure(way, 4096, batches=3, threads=threads)
            assert cpu >= 0 and wall > 0
