"""Misses a trainer reads from the PFS itself, cached by its daemon behind it:
right bytes, one PFS read where the page cache held the file, a later read a
local hit; a changed file an error; bytes handed over where the page cache
lost them; a client that cannot read the files served by the daemon."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from one_daemon import add, cache_stub, cached_samples, daemon_stats, files_bytes, read_locally, tiers_read
from polling import wait_until

import dataquay.client as dq
from dataquay.client import cache_behind
from dataquay.client.errors import PfsReadError
from dataquay.client.page_cache import cached_pages, read_cached
from dataquay.client.pfs import PfsReader
from dataquay.client.wire.shm import Segment
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SIZES = (3000, 70_000, 17, 250_000)


def evict(paths: list[Path]) -> None:
    """Takes the files out of the page cache (skips the test where they stay,
    as on tmpfs, whose files the daemon reads back from memory)."""
    os.sync()
    held = []
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            held.append(cached_pages(fd, 0, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    if None in held:  # no cachestat (before Linux 6.5): ask the first file by reading, which reads a page back
        fd = os.open(paths[0], os.O_RDONLY)
        try:
            held = [read_cached(fd, 0, 1) is not None]
        finally:
            os.close(fd)
    if any(held):
        pytest.skip(f"the page cache keeps the files under {paths[0].parent} (tmpfs)")


def files_dataset(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path, count: int, seed: int, sizes: tuple[int, ...] = SIZES
) -> dq.Dataset:
    """A files dataset "imgs" of ``count`` samples in ``tmp_path/imgs``, registered, as the client reads it."""
    synthetic.make_files_dataset(tmp_path / "imgs", count, sizes=sizes, seed=seed)
    add(daemon, "imgs", tmp_path / "imgs")
    return client.dataset("imgs")


def test_a_miss_read_by_the_client_is_cached_behind_it_from_the_page_cache(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    ds = files_dataset(daemon, client, tmp_path, 40, seed=3)
    ids = [39, 0, 7, 7, 12, 3, 38, 21]
    got, tiers = tiers_read(client, lambda: ds.get_batch(ids))
    assert got == files_bytes(3, ids, SIZES)
    assert tiers["pfs"] == len(ids) and tiers["cache"] == 0 and tiers["fallback"] == 0

    distinct = sorted(set(ids))
    wait_until(lambda: cached_samples(daemon, "imgs") == len(distinct), "the daemon cached what the client read")
    stats = daemon_stats(daemon)
    # One PFS read, the client's: the daemon read the files back from the page cache.
    assert stats.pfs_bytes == 0 and not any(t.samples for t in stats.reads)
    behind = stats.cache_behind
    assert behind.page_cache_samples == len(distinct) and behind.handed_samples == 0
    assert behind.page_cache_bytes == sum(len(b) for b in files_bytes(3, distinct, SIZES))

    assert read_locally(client, ds, ids) == got
    assert daemon_stats(daemon).cache_behind.page_cache_samples == len(distinct), "cached once"


def test_notices_wait_while_the_trainer_reads_and_go_when_it_pauses(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = files_dataset(daemon, client, tmp_path, 8, seed=4)
    monkeypatch.setattr(cache_behind, "DEFER_SECONDS", 60.0)
    notices = client.remote.notices
    with notices.trainer_reading():  # a read that has not returned yet
        got = ds.get_batch(np.arange(8))
        time.sleep(3 * cache_behind.LINGER_SECONDS)
        assert daemon_stats(daemon).cache_behind.page_cache_samples + cached_samples(daemon, "imgs") == 0
    wait_until(lambda: cached_samples(daemon, "imgs") == 8, "the daemon cached the samples once the trainer paused")
    assert read_locally(client, ds, range(8)) == got


def _read_and_end(ds: dq.Dataset, ids: list[int]) -> None:
    ds.get_batch(ids)


def test_the_misses_a_worker_read_are_noticed_when_it_ends(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = files_dataset(daemon, client, tmp_path, 24, seed=2)
    monkeypatch.setattr(cache_behind, "LINGER_SECONDS", 60.0)  # nothing goes out before the workers end
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_read_and_end, args=(ds, list(range(k, 24, 2)))) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    wait_until(lambda: cached_samples(daemon, "imgs") == 24, "the workers' misses were cached behind them")
    assert daemon_stats(daemon).cache_behind.page_cache_samples == 24


def test_bytes_the_page_cache_lost_are_handed_over_and_checked_against_the_manifest(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 12, sizes=SIZES, seed=5)
    info = add(daemon, "imgs", tmp_path / "imgs")
    ds = client.dataset("imgs")
    evict(sorted((tmp_path / "imgs").rglob("*.bin")))
    want = files_bytes(5, range(12), SIZES)
    with cache_stub(daemon) as stub:
        reply = stub.CacheBehind(pb.CacheBehindRequest(dataset="imgs", manifest_id=info.manifest_id, ids=[1, 2]))
    assert reply.queued == 0 and sorted(reply.not_in_page_cache) == [1, 2]

    seg = Segment(1 << 20)
    try:
        seg.map[0 : len(want[1])] = want[1]
        seg.map[100_000 : 100_000 + len(want[2])] = want[2]
        handed = [
            pb.Sample(id=1, shm_offset=0, length=len(want[1])),
            pb.Sample(id=2, shm_offset=100_000, length=len(want[2]) - 1),  # not the manifest's length
        ]
        request = pb.CacheBehindRequest(
            dataset="imgs", manifest_id=info.manifest_id, shm_name=seg.name, shm_size=seg.size, handed=handed
        )
        with cache_stub(daemon) as stub:
            assert stub.CacheBehind(request).queued == 1
    finally:
        seg.close()
    wait_until(lambda: cached_samples(daemon, "imgs") == 1, "the daemon cached the handed sample")
    behind = daemon_stats(daemon).cache_behind
    assert (behind.handed_samples, behind.refused_samples, behind.not_in_page_cache) == (1, 1, 2)
    assert read_locally(client, ds, [1]) == [want[1]]


def test_once_the_page_cache_lost_samples_the_client_holds_their_payloads_and_hands_them_over(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    ds = files_dataset(daemon, client, tmp_path, 16, seed=6)
    first, second = np.arange(8), np.arange(8, 16)
    got = PfsReader(ds.manifest, "imgs").read(np.arange(16))
    evict(sorted((tmp_path / "imgs").rglob("*.bin")))  # between the client's read and the daemon's
    notices = client.remote.notices
    notices.note("imgs", ds.manifest.manifest_id, first, got[:8])
    assert notices.flush()
    lost = notices.dropped
    assert lost > 0  # not held: nothing told the client yet that the page cache loses this dataset's files

    notices.note("imgs", ds.manifest.manifest_id, second, got[8:])
    assert notices.flush() and notices.dropped == lost  # held this time, and handed over
    wait_until(lambda: cached_samples(daemon, "imgs") == 16 - lost, "the daemon cached the handed samples")
    behind = daemon_stats(daemon).cache_behind
    assert behind.handed_samples + behind.page_cache_samples == 16 - lost and behind.handed_samples > 0
    lost_mask = notices.take_lost("imgs", ds.manifest.manifest_id, first)
    assert lost_mask is not None and int(lost_mask.sum()) == lost
    cached = np.concatenate([first[~lost_mask], second])
    assert read_locally(client, ds, cached) == [got[i] for i in cached.tolist()]


def test_a_sample_whose_notice_was_lost_is_read_through_the_daemon_next_and_cached(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = files_dataset(daemon, client, tmp_path, 16, seed=10)
    ids = np.arange(16)
    got = PfsReader(ds.manifest, "imgs").read(ids)
    evict(sorted((tmp_path / "imgs").rglob("*.bin")))
    monkeypatch.setattr(cache_behind, "HELD_BYTES", 0)  # nothing to hand over
    notices = client.remote.notices
    notices.note("imgs", ds.manifest.manifest_id, ids, got)
    assert notices.flush()
    lost = notices.dropped
    assert lost > 0
    wait_until(lambda: cached_samples(daemon, "imgs") == 16 - lost, "the daemon cached what it could read back")

    again, tiers = tiers_read(client, lambda: ds.get_batch(ids))
    assert again == got and tiers["pfs"] + tiers["local"] == 16
    daemon_reads = {t.tier: t.samples for t in daemon_stats(daemon).reads}
    assert daemon_reads.get(pb.TIER_PFS, 0) == lost  # the lost ones only, which the daemon caches
    assert read_locally(client, ds, ids) == got


def test_a_file_changed_under_the_reader_is_an_error(daemon: DaemonProcess, client: dq.Client, tmp_path: Path) -> None:
    ds = files_dataset(daemon, client, tmp_path, 8, seed=7, sizes=(1000,))
    changed = tmp_path / "imgs" / ds.manifest.location(5).path
    changed.write_bytes(b"x" * 1000)
    os.utime(changed, ns=(1, 1))
    assert ds.get_batch([1, 2]) == files_bytes(7, [1, 2], (1000,))
    with pytest.raises(PfsReadError, match="changed since the dataset was registered"):
        ds.get_batch([4, 5])
    client.remote.notices.flush()
    wait_until(lambda: cached_samples(daemon, "imgs") == 2, "the daemon cached the unchanged samples")
    assert daemon_stats(daemon).cache_behind.refused_samples == 0
    # Changed between a trainer's read and the daemon's: refused, not cached.
    with cache_stub(daemon) as stub:
        reply = stub.CacheBehind(pb.CacheBehindRequest(dataset="imgs", manifest_id=ds.manifest.manifest_id, ids=[5]))
    assert reply.queued == 0 and daemon_stats(daemon).cache_behind.refused_samples == 1
    assert cached_samples(daemon, "imgs") == 2


_NO_PFS_READER = """
import sys
import dataquay.client as dq
with dq.connect(sys.argv[1], timeout=5) as client:
    ds = client.dataset("imgs")
    got = ds.get_batch([3, 1, 3])
    again = ds.get_batch([2])
    stats = client.stats().samples
