"""The PyTorch adapters against a real daemon: DataLoader workers whose reads
the node counts, and a transform that is told which sample it decodes. The
DataLoaders with workers run in trainer processes of their own
(:mod:`torch_trainers`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from one_daemon import add, cached_samples, daemon_stats, files_bytes, read_locally, stage
from polling import wait_until

import dataquay.client as dq
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: the adapters need it", allow_module_level=True)

from torch_trainers import epochs_read, in_a_trainer, read_ahead_of_the_cursor

from dataquay.client.sampler import Sampler
from dataquay.client.torch import TorchDataset, TorchSampler

SAMPLES = 48


def local_hits_reported(daemon: DaemonProcess) -> int:
    return {r.tier: r.samples for r in daemon_stats(daemon).client_reads}.get("local", 0)


@pytest.fixture
def staged(daemon: DaemonProcess, client: dq.Client, tmp_path: Path) -> dq.Dataset:
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, seed=5)
    add(daemon, "imgs", tmp_path / "imgs")
    stage(daemon, "imgs")
    ds = client.dataset("imgs")
    read_locally(client, ds, range(SAMPLES))
    client.report_stats()
    return ds


@pytest.mark.parametrize(("context", "persistent"), [("fork", False), ("spawn", False), ("fork", True)])
def test_dataloader_workers_reads_reach_the_daemon_counters(
    daemon: DaemonProcess, staged: dq.Dataset, tmp_path: Path, context: str, persistent: bool
) -> None:
    before = local_hits_reported(daemon)
    read = in_a_trainer(tmp_path, epochs_read, daemon.address, "imgs", 2, context, persistent)
    assert read == [files_bytes(5, range(SAMPLES), (4096,))] * 2
    wait_until(lambda: local_hits_reported(daemon) == before + 2 * SAMPLES, "the workers' local hits were reported")


def test_transform_with_ids_decodes_npy_records_by_sample_id(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    root = synthetic.make_npy_dataset(tmp_path / "frames", 10, record_shape=(2, 3), dtype="float64", files=2)
    add(daemon, "frames", root)
    ds = client.dataset("frames")
    dtype, shape = ds.manifest.record_dtype, ds.manifest.record_shape
    assert (dtype, shape) == (np.dtype("float64"), (2, 3))
    expected = np.concatenate([np.load(path) for path in sorted(root.glob("*.npy"))])

    def decode(sample_id: int, data: bytes) -> tuple[int, np.ndarray]:
        return sample_id, np.frombuffer(data, dtype).reshape(shape)

    frames = TorchDataset(ds, decode, with_ids=True)
    for sample_id, array in [*frames.__getitems__([7, 2]), frames[4], frames[-1]]:
        np.testing.assert_array_equal(array, expected[sample_id])
    assert [i for i, _ in frames.__getitems__([7, 2])] == [7, 2] and frames[-1][0] == 9


def test_the_misses_workers_read_themselves_are_cached_behind_them_once_they_end(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, seed=8)
    add(daemon, "imgs", tmp_path / "imgs")
    read = in_a_trainer(tmp_path, epochs_read, daemon.address, "imgs", 1, "fork")
    assert read == [files_bytes(8, range(SAMPLES), (4096,))]
    # The workers are gone: what they noticed was sent as they ended, not lost with them.
    wait_until(lambda: cached_samples(daemon, "imgs") == SAMPLES, "the workers' misses were cached behind them")
    assert daemon_stats(daemon).cache_behind.page_cache_samples == SAMPLES


def test_a_dead_daemon_is_warned_of_once_for_all_workers_and_epochs(daemon: DaemonProcess, tmp_path: Path) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, seed=6)
    add(daemon, "imgs", tmp_path / "imgs")
    assert daemon.process is not None
    warnings = tmp_path / "client.log"
    read = in_a_trainer(
        tmp_path, epochs_read, daemon.address, "imgs", 2, "fork", False, str(warnings), daemon.process.pid
    )
    daemon.kill()  # reaps what the trainer killed once it had its dataset
    assert read == [files_bytes(6, range(SAMPLES), (4096,))] * 2
    lines = warnings.read_text().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0], lines


def test_a_dataloader_runs_ahead_of_the_cursor_and_consumed_saves_what_it_yielded(tmp_path: Path) -> None:
    position, trained, state, rest = in_a_trainer(tmp_path, read_ahead_of_the_cursor, 64, 3)
    assert position > len(trained)  # the read-ahead: what a restore from it would skip
    restarted = TorchSampler(Sampler(64, rank=0, world_size=1, seed=3))
    restarted.load_state_dict(state)
    assert list(restarted) == rest and trained + rest == list(Sampler(64, rank=0, world_size=1, seed=3))
