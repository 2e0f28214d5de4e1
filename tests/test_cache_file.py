"""The cache file is allocated ahead of LMDB's writes through its map: real
file systems (a small tmpfs, a ramfs that cannot allocate ahead), real LMDB."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from store_runs import with_store

from dataquay.client.wire.records import encode_value
from dataquay.server.node.cache.file import (
    ALLOCATED_INITIAL_MAP,
    COPY_ON_WRITE,
    DATA_FILE,
    Allocation,
    file_system_type,
    grown_size,
    writes_through_map,
)
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite

MiB = 1 << 20
SAMPLES = 80
VALUE = 100_000


def mounted(path: Path, kind: str, *options: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", kind, *options, kind, str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a {kind}: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (which allocates ahead), unmounted after the test."""
    yield from mounted(tmp_path / "tmpfs", "tmpfs", "-o", "size=4m")


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs: fallocate answers EOPNOTSUPP there."""
    yield from mounted(tmp_path / "ramfs", "ramfs")


def allocated_whole(path: Path) -> bool:
    st = os.stat(path)
    return st.st_blocks * 512 >= st.st_size


async def fill(store: Store, first: int) -> np.ndarray:
    """Offers SAMPLES values from ``first`` on; returns which the cache took."""
    ids = np.arange(first, first + SAMPLES)
    writes = (PendingWrite(b"ds", int(i), encode_value(bytes([int(i) % 251]) * VALUE)) for i in ids)
    await store.committed(await store.put_all(writes))
    return store.cached_mask("ds", ids)


def test_the_map_is_allocated_ahead_and_what_is_allocated_is_not_counted_as_cached(tmp_path: Path) -> None:
    async def test(store: Store) -> None:
        data = store.path / DATA_FILE
        assert store.writemap and store.env.info()["map_size"] == data.stat().st_size == ALLOCATED_INITIAL_MAP
        assert allocated_whole(data)
        assert store.usage() == (store.space.live_bytes, 0) and store.space.live_bytes < MiB
        assert (await fill(store, 0)).all()
        assert store.usage()[1] == SAMPLES and store.space.live_bytes < SAMPLES * VALUE * 1.1
        assert store.get_values("ds", [3])[0] == encode_value(bytes([3]) * VALUE)

    with_store(tmp_path / "cache", 1 << 30, test)


def test_writemap_only_over_a_file_allocated_ahead_whose_blocks_take_their_overwrites(tmp_path: Path) -> None:
    here = file_system_type(tmp_path)
    assert here and writes_through_map(Allocation.DONE, here) == (here not in COPY_ON_WRITE)
    btrfs = next(magic for magic, name in COPY_ON_WRITE.items() if name == "btrfs")
    assert not writes_through_map(Allocation.DONE, btrfs)
    assert not writes_through_map(Allocation.UNSUPPORTED, here)
    assert not writes_through_map(Allocation.NO_SPACE, here)


def test_the_map_doubles_up_to_its_limit_and_grows_no_further_than_the_room_allocated() -> None:
    assert grown_size(64 * MiB, 1 << 30, None) == grown_size(64 * MiB, 1 << 30, 1 << 30) == 128 * MiB
    assert grown_size(64 * MiB, 100 * MiB, None) == 100 * MiB
    assert grown_size(64 * MiB, 1 << 30, 3 * MiB) == 67 * MiB
    assert grown_size(64 * MiB, 1 << 30, 0) == 64 * MiB


def test_a_file_system_without_fallocate_gets_a_store_that_writes_without_writemap(ramfs: Path) -> None:
    async def test(store: Store) -> None:
        assert not store.writemap
        assert (await fill(store, 0)).all()
        assert store.get_values("ds", [5])[0] == encode_value(bytes([5]) * VALUE)

    with_store(ramfs / "cache", 64 * MiB, test)


def test_a_file_system_that_fills_stops_the_map_where_it_was_allocated_and_the_store_is_disk_full(
    small_fs: Path,
) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * MiB)

    async def test(store: Store) -> None:
        data = store.path / DATA_FILE
        assert store.writemap
        fit = int((await fill(store, 0)).sum())
        assert 0 < fit < SAMPLES
        assert store.full and store.disk_full
        # The map never reaches past what the file system gave the file.
        assert store.env.info()["map_size"] == data.stat().st_size and allocated_whole(data)

        filler.unlink()
        store.recheck_space()
        more = int((await fill(store, 1000)).sum())
        assert more > 0 and store.usage()[1] == fit + more
        assert store.env.info()["map_size"] == data.stat().st_size and allocated_whole(data)

    with_store(small_fs / "cache", 64 * MiB, test)


_READ_WHILE_GROWING = """
import asyncio, sys, threading, time
from dataquay.client.wire.records import encode_value
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite

VALUE = 100_000
reads, stop, wrong = 0, threading.Event(), []

def read_views(store):
    global reads
    while not stop.is_set():
        with store.value_views("ds") as get:
            value = get(0)
            time.sleep(0.0005)  # a send out of the map takes a while
            if value is None or bytes(value) != encode_value(bytes([0]) * VALUE):
                wrong.append(reads)
        reads += 1

async def main():
    store = Store(sys.argv[1], 1 << 30)
    store.open()
    await store.open_dataset("ds")
    tasks = [asyncio.get_running_loop().create_task(store.run_writer())]
    if sys.argv[2:] == ["syncing"]:  # a sync every moment, beside the commits and across the growths
        tasks.append(asyncio.get_running_loop().create_task(store.run_syncer(0.001)))
    await store.committed(await store.put_all([PendingWrite(b"ds", 0, encode_value(bytes([0]) * VALUE))]))
    maps = {store.env.info()["map_size"]}
    reader = threading.Thread(target=read_views, args=(store,))
    reader.start()
    for first in range(1, 1200, 40):
        writes = [PendingWrite(b"ds", i, encode_value(bytes([i % 251]) * VALUE)) for i in range(first, first + 40)]
        await store.committed(await store.put_all(writes))
        maps.add(store.env.info()["map_size"])
    stop.set()
    reader.join()
    for task in tasks:
        task.cancel()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    wrong.extend(e for e in ended if not isinstance(e, asyncio.CancelledError))  # a failed sync, say
    last = store.get_values("ds", [1199])[0]
    if last != encode_value(bytes([1199 % 251]) * VALUE):
        wrong.append("last")
    store.close()
    print(len(maps) - 1, reads, len(wrong))

asyncio.run(main())
"""


@pytest.mark.parametrize("syncing", [False, True], ids=["", "syncing"])
def test_a_thread_reading_views_of_the_map_survives_its_growth(tmp_path: Path, syncing: bool) -> None:
    """The bulk path's threads send values straight out of the map, and the
    syncer flushes it beside the writer; the map moves when it grows. Run
    apart: reading a moved map kills the process."""
    done = subprocess.run(
        [sys.executable, "-c", _READ_WHILE_GROWING, str(tmp_path / "cache"), *(["syncing"] if syncing else [])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grew, reads, wrong = map(int, done.stdout.split())
    assert grew >= 3 and reads > 0 and wrong == 0, done.stdout
