"""The client's read-only view of the daemon's LMDB: real environments, a writer
in another process (as the daemon is), real forks."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dataquay.client import local
from dataquay.client.errors import DataquayError, SampleIdError
from dataquay.client.local import LocalCache, sample_keys
from dataquay.client.wire.records import checksum, encode_value, sample_key

DB = "ds:test"

# The daemon is the only writer and lives in another process; py-lmdb also
# refuses a second open of one environment in a process. So writes run here.
_WRITER = """
import pickle, sys
import lmdb
path, db, map_size = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
values = pickle.load(sys.stdin.buffer)
env = lmdb.open(path, map_size=map_size, max_dbs=8)
handle = env.open_db(db)
with env.begin(write=True, db=handle) as txn:
    for sample_id, value in values.items():
        txn.put(sample_id.to_bytes(8, "big"), value)
env.close()
"""


def payload(sample_id: int, size: int = 4096) -> bytes:
    return (sample_id.to_bytes(8, "little") * (size // 8 + 1))[:size]


def write(path: Path, values: dict[int, bytes], db: str = DB, map_size: int = 1 << 20) -> None:
    """Commits raw LMDB values (already framed) from a separate writer process."""
    subprocess.run(
        [sys.executable, "-c", _WRITER, str(path), db, str(map_size)],
        input=pickle.dumps(values),
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def stage(path: Path, ids: range, size: int = 4096, db: str = DB, map_size: int = 1 << 20) -> None:
    write(path, {i: encode_value(payload(i, size)) for i in ids}, db, map_size)


@pytest.fixture
def env_path(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    stage(path, range(100))
    return path


def test_sample_keys_match_the_record_format_and_reject_bad_ids() -> None:
    ids = [0, 1, 255, 256, 2**40]
    assert sample_keys(ids) == [sample_key(i) for i in ids]
    assert sample_keys(np.array(ids, dtype=np.uint64)) == [sample_key(i) for i in ids]
    assert sample_keys(np.array([], dtype=np.float64)) == []
    with pytest.raises(SampleIdError, match="-3"):
        sample_keys(np.array([1, -3]))
    with pytest.raises(TypeError):
        sample_keys(np.array([1.5]))


@pytest.mark.parametrize("module", ["_records", "_records_py"], ids=["c", "python"])
def test_the_read_loops_check_and_copy_as_records_lays_values_out(module: str) -> None:
    loops = pytest.importorskip(f"dataquay.client.wire.{module}", reason="installed without a C compiler")
    big = payload(3, 300_000)  # large enough to be hashed without the GIL
    for framed in (b"", b"x", payload(1), big):  # the vendored xxHash agrees with the xxhash package
        assert loops.encode_value(framed) == checksum(framed).to_bytes(8, "little") + framed
    assert loops.encode_value(memoryview(big), 7) == (7).to_bytes(8, "little") + big
    with pytest.raises(OverflowError):
        loops.encode_value(b"x", 2**64)
    flipped = bytearray(encode_value(payload(2)))
    flipped[-1] ^= 0x80
    values = [
        encode_value(payload(1)),
        None,
        bytes(flipped),
        b"short",
        encode_value(b""),
        memoryview(encode_value(big)),
    ]
    copies, absent, corrupt = loops.payload_copies(values, True)
    assert copies == [payload(1), None, None, None, b"", big]
    assert (absent, corrupt) == (1, 2)
    unchecked, _, corrupt = loops.payload_copies(values, False)
    assert unchecked[2] == bytes(flipped)[8:] and unchecked[3] is None and corrupt == 1
    with pytest.raises(TypeError):
        loops.payload_copies([1], True)
    assert loops.values_intact([v for v in values if v is not None]) == [True, False, False, True, True]
    assert loops.values_intact([]) == []
    with pytest.raises(TypeError):
        loops.values_intact([1])
    assert loops.sample_keys([np.int64(7), True, 2**64 - 1]) == [sample_key(7), sample_key(1), b"\xff" * 8]
    for bad in (2**64, -1):
        with pytest.raises(OverflowError):
            loops.sample_keys([bad])
    with pytest.raises(TypeError):
        loops.sample_keys([1.5])


@pytest.mark.parametrize("module", ["_records", "_records_py"], ids=["c", "python"])
def test_payloads_into_copies_each_payload_to_its_offset_and_checks_it_there(module: str) -> None:
    loops = pytest.importorskip(f"dataquay.client.wire.{module}", reason="installed without a C compiler")
    big = payload(3, 300_000)  # the batch is large enough to be copied without the GIL
    flipped = bytearray(encode_value(payload(2)))
    flipped[-1] ^= 0x80
    values = [encode_value(payload(1)), bytes(flipped), b"short", encode_value(b""), memoryview(encode_value(big))]
    target = mmap.mmap(-1, 400_000)
    offsets = [0, 4096, 8192, 8192, 12288]
    assert loops.payloads_into(values, target, offsets) == [True, False, False, True, True]
    assert target[: len(payload(1))] == payload(1)
    assert target[12288 : 12288 + len(big)] == big
    assert target[4096 : 4096 + len(payload(2))] == bytes(flipped)[8:]  # copied, and found corrupt there
    assert loops.payloads_into([], target, []) == []
    with pytest.raises(ValueError, match="ends past the target"):
        loops.payloads_into([encode_value(big)], target, [200_000])
    with pytest.raises(ValueError, match="2 values but 1 offsets"):
        loops.payloads_into(values[:2], target, [0])
    with pytest.raises(BufferError):
        loops.payloads_into(values[:1], b"read-only", [0])
    target.close()
    with pytest.raises(ValueError):
        loops.payloads_into(values[:1], target, [0])


def test_get_many_returns_payloads_in_request_order_with_none_for_misses(env_path: Path) -> None:
    with LocalCache(env_path) as cache:
        ids = np.array([5, 99, 100, 5, 0, 12345])
        expected = [payload(5), payload(99), None, payload(5), payload(0), None]
        assert cache.get_many(DB, ids) == expected
        assert cache.get_many(DB, ids.tolist()) == expected
        assert cache.get_many(DB, sample_keys(ids)) == expected
        assert cache.get_many(DB, []) == []
        assert cache.get_many("ds:other", ids) == [None] * len(ids)


def test_verify_turns_a_flipped_byte_into_a_counted_miss(env_path: Path) -> None:
    flipped = bytearray(encode_value(payload(7)))
    flipped[100] ^= 0x01
    write(env_path, {7: bytes(flipped), 8: b"abc"})
    with LocalCache(env_path) as cache:
        assert cache.get_many(DB, [6, 7, 8]) == [payload(6), None, None]
        assert cache.corrupt == 2
        with cache.views(DB, [7, 6]) as views:
            assert views[0] is None and views[1] is not None and bytes(views[1]) == payload(6)
        assert cache.corrupt == 3
        unchecked = cache.get_many(DB, [7], verify=False)[0]
        assert unchecked is not None and unchecked != payload(7) and len(unchecked) == len(payload(7))


def test_views_share_the_map_and_are_released_when_the_block_ends(env_path: Path) -> None:
    with LocalCache(env_path) as cache:
        with cache.views(DB, [3, 1000, 4]) as views:
            assert [None if v is None else bytes(v) for v in views] == [payload(3), None, payload(4)]
            assert all(v is None or v.readonly for v in views)
            kept = views[0]
        assert kept is not None
        with pytest.raises(ValueError, match="released"):
            bytes(kept)


def test_missing_sub_db_is_a_miss_until_the_daemon_creates_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cache's clock stands still unless moved: staging may take any time.
    now = [0.0]
    monkeypatch.setattr(local, "time", SimpleNamespace(monotonic=lambda: now[0]))
    path = tmp_path / "cache"
    stage(path, range(3), db="ds:other")
    with LocalCache(path) as cache:
        assert cache.get_many(DB, [0, 1]) == [None, None]
        stage(path, range(3))
        now[0] = local.DB_RETRY_SECONDS * 0.99
        assert cache.get_many(DB, [0, 1]) == [None, None]  # not looked up again before the retry interval
        now[0] = local.DB_RETRY_SECONDS
        assert cache.get_many(DB, [0, 1, 2]) == [payload(0), payload(1), payload(2)]


def test_map_grown_by_the_writer_after_open_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    stage(path, range(4), size=1000)
    with LocalCache(path) as cache:
        assert cache.get_many(DB, [3]) == [payload(3, 1000)]
        # 12 MiB more: beyond the map this reader opened with (10 MiB at most).
        stage(path, range(1000, 1400), size=32 << 10, map_size=64 << 20)
        assert (path / "data.mdb").stat().st_size > 10 << 20
        got = cache.get_many(DB, np.arange(1000, 1400))
        assert got == [payload(i, 32 << 10) for i in range(1000, 1400)]
        with cache.views(DB, [1399, 3]) as views:
            assert [bytes(v) for v in views if v is not None] == [payload(1399, 32 << 10), payload(3, 1000)]


def test_unopenable_environment_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataquayError, match=str(tmp_path / "nowhere")):
        LocalCache(tmp_path / "nowhere")


def test_closed_cache_refuses_reads(env_path: Path) -> None:
    cache = LocalCache(env_path)
    cache.close()
    with pytest.raises(DataquayError, match="closed"):
        cache.get_many(DB, [1])


def _child_reads(cache: LocalCache, ids: list[int], result: multiprocessing.Queue) -> None:
    result.put((cache.get_many(DB, ids), cache.available))


def test_forked_children_reopen_the_cache_and_the_parent_keeps_reading(env_path: Path) -> None:
    with LocalCache(env_path) as cache:
        assert cache.get_many(DB, [1]) == [payload(1)]
        pid = os.fork()
        if pid == 0:
            try:
                ok = cache.get_many(DB, [2, 3]) == [payload(2), payload(3)] and cache.available
            finally:
                os._exit(0 if ok else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert cache.get_many(DB, [4]) == [payload(4)]

        ctx = multiprocessing.get_context("fork")
        result: multiprocessing.Queue = ctx.Queue()
        children = [ctx.Process(target=_child_reads, args=(cache, [i, 50], result)) for i in range(3)]
        for child in children:
            child.start()
        got = sorted((result.get(timeout=30) for _ in children), key=lambda r: r[0][0])
        for child in children:
            child.join(30)
            assert child.exitcode == 0
        assert got == [([payload(i), payload(50)], True) for i in range(3)]
        assert cache.get_many(DB, [5]) == [payload(5)]


def test_fork_inside_a_views_block_leaves_the_child_without_the_local_tier(env_path: Path) -> None:
    with LocalCache(env_path) as cache:
        with cache.views(DB, [9]) as views:
            pid = os.fork()
            if pid == 0:
                try:
                    ok = cache.get_many(DB, [9]) == [None] and not cache.available
                finally:
                    os._exit(0 if ok else 1)
            assert os.waitpid(pid, 0)[1] == 0
            assert views[0] is not None and bytes(views[0]) == payload(9)
        assert cache.get_many(DB, [9]) == [payload(9)]
        assert cache.available


def test_fork_waits_for_reads_on_other_threads(env_path: Path) -> None:
    errors: list[Exception] = []
    stop = threading.Event()
    with LocalCache(env_path) as cache:

        def reader() -> None:
            try:
                while not stop.is_set():
                    assert cache.get_many(DB, np.arange(100)) == [payload(i) for i in range(100)]
            except Exception as exc:  # reported by the test below
                errors.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for _ in range(10):
                pid = os.fork()
                if pid == 0:
                    try:
                        ok = cache.get_many(DB, [42]) == [payload(42)] and cache.available
                    finally:
                        os._exit(0 if ok else 1)
                assert os.waitpid(pid, 0)[1] == 0
        finally:
            stop.set()
            thread.join()
        assert not errors
