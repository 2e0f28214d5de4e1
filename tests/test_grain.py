"""grain's DataLoader over a real daemon: the dataset as its random-access
source, read in grain's worker processes, in a dataquay sampler's order, and
resumed from grain's own checkpoint."""

from __future__ import annotations

import importlib.util
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from one_daemon import add, files_bytes

import dataquay.client as dq
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

if importlib.util.find_spec("grain") is None:
    pytest.skip("grain is not installed: pip install grain", allow_module_level=True)

import grain.python as gp
from absl import flags

from dataquay.client.grain import GrainSampler, GrainSource

# With JAX installed, grain's DataLoader reads absl flags, which a program
# run by absl.app has parsed (examples/jax_grain.py) and pytest has not.
flags.FLAGS.mark_as_parsed()

SAMPLES = 24


@pytest.fixture
def ds(daemon: DaemonProcess, client: dq.Client, tmp_path: Path) -> dq.Dataset:
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, seed=9)
    add(daemon, "imgs", tmp_path / "imgs")
    return client.dataset("imgs")


def loader(ds: dq.Dataset, rank: int, epochs: int, workers: int) -> gp.DataLoader:
    sampler = GrainSampler(ds.sampler(rank=rank, world_size=2, seed=3), epochs)
    return gp.DataLoader(
        data_source=GrainSource(ds), sampler=sampler, worker_count=workers, shard_options=gp.NoSharding()
    )


def test_grain_workers_read_each_rank_s_order_and_every_sample_once_an_epoch(ds: dq.Dataset) -> None:
    half = SAMPLES // 2
    epoch0 = []
    for rank in range(2):
        read = list(loader(ds, rank, 2, 2))
        sampler = ds.sampler(rank=rank, world_size=2, seed=3)
        assert read == files_bytes(9, [*sampler.indices(0).tolist(), *sampler.indices(1).tolist()], (4096,))
        epoch0 += read[:half]
    assert sorted(epoch0) == sorted(files_bytes(9, range(SAMPLES), (4096,)))


def test_grain_resumes_from_its_checkpoint_at_the_next_record(ds: dq.Dataset) -> None:
    running = iter(loader(ds, 1, 2, 2))
    trained = [next(running) for _ in range(7)]
    state = running.get_state()
    rest = list(running)
    again = iter(loader(ds, 1, 2, 2))
    again.set_state(state)
    assert list(again) == rest and len(trained) + len(rest) == SAMPLES


def test_the_source_pickles_and_reads_in_another_process_s_copy(ds: dq.Dataset) -> None:
    source = GrainSource(ds, "raw", with_labels=True)
    copy = pickle.loads(pickle.dumps(source))
    assert len(copy) == SAMPLES and copy[5] == (files_bytes(9, [5], (4096,))[0], int(ds.targets[5]))
    with pytest.raises(IndexError, match="past the 1 epochs"):
        GrainSampler(ds.sampler(rank=0, world_size=2), 1)[SAMPLES // 2]


def test_the_sampler_answers_grain_s_reader_threads_asking_across_epochs_at_once() -> None:
    # grain's reader threads ask for records of two epochs at once: each
    # answer must be its own epoch's, whichever epoch another thread cached.
    sampler = dq.Sampler(64, rank=1, world_size=2, seed=7)
    want = {epoch: sampler.indices(epoch).tolist() for epoch in range(40)}
    grain_sampler = GrainSampler(sampler, 40)
    indices = [epoch * 32 + position for position in range(32) for epoch in range(40)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: grain_sampler[i].record_key, indices))
    assert got == [want[i // 32][i % 32] for i in indices]
