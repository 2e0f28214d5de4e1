"""Batch reads on a sealed memfd segment's own connection against a real
daemon: the bytes, the errors a streamed Read would give, the fall back to
gRPC, and what a client that sends garbage meets (its connection closed, the
daemon serving on)."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from one_daemon import add, daemon_stats, files_bytes, stage, tiers_read
from polling import wait_until

import dataquay.client as dq
from dataquay.client.errors import BatchTooLargeError, SampleIdError, UnknownDatasetError
from dataquay.client.wire.batch_reads import OK, REQUEST_BYTES, BatchRequest, request_frame
from dataquay.client.wire.batch_reads import parse_reply as parse_batch_reply
from dataquay.client.wire.memfd import MemfdSegment, fd_socket_path, parse_reply
from dataquay.client.wire.records import checksum
from dataquay.client.wire.status_codes import CODES_BY_VALUE, error_from_status
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SIZES = (3000, 70_000, 17, 250_000)
MAX_BATCH = 16


@pytest.fixture
def served(start_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> DaemonProcess:
    """A daemon with dataset 'imgs' of 40 samples of SIZES."""
    daemon = start_daemon("--max-batch", str(MAX_BATCH))
    synthetic.make_files_dataset(tmp_path / "imgs", 40, sizes=SIZES, seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    return daemon


@pytest.fixture
def segment(served: DaemonProcess) -> Iterator[MemfdSegment]:
    seg = MemfdSegment(4 << 20, fd_socket_path(served.address), "")
    yield seg
    seg.close()


def ask(seg: MemfdSegment, dataset: str, ids: list[int]) -> bytes:
    return seg.read(request_frame(BatchRequest(dataset, "", "", None, np.array(ids, np.uint64))), 10)


def test_a_client_reads_its_misses_on_the_segment_connection_bytes_exact(
    served: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    with dq.connect(served.address, timeout=5) as client:
        ds = client.dataset("imgs")
        ids = [39, 0, 7, 7, 12, 3, 38]
        got, tiers = tiers_read(client, lambda: ds.get_batch(ids))
        assert got == files_bytes(3, ids, SIZES)
        assert tiers["pfs"] == len(ids) and tiers["fallback"] == 0
        more = list(range(20, 30))
        assert ds.get_batch(more) == files_bytes(3, more, SIZES)
    assert daemon_stats(served).bulk.segment_reads == 2
    metrics = urllib.request.urlopen(served.metrics_url, timeout=30).read().decode()
    assert "dataquay_bulk_segment_reads_total 2.0" in metrics.splitlines()


def test_a_segment_read_answers_offsets_of_exact_bytes(segment: MemfdSegment) -> None:
    assert segment.read_ids > 0
    ids = [5, 1, 1, 38]
    answer = parse_batch_reply(ask(segment, "imgs", ids), len(ids))
    assert answer.code == OK
    got = [segment.map[o : o + n] for o, n in zip(answer.offsets.tolist(), answer.lengths.tolist())]
    assert got == files_bytes(3, ids, SIZES)
    assert answer.checksums.tolist() == [checksum(v) for v in got]


def test_a_segment_read_marks_checked_what_the_daemon_checked_from_its_cache_not_what_it_read_from_the_pfs(
    segment: MemfdSegment,
) -> None:
    ids = [4, 9]
    first = parse_batch_reply(ask(segment, "imgs", ids), len(ids))
    assert first.tiers.tolist() == [pb.TIER_PFS] * 2 and first.checked.tolist() == [0, 0]
    # Cached behind the read: later reads come from the cache, each value checked as it is read.
    answers = []

    def from_cache() -> bool:
        answers.append(parse_batch_reply(ask(segment, "imgs", ids), len(ids)))
        return answers[-1].tiers.tolist() == [pb.TIER_CACHE] * 2

    wait_until(from_cache, "the samples read from the cache")
    again = answers[-1]
    assert again.checked.tolist() == [1, 1]
    got = [segment.map[o : o + n] for o, n in zip(again.offsets.tolist(), again.lengths.tolist())]
    assert got == files_bytes(3, ids, SIZES)


def test_a_cached_value_found_corrupt_in_the_segment_is_served_from_the_pfs_in_its_place(
    served: DaemonProcess, tmp_path: Path
) -> None:
    ids = [6, 5, 7]  # 5 is flipped in the cache; those either side of it are not
    stage(served, "imgs")
    assert served.stop() == 0
    data_file = served.cache_dir / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    (flipped,) = files_bytes(3, [5], SIZES)
    at = raw.find(flipped[:16])
    assert at > 0
    while at >= 0:  # every copy, stale pages included
        raw[at + 10] ^= 0xFF
        at = raw.find(flipped[:16], at + 1)
    data_file.write_bytes(raw)
    served.start()
    seg = MemfdSegment(4 << 20, fd_socket_path(served.address), "")
    try:
        answer = parse_batch_reply(ask(seg, "imgs", ids), len(ids))
        assert answer.code == OK
        assert answer.tiers.tolist() == [pb.TIER_CACHE, pb.TIER_PFS, pb.TIER_CACHE]
        assert answer.checked.tolist() == [1, 0, 1]
        got = [seg.map[o : o + n] for o, n in zip(answer.offsets.tolist(), answer.lengths.tolist())]
        assert got == files_bytes(3, ids, SIZES)
        assert len(set(answer.offsets.tolist())) == len(ids)
    finally:
        seg.close()
    stage(served, "imgs")  # waits for the queued repair to commit
    assert daemon_stats(served).corrupt_repaired == 1


@pytest.mark.parametrize(
    ("dataset", "ids", "error", "code"),
    [
        ("nope", [1], UnknownDatasetError, grpc.StatusCode.NOT_FOUND),
        ("imgs", [3, 40], SampleIdError, grpc.StatusCode.INVALID_ARGUMENT),
        ("imgs", list(range(MAX_BATCH + 1)), BatchTooLargeError, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_segment_read_errors_are_those_of_a_grpc_read(
    segment: MemfdSegment, dataset: str, ids: list[int], error: type[Exception], code: grpc.StatusCode
) -> None:
    answer = parse_batch_reply(ask(segment, dataset, ids), len(ids))
    assert CODES_BY_VALUE[answer.code] == code
    raised = error_from_status(code, answer.message, answer.error)
    assert type(raised) is error and str(raised)
    assert parse_batch_reply(ask(segment, "imgs", [2]), 1).code == OK  # the connection serves on


def test_garbage_and_oversized_frames_close_the_connection_and_the_daemon_serves_on(served: DaemonProcess) -> None:
    truncated = request_frame(BatchRequest("imgs", "", "", None, np.array([1, 2], np.uint64)))[:-3]
    for frame in (b"garbage", os.urandom(REQUEST_BYTES + 100), truncated):
        seg = MemfdSegment(1 << 20, fd_socket_path(served.address), "")
        try:
            assert seg.read(frame, 10) == b"", "the daemon closes the connection"
        finally:
            seg.close()
    with dq.connect(served.address, timeout=5) as client:
        assert client.dataset("imgs").get_batch([4, 9]) == files_bytes(3, [4, 9], SIZES)
    assert served.process is not None and served.process.poll() is None


def test_without_segment_reads_a_client_reads_over_grpc(served: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_reply(b'{"segment": "memfd:x"}') == ("memfd:x", 0)  # an older daemon's handshake
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    os.unlink(fd_socket_path(served.address))  # no fd socket: /dev/shm segments
    with dq.connect(served.address, timeout=5) as client:
        ids = [39, 0, 7, 7]
        assert client.dataset("imgs").get_batch(ids) == files_bytes(3, ids, SIZES)
    stats = daemon_stats(served)
    assert stats.bulk.segment_reads == 0 and sum(r.samples for r in stats.reads) == len(ids)
