"""The tf.data adapter against a real daemon: its generator yields a rank's
order, decoded and labelled, and its cursor resumes; through TensorFlow
itself where it is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from one_daemon import add, files_bytes

import dataquay.client as dq
from dataquay.client.tf import sample_generator, tf_dataset
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SAMPLES = 30


@pytest.fixture
def ds(daemon: DaemonProcess, client: dq.Client, tmp_path: Path) -> dq.Dataset:
    synthetic.make_files_dataset(tmp_path / "imgs", SAMPLES, seed=4, classes=3)
    add(daemon, "imgs", tmp_path / "imgs")
    return client.dataset("imgs")


def test_the_generator_yields_the_rank_s_order_labelled_and_resumes_mid_epoch(ds: dq.Dataset) -> None:
    sampler = ds.sampler(rank=1, world_size=3, seed=2)
    sampler.set_epoch(1)
    order = sampler.indices().tolist()
    generate = sample_generator(ds, sampler, with_labels=True, read_batch=4)
    samples = generate()
    first = [next(samples) for _ in range(4)]
    state = sampler.state_dict()
    rest = list(samples)
    want = [(data, i * 3 // SAMPLES) for i, data in zip(order, files_bytes(4, order, (4096,)))]
    assert first + rest == want and sampler.position == 0
    resumed = ds.sampler(rank=1, world_size=3, seed=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(sample_generator(ds, resumed, with_labels=True, read_batch=4)()) == rest


def test_tf_dataset_yields_the_bytes_as_string_tensors(ds: dq.Dataset) -> None:
    if importlib.util.find_spec("tensorflow") is None:
        with pytest.raises(ImportError, match="needs TensorFlow"):
            tf_dataset(ds, ds.sampler(rank=0, world_size=1), None)
        pytest.skip("TensorFlow is not installed (over 1 GB): the generator is tested without it")
    import tensorflow as tf

    sampler = ds.sampler(rank=0, world_size=1, seed=1)
    read = [t.numpy() for t in tf_dataset(ds, sampler, tf.TensorSpec(shape=(), dtype=tf.string))]
    assert read == files_bytes(4, sampler.indices().tolist(), (4096,))
