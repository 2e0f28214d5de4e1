"""Prepped batches in shared memory: what goes in comes out, byte for byte;
a segment changed or cut short is refused; a dead daemon's segments go."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from dataquay.client import prepped
from dataquay.client.prep_order import batch_count, batch_ids, epoch_batches
from dataquay.client.wire.shm import SHM_DIR


@pytest.fixture
def written() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    prepped.unlink(names)


def test_batches_come_back_as_written(written: list[str]) -> None:
    images = np.random.default_rng(0).random((4, 3, 5, 5), dtype=np.float32)
    fields = (images, np.arange(4, dtype=np.int64), np.ones((4, 2), dtype=">u2"))
    name, size = prepped.write(fields, os.getpid())
    written.append(name)
    assert (SHM_DIR / name).stat().st_size == size and (SHM_DIR / name).stat().st_mode & 0o777 == 0o600
    back = prepped.read(name)
    assert isinstance(back, tuple) and len(back) == 3
    for a, b in zip(fields, back):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    one, _ = prepped.write(np.arange(6).reshape(2, 3), os.getpid())
    written.append(one)
    assert np.array_equal(prepped.read(one), np.arange(6).reshape(2, 3))


def test_collate_stacks_what_prep_returned() -> None:
    keys, pixels = prepped.collate([(i, np.full(3, i, np.float32)) for i in range(4)])
    assert keys.tolist() == [0, 1, 2, 3] and pixels.shape == (4, 3)
    assert np.shape(prepped.collate([np.zeros(2), np.ones(2)])) == (2, 2)


def test_a_changed_or_cut_segment_is_refused(written: list[str]) -> None:
    name, _ = prepped.write((np.arange(100, dtype=np.int64),), os.getpid())
    written.append(name)
    path = SHM_DIR / name
    data = bytearray(path.read_bytes())
    data[-len(data) // 3] ^= 1  # inside the array's bytes
    path.write_bytes(data)
    with pytest.raises(prepped.PreppedBatchError, match="fails its checksum"):
        prepped.read(name)
    os.truncate(path, 100)
    with pytest.raises(prepped.PreppedBatchError, match="cut short"):
        prepped.read(name)
    path.unlink()
    with pytest.raises(prepped.PreppedBatchError, match="cannot be read"):
        prepped.read(name)
    with pytest.raises(prepped.PreppedBatchError, match="not a prepped batch"):
        prepped.read("../etc/passwd")


def test_the_segments_of_a_daemon_that_died_are_removed_and_a_live_ones_kept(written: list[str]) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan, _ = prepped.write(np.zeros(4), int(dead.stdout))
    live, _ = prepped.write(np.zeros(4), os.getpid())
    written += [orphan, live]
    prepped.remove_orphans()
    assert not (SHM_DIR / orphan).exists() and (SHM_DIR / live).exists()


def test_every_member_computes_the_same_batches_each_sample_once_per_epoch() -> None:
    assert batch_count(10, 4, drop_last=False) == 3 and batch_count(10, 4, drop_last=True) == 2
    batches = epoch_batches(10, 4, seed=7, epoch=2, drop_last=False)
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert np.array_equal(batch_ids(10, 4, 7, 2, 1), batches[1])
    assert not np.array_equal(np.concatenate(epoch_batches(10, 4, 7, 3, False)), np.concatenate(batches))
