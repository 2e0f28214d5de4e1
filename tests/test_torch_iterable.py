"""The PyTorch IterableDataset against a real daemon: it deals a rank's
epoch to DataLoader workers by itself, resumes exactly, skips what cannot be
read, and its workers' reads show in the trainer's stats. The DataLoaders run
in trainer processes of their own (:mod:`torch_trainers`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from one_daemon import add, files_bytes, stage

from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the adapters need it", allow_module_level=True)

from torch_trainers import in_a_trainer, iterable_epochs, iterable_resumed, iterable_stats

SAMPLES = 48
BATCH = 4


@pytest.fixture
def imgs(daemon: DaemonProcess, tmp_path: Path) -> Path:
    root = synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, seed=5)
    add(daemon, "imgs", root)
    return root


def test_two_ranks_of_two_workers_read_every_sample_once_an_epoch_in_equal_steps(
    daemon: DaemonProcess, imgs: Path, tmp_path: Path
) -> None:
    epochs = in_a_trainer(tmp_path, iterable_epochs, daemon.address, "imgs", 2, 2, BATCH)
    everything = sorted(files_bytes(5, range(SAMPLES), (4096,)))
    orders = []
    for ranks in epochs:
        read = [sample for batches, _ in ranks for batch in batches for sample in batch]
        assert sorted(read) == everything  # each sample once, across ranks and workers
        assert [len(batches) for batches, _ in ranks] == [SAMPLES // 2 // BATCH] * 2
        for batches, order in ranks:  # the workers' batches come out in the rank's order
            assert [sample for batch in batches for sample in batch] == files_bytes(5, order, (4096,))
        orders.append([order for _, order in ranks])
    assert orders[0] != orders[1]  # set_epoch reshuffles


@pytest.mark.parametrize("stateful", [True, False], ids=["StatefulDataLoader", "own-state"])
def test_a_restarted_loader_resumes_at_the_next_batch_in_the_same_order(
    daemon: DaemonProcess, imgs: Path, tmp_path: Path, stateful: bool
) -> None:
    if stateful and importlib.util.find_spec("torchdata") is None:
        pytest.skip("torchdata is not installed: pip install torchdata for StatefulDataLoader")
    before, rest, resumed = in_a_trainer(tmp_path, iterable_resumed, daemon.address, "imgs", 2, BATCH, 3, stateful)
    assert len(before) == 3 and rest and resumed == rest
    assert len(before) + len(rest) == SAMPLES // 2 // BATCH


def test_the_workers_reads_show_in_the_training_process_stats(
    daemon: DaemonProcess, imgs: Path, tmp_path: Path
) -> None:
    stage(daemon, "imgs")
    samples, skipped, retried, read, error = in_a_trainer(tmp_path, iterable_stats, daemon.address, "imgs", 2, "raise")
    assert sorted(read) == sorted(files_bytes(5, range(SAMPLES), (4096,))) and error is None
    assert (samples, skipped, retried) == (SAMPLES, 0, 0)


def _unreadable(root: Path, sample_id: int) -> tuple[str, bytes, int]:
    """Makes one registered sample's file unreadable (it is not what the
    manifest recorded); what restores it."""
    path = next(root.glob(f"*/{sample_id:08d}.bin"))
    saved = (str(path), path.read_bytes(), path.stat().st_mtime_ns)
    path.write_bytes(b"changed after registration")
    os.utime(path, ns=(1, 1))
    return saved


def test_on_error_skip_leaves_an_unreadable_sample_out_and_counts_it(
    daemon: DaemonProcess, imgs: Path, tmp_path: Path
) -> None:
    _unreadable(imgs, 7)
    samples, skipped, retried, read, error = in_a_trainer(tmp_path, iterable_stats, daemon.address, "imgs", 2, "skip")
    assert sorted(read) == sorted(files_bytes(5, [i for i in range(SAMPLES) if i != 7], (4096,)))
    assert (skipped, retried, error) == (1, 0, None) and samples >= SAMPLES - 1


def test_on_error_raise_fails_the_epoch_on_an_unreadable_sample(
    daemon: DaemonProcess, imgs: Path, tmp_path: Path
) -> None:
    _unreadable(imgs, 7)
    *_, error = in_a_trainer(tmp_path, iterable_stats, daemon.address, "imgs", 2, "raise")
    assert error == "PfsReadError"


def test_on_error_retry_reads_a_sample_again_until_it_is_readable(
    daemon: DaemonProcess, imgs: Path, tmp_path: Path
) -> None:
    saved = _unreadable(imgs, 7)
    _, skipped, retried, read, error = in_a_trainer(tmp_path, iterable_stats, daemon.address, "imgs", 1, "retry", saved)
    assert sorted(read) == sorted(files_bytes(5, range(SAMPLES), (4096,)))
    assert error is None and skipped == 0 and retried >= 1


def test_on_error_retry_raises_once_its_retries_are_spent(daemon: DaemonProcess, imgs: Path, tmp_path: Path) -> None:
    _unreadable(imgs, 7)
    _, skipped, retried, _, error = in_a_trainer(tmp_path, iterable_stats, daemon.address, "imgs", 0, "retry")
    assert (error, skipped, retried) == ("PfsReadError", 0, 5)
