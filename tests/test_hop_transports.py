"""Which transport each hop picks, and the one parser of a streamed Read's reply, fed forged streams."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from one_daemon import add

from dataquay.client.connection import DaemonConnection
from dataquay.client.daemon_transports import DaemonReply, DaemonTransport, pick_transports
from dataquay.client.errors import DataquayError, PieceError
from dataquay.client.wire.memfd import MemfdSegment, fd_socket_path
from dataquay.client.wire.read_stream import ReadStream
from dataquay.client.wire.records import checksum
from dataquay.client.wire.shm import Segment
from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.peers.transports import bulk_first
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SIZE = 1 << 20
LENGTHS = np.array([5, 12, 3], dtype=np.uint64)
PAYLOADS = [b"abcde", b"0123456789ab", b"xyz"]


def names(transports: list[DaemonTransport]) -> list[str]:
    return [transport.name for transport in transports]


def test_a_trainer_without_a_segment_reads_inline_and_a_dev_shm_one_names_it_in_the_grpc_read() -> None:
    connection = DaemonConnection("127.0.0.1:1")
    assert names(pick_transports(connection, None, 10, 1000)) == ["grpc"]
    segment = Segment(SIZE)
    try:
        assert names(pick_transports(connection, segment, 10, 1000)) == ["shm+grpc"]
        # However small the batch: only a sealed segment has a connection of its own to frame reads on.
        assert names(pick_transports(connection, segment, 1, 1)) == ["shm+grpc"]
    finally:
        segment.close()


def test_a_sealed_segment_frames_the_batch_it_holds_and_sends_any_other_over_grpc(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 4, sizes=(100,), seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    connection = DaemonConnection(daemon.address)
    segment = MemfdSegment(SIZE, fd_socket_path(daemon.address), "")
    try:
        assert segment.read_ids > 0
        assert names(pick_transports(connection, segment, segment.read_ids, SIZE)) == ["memfd", "shm+grpc"]
        # More ids than one framed request may carry, or more bytes than the segment holds: gRPC at once.
        assert names(pick_transports(connection, segment, segment.read_ids + 1, 10)) == ["shm+grpc"]
        assert names(pick_transports(connection, segment, 1, SIZE + 1)) == ["shm+grpc"]
    finally:
        segment.close()


@pytest.mark.parametrize(
    ("bulk_address", "bulk_on", "usable", "bulk"),
    [
        ("10.0.0.2:7001", True, True, True),
        ("", True, True, False),  # the peer's bulk path is off
        ("10.0.0.2:7001", False, True, False),  # this daemon's bulk path is off
        ("10.0.0.2:7001", True, False, False),  # the listener failed lately
    ],
)
def test_a_peer_read_goes_over_bulk_only_where_both_ends_have_it_and_it_did_not_fail_lately(
    bulk_address: str, bulk_on: bool, usable: bool, bulk: bool
) -> None:
    assert bulk_first(bulk_address, bulk_on, usable) is bulk


def sample(i: int, data: bytes | None = None, **shm: int) -> pb.Sample:
    """Sample ``i`` with the checksum of its true payload, carrying ``data`` (default: that payload)."""
    data = PAYLOADS[i] if data is None else data
    return pb.Sample(
        id=i,
        data=data,
        checksum=checksum(PAYLOADS[i]),
        in_shm=bool(shm),
        shm_offset=shm.get("offset", 0),
        length=shm.get("length", 0),
        checked_in_place=bool(shm.get("checked", 0)),
    )


def piece(i: int, offset: int, data: bytes, length: int | None = None) -> pb.ReadChunk:
    length = len(PAYLOADS[i]) if length is None else length
    return pb.ReadChunk(
        piece=pb.Sample(
            id=i, offset=offset, length=length, data=data, checksum=checksum(PAYLOADS[i]) if i < len(PAYLOADS) else 0
        )
    )


def test_the_parser_joins_pieces_and_flags_each_payload_whose_checksum_fails() -> None:
    stream = ReadStream("peer n1", LENGTHS)
    got = list(stream.take(pb.ReadChunk(samples=[sample(0), sample(2, data=b"xyZ")])))
    got += list(stream.take(piece(1, 0, PAYLOADS[1][:7])))
    got += list(stream.take(piece(1, 7, PAYLOADS[1][7:])))
    got += list(stream.take(pb.ReadChunk(samples=[pb.Sample(id=2, missing=True)])))
    stream.end()
    assert [(i, bytes(data), intact, missing) for i, data, _, _, missing, _, intact in got] == [
        (0, b"abcde", True, False),
        (2, b"xyZ", False, False),
        (1, PAYLOADS[1], True, False),
        (2, b"", True, True),
    ]
    unverified = ReadStream("the daemon", LENGTHS, verify=False)
    assert [s[-1] for s in unverified.take(pb.ReadChunk(samples=[sample(2, data=b"xyZ")]))] == [True]


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        # A first piece claiming more bytes than the manifest's: refused before anything is joined.
        ([piece(1, 0, b"0123", length=1 << 30)], "where a first piece of its 12 bytes was due"),
        # A piece that skips ahead.
        ([piece(1, 0, PAYLOADS[1][:4]), piece(1, 8, PAYLOADS[1][8:])], "the piece of sample 1 at offset 4 was due"),
        # A piece that runs past its sample.
        ([piece(1, 0, PAYLOADS[1] + b"!")], "13 bytes at offset 0 of sample 1, which has 12"),
        # A whole sample before the pieces begun have ended.
        ([piece(1, 0, PAYLOADS[1][:4]), pb.ReadChunk(samples=[sample(0)])], "stopped sending sample 1 after 4"),
        # A piece of an id the manifest does not have.
        ([piece(9, 0, b"abc", length=3)], "a first piece of its -1 bytes was due"),
    ],
)
def test_the_parser_refuses_pieces_that_do_not_make_the_payload_the_manifest_describes(
    chunks: list[pb.ReadChunk], error: str
) -> None:
    stream = ReadStream("peer n1", LENGTHS)
    with pytest.raises(PieceError, match=error):
        for chunk in chunks:
            list(stream.take(chunk))


def test_a_reply_that_ends_inside_a_payloads_pieces_is_refused() -> None:
    stream = ReadStream("peer n1", LENGTHS)
    assert list(stream.take(piece(1, 0, PAYLOADS[1][:6]))) == []
    with pytest.raises(PieceError, match="stopped sending sample 1 after 6 of its 12 bytes"):
        stream.end()


def test_a_checked_in_place_mark_is_taken_only_from_a_sealed_segment() -> None:
    segment = Segment(SIZE)
    try:
        segment.map[0:5] = b"abcdE"  # changed by another process of the user after the daemon's check
        marked = pb.ReadChunk(samples=[sample(0, data=b"", offset=0, length=5, checked=1)])
        [open_shm] = ReadStream("the daemon", LENGTHS, segment=segment).take(marked)
        assert (bytes(open_shm[1]), *open_shm[-2:]) == (b"abcdE", True, False)  # (data, in_segment, intact)
        [sealed] = ReadStream("the daemon", LENGTHS, segment=segment, trust_marks=True).take(marked)
        assert (bytes(sealed[1]), *sealed[-2:]) == (b"abcdE", True, True)
        # A mark naming a segment the call did not hand over: the inline bytes, checked.
        [no_segment] = ReadStream("the daemon", LENGTHS).take(marked)
        assert (bytes(no_segment[1]), *no_segment[-2:]) == (b"", False, False)
    finally:
        segment.close()


def test_the_trainers_reply_refuses_a_sample_out_of_the_order_asked_before_joining_its_pieces() -> None:
    reply = DaemonReply("imgs", [0, 1], LENGTHS, None, verify=True)
    reply.take(pb.ReadChunk(samples=[sample(0)]))
    with pytest.raises(DataquayError, match="sent sample 2 of 'imgs' where 1 was due"):
        reply.take(piece(2, 0, b"x", length=3))
    reply = DaemonReply("imgs", [0], LENGTHS, None, verify=True)
    with pytest.raises(DataquayError, match="more samples of 'imgs' than the 1 asked for"):
        reply.take(pb.ReadChunk(samples=[sample(0), sample(1)]))
