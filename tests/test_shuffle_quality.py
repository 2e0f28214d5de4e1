"""The shuffle-quality experiment's parts: data writers, model, skew measure, and one run on a cluster."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from dataquay.client.manifest import Manifest
from dataquay.client.pfs import PfsReader
from dataquay.server.manifest_build import build_manifest
from dataquay.server.tools.local_cluster import LocalCluster

BENCH = Path(__file__).resolve().parents[1] / "bench" / "experiments"


def load_bench(name: str) -> ModuleType:
    """bench/experiments/<name>.py, registered under its name: the experiment's modules import each other by it."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sq = load_bench("shuffle_quality_training")
load_bench("shuffle_quality_report")
script = load_bench("shuffle_quality")


def synthetic_digits(per_class: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Separable 8x8 'digits': class c lights pixels 6c..6c+5 on top of noise."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(sq.NUM_CLASSES), per_class)
    images = rng.integers(0, 4, size=(len(labels), sq.PIXELS))
    for i, label in enumerate(labels):
        images[i, 6 * label : 6 * label + 6] = 16
    return images.astype(np.uint8), labels.astype(np.int64)


def test_class_skew_is_zero_for_the_reference_mix_and_log_k_for_one_class_of_k() -> None:
    reference = np.repeat(np.arange(10), 5)
    assert sq.class_skew(reference, reference) == (10, pytest.approx(0.0))
    classes, kl = sq.class_skew(np.full(7, 3), reference)
    assert classes == 1 and kl == pytest.approx(math.log(10))
    classes, kl = sq.class_skew(np.array([0, 1, 2, 3, 4]), reference)
    assert classes == 5 and kl == pytest.approx(math.log(2))


def test_stratified_test_mask_holds_out_the_fraction_of_every_class() -> None:
    labels = np.repeat(np.arange(10), [50, 40, 30, 20, 10, 50, 40, 30, 20, 10])
    mask = sq.stratified_test_mask(labels, 0.2, seed=3)
    assert np.array_equal(np.bincount(labels[mask]), np.bincount(labels) // 5)
    assert np.array_equal(mask, sq.stratified_test_mask(labels, 0.2, seed=3))


def test_gradients_match_finite_differences() -> None:
    images, labels = synthetic_digits(2)
    x = images[:12] / sq.PIXEL_MAX
    y = labels[:12]
    params = sq.init_mlp(seed=1, hidden=5)
    grads, _ = sq.gradients(params, x, y)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for name, value in params.items():
        for index in map(tuple, rng.integers(0, value.shape, size=(3, value.ndim))):
            saved = value[index]
            value[index] = saved + eps
            up = sq.gradients(params, x, y)[1]
            value[index] = saved - eps
            down = sq.gradients(params, x, y)[1]
            value[index] = saved
            assert grads[name][index] == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-7)


def test_sgd_learns_separable_digits() -> None:
    images, labels = synthetic_digits(30)
    x = images / sq.PIXEL_MAX
    trainer = sq.SyncTrainer(seed=0, lr=0.5)
    assert sq.accuracy(trainer.model(), x, labels) < 0.5
    rng = np.random.default_rng(0)
    for _ in range(200):
        batch = rng.choice(len(labels), 32, replace=False)
        trainer.step([(x[batch], labels[batch])])
    assert sq.accuracy(trainer.model(), x, labels) > 0.95


def test_local_sgd_averaged_every_step_is_synchronous_sgd() -> None:
    # With equal node batches, the mean of the nodes' steps is the step on the union.
    images, labels = synthetic_digits(8)
    x = images / sq.PIXEL_MAX
    sync = sq.SyncTrainer(seed=4, lr=0.3)
    local = sq.LocalSgdTrainer(seed=4, lr=0.3, nodes=4, sync_every=1)
    order = np.random.default_rng(1).permutation(len(labels))
    for step in range(5):
        ids = order[step * 16 : (step + 1) * 16].reshape(4, 4)
        batches = [(x[i], labels[i]) for i in ids]
        sync.step(batches)
        local.step(batches)
    for name, value in sync.model().items():
        np.testing.assert_allclose(local.model()[name], value, rtol=1e-10, atol=1e-12)


def test_local_sgd_replicas_drift_apart_between_averages() -> None:
    images, labels = synthetic_digits(4)
    x = images / sq.PIXEL_MAX
    local = sq.LocalSgdTrainer(seed=0, lr=0.3, nodes=2, sync_every=3)
    skewed = [(x[labels < 5], labels[labels < 5]), (x[labels >= 5], labels[labels >= 5])]
    local.step(skewed)
    assert not np.allclose(local.replicas[0]["w2"], local.replicas[1]["w2"])
    local.step(skewed)
    local.step(skewed)
    assert np.array_equal(local.replicas[0]["w2"], local.replicas[1]["w2"])


def test_label_sorted_shards_hold_one_class_each_and_decode_to_what_was_written(tmp_path: Path) -> None:
    images, labels = synthetic_digits(6)
    root = sq.write_label_sorted_shards(tmp_path / "shards", images, labels, shards_per_class=2)
    manifest = Manifest(build_manifest(root, "tar").to_bytes())
    assert manifest.num_samples == len(labels) and manifest.tar_grouped
    values = PfsReader(manifest, "digits").read(np.arange(manifest.num_samples))
    decoded = [sq.decode_tar_sample(v) for v in values]
    read_labels = np.array([label for _, label in decoded])
    groups = manifest.shard_groups()
    assert len(np.unique(groups)) == 2 * sq.NUM_CLASSES
    for group in np.unique(groups):
        assert len(np.unique(read_labels[groups == group])) == 1
    written = {images[i].tobytes(): labels[i] for i in range(len(labels))}
    assert {pixels.tobytes(): label for pixels, label in decoded} == written

    x, y = sq.decode_batch(values[:5], np.arange(5), None)
    assert x.shape == (5, sq.PIXELS) and x.max() <= 1.0 and np.array_equal(y, read_labels[:5])


def test_sample_files_carry_their_label_as_the_class_folder(tmp_path: Path) -> None:
    images, labels = synthetic_digits(3)
    root = sq.write_sample_files(tmp_path / "files", images, labels)
    manifest = Manifest(build_manifest(root, "files").to_bytes())
    ids = np.arange(manifest.num_samples)
    by_id = np.array([int(manifest.label(i) or -1) for i in range(manifest.num_samples)])
    x, y = sq.decode_batch(PfsReader(manifest, "digits").read(ids), ids, by_id)
    assert sorted(map(bytes, (x * sq.PIXEL_MAX).astype(np.uint8))) == sorted(map(bytes, images))
    assert np.array_equal(np.bincount(y), np.bincount(labels))


def test_missing_sklearn_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(SystemExit, match="pip install scikit-learn"):
        sq.load_digits_split()


def test_digits_split_holds_out_a_fifth_of_every_class() -> None:
    pytest.importorskip("sklearn", reason="the digits come from scikit-learn")
    split = sq.load_digits_split()
    assert len(split.train_y) + len(split.test_y) == 1797
    assert split.train_x.shape[1] == sq.PIXELS and split.train_x.max() <= sq.PIXEL_MAX
    assert np.all(np.abs(np.bincount(split.test_y) - 0.2 * np.bincount(np.r_[split.train_y, split.test_y])) <= 0.5)


def test_local_mode_on_label_sorted_shards_trains_through_the_cluster_with_skewed_nodes(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    from dataquay.client import connect

    train_x, train_y = synthetic_digits(16, seed=1)
    test_x, test_y = synthetic_digits(4, seed=2)
    split = sq.Split(train_x, train_y, test_x, test_y)
    root = sq.write_label_sorted_shards(tmp_path / "shards", train_x, train_y, shards_per_class=1)
    local = cluster(sq.NODES)
    clients = [connect(d.address) for d in local.daemons]
    try:
        result = script.run_one(
            sq.RunSpec("shard", "local", None, seed=0),
            root,
            clients,
            local.directory_address,
            split,
            sq.Settings(epochs=2, batch_size=4, lr=0.5, sync_every=5),
        )
    finally:
        for client in clients:
            client.close()
    # 10 one-class shards over 4 nodes: 2 or 3 classes per node, every epoch.
    assert result.node_classes == [2.5, 2.5]
    assert result.node_kl[0] > 1.0
    assert result.tiers == {"local": 1.0}
    assert result.sync_accuracy > 0.5 and len(result.local_sgd_curve) == 2


def test_cosine_lr_starts_at_the_base_rate_and_decays_towards_zero() -> None:
    rates = [sq.cosine_lr(0.5, epoch, 10) for epoch in range(10)]
    assert rates[0] == 0.5 and rates[5] == pytest.approx(0.25)
    assert all(a > b for a, b in itertools.pairwise(rates)) and 0 < rates[-1] < 0.02
