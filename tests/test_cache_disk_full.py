"""The cache's file system fills up before its map does: a real tmpfs, smaller
than --cache-size, under a real daemon."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import lmdb
import pytest
from test_daemon import add, make_files, read, run_cli, stats, stub_for

from dataquay.client.wire.records import encode_value
from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import CacheWriterError
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.tools.processes import DaemonProcess

SAMPLES = 80
FILLER = 1 << 20


@pytest.fixture
def small_cache_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs where the daemon "node0" keeps its cache, unmounted after the test."""
    cache = tmp_path / "node0" / "cache"
    cache.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(cache)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    yield cache
    subprocess.run(["umount", "-l", str(cache)], check=True)


def metric(daemon: DaemonProcess, name: str) -> float:
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE)[1])  # type: ignore[index]


def test_a_full_cache_file_system_is_full_not_a_dead_writer_and_inserts_resume_when_space_returns(
    small_cache_fs: Path, start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    filler = small_cache_fs / "filler"
    filler.write_bytes(b"\0" * FILLER)
    root = tmp_path / "pfs" / "big"
    payloads = make_files(root, SAMPLES, size=100_000)
    daemon = start_daemon("--cache-size", "64M")
    stub = stub_for(daemon)
    add(stub, root, "big")
    env = {"DATAQUAY_ADDR": daemon.address}

    staged = run_cli("stage", "big", "--quiet", env=env)
    assert staged.returncode == 1
    [line] = staged.stderr.strip().splitlines()
    fit = int(re.search(rf"is full: (\d+)/{SAMPLES} samples", line)[1])  # type: ignore[index]
    assert 0 < fit < SAMPLES

    assert daemon.process is not None and daemon.process.poll() is None
    s = stats(stub)
    assert s.cache_full and s.cache_disk_full and s.cache_entries == fit
    assert "no space left" in run_cli("status", env=env).stdout
    assert metric(daemon, "dataquay_cache_full") == metric(daemon, "dataquay_cache_disk_full") == 1
    samples = read(stub, "big", list(range(SAMPLES)))
    assert [x.data for x in samples] == payloads
    tiers = [x.tier for x in samples]
    assert (tiers.count(pb.TIER_CACHE), tiers.count(pb.TIER_PFS)) == (fit, SAMPLES - fit)

    filler.unlink()
    deadline = time.monotonic() + 30
    while stats(stub).cache_entries == fit:
        assert time.monotonic() < deadline, "no insert after space came back"
        assert [x.data for x in read(stub, "big", list(range(SAMPLES)))] == payloads
    assert daemon.process.poll() is None

    dropped = run_cli("dataset", "drop", "big", env=env)
    assert dropped.returncode == 0, dropped.stderr
    assert not stats(stub).cache_full
    add(stub, root, "big")
    again = run_cli("stage", "big", "--quiet", env=env)
    assert again.returncode == 1 and "is full" in again.stderr
    refit = int(re.search(rf"is full: (\d+)/{SAMPLES} samples", again.stderr)[1])  # type: ignore[index]
    assert refit > fit
    assert [x.data for x in read(stub, "big", list(range(SAMPLES)))] == payloads


def _writes(count: int) -> list[PendingWrite]:
    return [PendingWrite(b"ds", i, encode_value(bytes([i]) * 1000)) for i in range(count)]


def test_a_commit_failing_for_another_reason_is_dropped_and_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = Store(tmp_path / "cache", 64 << 20)
        store.open()
        await store.open_dataset("ds")
        writer = asyncio.get_running_loop().create_task(store.run_writer())
        commit = store.writer._commit

        def failing(batch: Iterable[PendingWrite]) -> None:
            raise lmdb.Error("mdb_txn_commit: Input/output error")

        store.writer._commit = failing  # type: ignore[method-assign]
        await asyncio.wait_for(store.committed(await store.put_all(_writes(10))), 10)
        await asyncio.wait_for(store.flush(), 10)
        assert (store.write_errors, store.inserts_dropped, store.unstored_writes, store.full) == (1, 10, 10, False)
        assert "Input/output error" in store.last_write_error
        store.writer._commit = commit  # type: ignore[method-assign]
        await asyncio.wait_for(store.committed(await store.put_all(_writes(10))), 10)
        assert store.usage()[1] == 10 and not writer.done()
        assert store.unstored_writes == 10
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        store.close()

    asyncio.run(scenario())


def test_what_waits_on_a_writer_that_stopped_fails_instead_of_waiting_forever(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = Store(tmp_path / "cache", 64 << 20)
        store.open()
        await store.open_dataset("ds")
        writer = asyncio.get_running_loop().create_task(store.run_writer())
        await asyncio.sleep(0)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        assert not store.offer(_writes(1)[0])
        with pytest.raises(CacheWriterError, match="has stopped"):
            await asyncio.wait_for(store.put(_writes(1)[0]), 10)
        store.close()

    asyncio.run(scenario())
