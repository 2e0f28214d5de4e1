"""The daemon's PFS readers on real files: a prefetch that skips what the
PFS refuses, a staging stream that stops reading once it is left, and reads
back from the page cache for caching behind, at idle priority."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from dataquay.client.manifest import Manifest
from dataquay.client.pfs import plan_reads
from dataquay.client.wire.records import decode_value
from dataquay.server.manifest_build import build_manifest
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

SIZE = 1000


def files(root: Path, count: int) -> Manifest:
    make_files_dataset(root, count, sizes=(SIZE,), classes=1)
    return Manifest(build_manifest(root, "files").to_bytes())


def test_a_prefetch_leaves_out_and_names_a_file_changed_since_its_manifest(tmp_path: Path) -> None:
    manifest = files(tmp_path, 8)
    next(tmp_path.glob("*/00000003.bin")).write_bytes(bytes(SIZE))
    pool = PfsPool(threads=2)
    try:
        values, failures = asyncio.run(pool.read_available("ds", manifest, np.arange(8)))
    finally:
        pool.close()
    assert sorted(values) == [0, 1, 2, 4, 5, 6, 7]
    assert all(decode_value(values[i]) == sample_bytes(0, i, SIZE) for i in values)
    assert len(failures) == 1 and "sample 3 of 'ds'" in failures[0] and "changed since" in failures[0]


def test_a_staging_stream_left_early_reads_no_further(tmp_path: Path) -> None:
    manifest = files(tmp_path, 128)
    ranges = plan_reads(manifest, np.arange(128))
    # One thread, and a range every 10 ms: the stream's second job (of 32
    # ranges, like the first) is queued or has just begun when it is left.
    pool = PfsPool(threads=1, bandwidth=100 * SIZE)

    async def run() -> int:
        stream = pool.stream("ds", manifest, ranges, backlog=lambda: 0.0)
        first = (await anext(stream)).values
        await stream.aclose()
        # The one thread takes jobs in order: once this one is read, the left one is done too.
        async for _ in pool.stream("ds", manifest, ranges[:1], backlog=lambda: 0.0):
            pass
        return len(first)

    try:
        consumed = asyncio.run(run())
    finally:
        pool.close()
    assert consumed == 32
    assert pool.bytes_read - (consumed + 1) * SIZE < 16 * SIZE  # not the 32 ranges of the job left behind


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE here")
def test_samples_cached_behind_are_read_back_in_threads_at_idle_priority(tmp_path: Path) -> None:
    manifest = files(tmp_path, 4)
    pool = PfsPool(threads=2)
    try:
        values, not_cached, refused = asyncio.run(pool.read_cached("ds", manifest, np.arange(4)))
        policy = pool.behind.submit(lambda: os.sched_getscheduler(threading.get_native_id())).result(timeout=10)
    finally:
        pool.close()
    assert policy == os.SCHED_IDLE
    assert not refused and sorted([*values, *not_cached]) == [0, 1, 2, 3]
    assert all(decode_value(values[i]) == sample_bytes(0, i, SIZE) for i in values)


def test_two_readers_of_the_same_samples_read_each_once_and_each_keeps_what_it_read(tmp_path: Path) -> None:
    """A trainer's read and the healer's fetch of one lost share: whoever
    claims a sample reads it, the other waits for its bytes."""
    manifest = files(tmp_path, 64)
    pool = PfsPool(threads=2, bandwidth=64 * SIZE)  # about a second: the two overlap
    kept: list[set[int]] = [set(), set()]

    async def run() -> list[tuple[dict[int, bytes], dict[int, bytes]]]:
        async def reader(which: int, ids: np.ndarray) -> tuple[dict[int, bytes], dict[int, bytes]]:
            async def keep(values: dict[int, bytes]) -> None:
                kept[which] |= set(values)

            return await pool.read_once("ds", "db", manifest, ids, keep)

        return await asyncio.gather(reader(0, np.arange(0, 48)), reader(1, np.arange(16, 64)))

    try:
        (mine_a, theirs_a), (mine_b, theirs_b) = asyncio.run(run())
        read = pool.bytes_read
    finally:
        pool.close()
    assert read == 64 * SIZE  # each sample once, though 32 were asked for twice
    assert set(mine_a) | set(theirs_a) == set(range(48)) and set(mine_b) | set(theirs_b) == set(range(16, 64))
    assert not set(mine_a) & set(mine_b) and kept == [set(mine_a), set(mine_b)]
    for got in (mine_a, theirs_a, mine_b, theirs_b):
        assert all(decode_value(got[i]) == sample_bytes(0, i, SIZE) for i in got)