print(got == [open(p, "rb").read() for p in sys.argv[2:]] and len(again[0]) > 0, stats["pfs"], stats["fallback"])
"""


def test_a_client_that_cannot_read_the_files_gets_its_misses_from_the_daemon(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    root = synthetic.make_files_dataset(tmp_path / "imgs", 8, sizes=(2000,), seed=8)
    add(daemon, "imgs", root)
    with dq.connect(daemon.address, timeout=5) as c:
        paths = [str(root / c.dataset("imgs").manifest.location(i).path) for i in (3, 1, 3)]
    copies = []
    for i, path in enumerate(paths):  # the bytes to compare with, where the client can see them
        copy = tmp_path / f"want-{i}"
        copy.write_bytes(Path(path).read_bytes())
        copies.append(str(copy))
    script = tmp_path / "reader.py"
    script.write_text(_NO_PFS_READER)
    # The client runs where the dataset's root is an empty file system: it reads no file of it.
    hidden = f"mount -t tmpfs none {root} && exec {sys.executable} {script} {daemon.address} {' '.join(copies)}"
    done = subprocess.run(["unshare", "--mount", "sh", "-c", hidden], capture_output=True, text=True, timeout=60)
    if done.returncode and "unshare failed" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "4", "0"], done.stdout + done.stderr
    stats = daemon_stats(daemon)
    assert {t.tier: t.samples for t in stats.reads}[pb.TIER_PFS] == 4  # every read: the daemon's


def npy_records(root: Path, ids: list[int], per_file: int) -> list[bytes]:
    """The bytes of records ``ids`` of a make_npy_dataset of ``per_file`` records per file."""
    return [np.load(root / f"part_{i // per_file:05d}.npy")[i % per_file].tobytes() for i in ids]


def test_a_batch_of_misses_only_gets_its_bytes_in_order_and_is_cached_behind(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    # Records of 80 KB, 12 a file: a batch reads several ranges of one file.
    root = synthetic.make_npy_dataset(tmp_path / "frames", 24, record_shape=(20_000,), files=2, seed=11)
    add(daemon, "frames", root)
    ds = client.dataset("frames")
    ids = [20, 2, 5, 2, 13, 0, 22, 11, 12]
    got, tiers = tiers_read(client, lambda: ds.get_batch(ids))
    assert got == npy_records(root, ids, 12)
    assert tiers["pfs"] == len(ids) and tiers["local"] == 0 and tiers["cache"] == 0

    distinct = sorted(set(ids))
    client.remote.notices.flush()
    wait_until(lambda: cached_samples(daemon, "frames") == len(distinct), "the daemon cached the batch")
    stats = daemon_stats(daemon)
    assert stats.pfs_bytes == 0 and stats.cache_behind.page_cache_samples == len(distinct)
    assert read_locally(client, ds, ids) == got


def test_a_file_changed_under_the_reader_fails_a_batch_of_misses_and_none_of_it_is_cached(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    root = synthetic.make_npy_dataset(tmp_path / "frames", 24, record_shape=(20_000,), files=2, seed=12)
    add(daemon, "frames", root)
    ds = client.dataset("frames")
    changed = root / "part_00001.npy"
    stat = changed.stat()
    with open(changed, "r+b") as f:  # same size, other bytes
        f.seek(stat.st_size - 100)
        f.write(b"\xff" * 100)
    with pytest.raises(PfsReadError, match="changed since the dataset was registered"):
        ds.get_batch([3, 23, 1, 12])
    with open(changed, "r+b") as f:
        f.truncate(stat.st_size - 100)
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as registered, but shorter
    with pytest.raises(PfsReadError, match="changed since the dataset was registered"):
        ds.get_batch([23, 0])

    assert ds.get_batch([4, 1]) == npy_records(root, [4, 1], 12)
    client.remote.notices.flush()
    wait_until(lambda: cached_samples(daemon, "frames") == 2, "the daemon cached the unchanged file's records")
    assert daemon_stats(daemon).cache_behind.page_cache_samples == 2
