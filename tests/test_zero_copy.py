"""Samples handed over without a copy (``get_batch(..., copy=False)``)
against a real daemon: views into the shared memory segment the daemon
wrote them into, bytes exact, read only, and never written over by a
later read while they are held."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from one_daemon import add, files_bytes, stage

import dataquay.client as dq
from dataquay.client.wire.memfd import fd_socket_path
from dataquay.client.wire.shm import MAX_LENT_SEGMENTS
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SIZES = (3000, 70_000, 17, 250_000)
SAMPLES = 40


@pytest.fixture
def served(daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DaemonProcess:
    """The daemon with 'imgs' (40 samples of SIZES, none cached); every miss read through it."""
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, sizes=SIZES, seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    return daemon


@contextmanager
def through_daemon(daemon: DaemonProcess) -> Iterator[dq.Client]:
    """A client that reads every sample through the daemon: its in-process
    cache reads off, or samples the daemon cached meanwhile come as local hits."""
    with dq.connect(daemon.address, timeout=5) as client:
        client.local_cache.release()
        yield client


def mapping_of(view: memoryview) -> str:
    """What /proc/self/maps names the mapping ``view``'s first byte lies in ("" for anonymous memory)."""
    address = np.frombuffer(view, np.uint8).ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5) if len(line.split()) > 5 else [*line.split(), ""]
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            return name
    raise AssertionError(f"address {address:#x} is in no mapping")


def segment_mappings() -> set[str]:
    """The address ranges of the shared memory segments this process has mapped."""
    return {line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines() if "dataquay-" in line}


def check_views(views: list[memoryview], ids: list[int], where: str) -> None:
    assert [bytes(view) for view in views] == files_bytes(3, ids, SIZES)
    for view in views:
        assert isinstance(view, memoryview) and view.readonly and where in mapping_of(view)
        assert not np.frombuffer(view, np.uint8).flags.writeable


def test_the_daemon_s_payloads_are_views_into_the_memfd_segment_it_wrote_them_into(served: DaemonProcess) -> None:
    with through_daemon(served) as client:
        ds = client.dataset("imgs")
        ids = [39, 0, 7, 7, 12, 3, 38]
        check_views(ds.get_batch(ids, copy=False), ids, "memfd:dataquay-")
        # The bytes path copies each payload out of the segment.
        assert all("dataquay-" not in mapping_of(memoryview(data)) for data in ds.get_batch(ids))


def test_a_dev_shm_segment_s_payloads_are_read_only_views_too(served: DaemonProcess) -> None:
    os.unlink(fd_socket_path(served.address))  # no fd socket: /dev/shm segments
    with through_daemon(served) as client:
        ids = [1, 2, 3, 1]
        check_views(client.dataset("imgs").get_batch(ids, copy=False), ids, "/dev/shm/dataquay-")


def test_a_segment_whose_views_are_held_is_not_written_over_and_comes_back_once_they_are_released(
    served: DaemonProcess,
) -> None:
    gc.collect()  # an earlier test's views, collected in this one, would close their segments mid-count
    with through_daemon(served) as client:
        ds = client.dataset("imgs")
        first, second = list(range(0, 16)), list(range(16, 32))
        held = ds.get_batch(first, copy=False)
        array = np.frombuffer(held[5], np.uint8)  # an array over a view holds the segment too
        mapped = segment_mappings()
        for _ in range(3):
            check_views(ds.get_batch(second, copy=False), second, "memfd:dataquay-")
        assert [bytes(view) for view in held] == files_bytes(3, first, SIZES)
        later = segment_mappings() - mapped
        assert len(later) == 1  # the later reads took one segment of their own
        del held
        gc.collect()
        assert array.tobytes() == files_bytes(3, [5], SIZES)[0]
        del array
        gc.collect()
        for _ in range(3):
            check_views(ds.get_batch(second, copy=False), second, "memfd:dataquay-")
        assert segment_mappings() - mapped <= later  # the released segment was used again, no new one made


def test_local_hits_come_as_views_of_the_bytes_read_from_the_cache(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, sizes=SIZES, seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    stage(daemon, "imgs")
    before = client.stats().samples["local"]
    ids = [4, 4, 30]
    views = client.dataset("imgs").get_batch(ids, copy=False)
    assert [bytes(v) for v in views] == files_bytes(3, ids, SIZES) and all(v.readonly for v in views)
    assert client.stats().samples["local"] - before == len(ids)


def test_batches_held_at_once_keep_a_segment_each_up_to_the_limit_then_come_as_copies(served: DaemonProcess) -> None:
    gc.collect()  # as above
    with through_daemon(served) as client:
        ds = client.dataset("imgs")
        starts = range(0, 3 * (MAX_LENT_SEGMENTS + 2), 3)
        before = segment_mappings()
        held = [ds.get_batch([k, k + 1, k + 2], copy=False) for k in starts]  # kept for an epoch, say
        for n, (k, views) in enumerate(zip(starts, held)):
            assert [bytes(v) for v in views] == files_bytes(3, [k, k + 1, k + 2], SIZES)
            in_segment = ["dataquay-" in mapping_of(v) for v in views]
            assert in_segment == [n < MAX_LENT_SEGMENTS] * 3 and all(v.readonly for v in views)
        mapped = segment_mappings()
        assert len(mapped - before) <= MAX_LENT_SEGMENTS + 1
        del held, views
        gc.collect()
        for k in starts:
            views = ds.get_batch([k, k + 1, k + 2], copy=False)
            assert [bytes(v) for v in views] == files_bytes(3, [k, k + 1, k + 2], SIZES)
            assert all("memfd:dataquay-" in mapping_of(v) for v in views)
        assert segment_mappings() - mapped == set()  # the released segments serve again


def test_the_torch_iterable_dataset_decodes_npy_records_from_views_without_a_copy(
    daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from dataquay.client.torch import IterableDataset

    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    root = synthetic.make_npy_dataset(tmp_path / "frames", 48, record_shape=(8, 500), files=2, seed=5)
    add(daemon, "frames", root)
    records = np.concatenate([np.load(part) for part in sorted(root.glob("*.npy"))])
    with through_daemon(daemon) as client:
        ds = client.dataset("frames")
        sampler = ds.sampler(rank=0, world_size=1, seed=1)
        order = sampler.indices().tolist()
        lists = IterableDataset(ds, 16, sampler=sampler, decode="npy", copy=False, collate=None)
        arrays = [array for batch in lists for array in batch]
        assert all(
            np.array_equal(a, records[i]) and "memfd:dataquay-" in mapping_of(a.data) for a, i in zip(arrays, order)
        )
        del arrays
        # In worker processes, a collate that stacks each batch: the one copy of the bytes served.
        stacked = IterableDataset(
            ds, 16, sampler=sampler, decode="npy", copy=False, collate=lambda s: torch.from_numpy(np.stack(s))
        )
        batches = list(DataLoader(stacked, batch_size=None, num_workers=2))
        assert torch.equal(torch.cat(batches), torch.from_numpy(records[order]))
