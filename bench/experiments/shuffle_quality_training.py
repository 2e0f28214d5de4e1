"""The shuffle-quality experiment's parts that need no cluster: the digits and
their two on-disk layouts, the numpy MLP and its two trainers, the class-skew
measure, and what describes a run and its result.

bench/experiments/shuffle_quality.py drives them on a local cluster.
"""

from __future__ import annotations

import io
import math
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dataquay.client.dataset import Dataset
from dataquay.client.wire.records import unframe_members

NODES = 4
RANKS_PER_NODE = 2
WORLD = NODES * RANKS_PER_NODE
NUM_CLASSES = 10
PIXELS = 64
#: Digits pixels are 0..16.
PIXEL_MAX = 16.0
TEST_FRACTION = 0.2
SPLIT_SEED = 0
#: Each class is cut into this many shards; the shard partition deals
#: 20 shards over 4 nodes, about 5 per node, so 5 or fewer classes each.
SHARDS_PER_CLASS = 2
#: Ids per rank per step: a global batch of 64.
BATCH_SIZE = 8
HIDDEN = 32
LEARNING_RATE = 0.5
#: Local SGD averages the node replicas every this many steps: about once an
#: epoch (1,438 training samples in global batches of 64 make 23 steps).
SYNC_EVERY = 23
#: (mode, q) in the order the table shows them.
MODES: tuple[tuple[str, float | None], ...] = (
    ("global", None),
    ("locality", None),
    ("partial", 0.5),
    ("partial", 0.1),
    ("local", None),
)
PARTITIONS = ("sample", "shard")
FORMAT_OF_PARTITION = {"sample": "files", "shard": "tar"}
SKLEARN_MISSING = (
    "shuffle_quality needs scikit-learn for its data set: pip install scikit-learn (or pip install -e .[experiments])"
)

Params = dict[str, np.ndarray]


# ----------------------------------------------------------------- data


@dataclass(frozen=True)
class Split:
    """Digits as uint8 pixels (n x 64) and int labels, cut into train and test."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def load_digits_split(test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED) -> Split:
    """sklearn's digits with a fixed stratified test split.

    Raises:
        SystemExit: scikit-learn is not installed (the message says how to).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(SKLEARN_MISSING) from None
    digits = load_digits()
    images = digits.data.astype(np.uint8)
    labels = digits.target.astype(np.int64)
    test = stratified_test_mask(labels, test_fraction, seed)
    return Split(images[~test], labels[~test], images[test], labels[test])


def stratified_test_mask(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """True for the samples held out: ``test_fraction`` of every class, picked at random."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        mask[rng.choice(members, size=round(test_fraction * len(members)), replace=False)] = True
    return mask


def write_sample_files(root: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """One file of 64 pixel bytes per sample, in class folders (``root/3/00012.pix``).

    The label is the folder, as in an ImageFolder tree; the manifest records it.
    """
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.pix").write_bytes(image.astype(np.uint8).tobytes())
    return root


def write_label_sorted_shards(
    root: Path, images: np.ndarray, labels: np.ndarray, shards_per_class: int = SHARDS_PER_CLASS
) -> Path:
    """WebDataset-style tar shards written class by class, ``shards_per_class`` per class.

    Sample ``i`` is the members ``i.pix`` (64 pixel bytes) and ``i.cls`` (its
    label as text); the manifest groups them into one sample. Every shard holds
    one class, so the ``shard`` partition hands each node whole classes.
    """
    root.mkdir(parents=True, exist_ok=True)
    shard = 0
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        for part in np.array_split(members, shards_per_class):
            with tarfile.open(root / f"shard-{shard:04d}.tar", "w") as tar:
                for i in part.tolist():
                    _add_member(tar, f"{i:05d}.pix", images[i].astype(np.uint8).tobytes())
                    _add_member(tar, f"{i:05d}.cls", str(int(labels[i])).encode())
            shard += 1
    return root


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def decode_tar_sample(value: bytes | memoryview) -> tuple[np.ndarray, int]:
    """(pixels, label) of a grouped tar sample as dataquay serves it."""
    members = unframe_members(value)
    return np.frombuffer(members["pix"], dtype=np.uint8), int(bytes(members["cls"]))


def folder_labels(ds: Dataset) -> np.ndarray:
    """The label of every sample of a ``files`` dataset, from its class folder in the manifest."""
    return np.array([int(ds.label(i) or -1) for i in range(len(ds))], dtype=np.int64)


def decode_batch(
    values: Sequence[bytes], ids: np.ndarray, labels_by_id: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(features scaled to [0, 1], labels) of one rank's batch.

    ``labels_by_id`` is given for a ``files`` dataset (labels are folders);
    None means tar samples, which carry their label.
    """
    if labels_by_id is not None:
        pixels = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), PIXELS)
        return pixels / PIXEL_MAX, labels_by_id[ids]
    decoded = [decode_tar_sample(v) for v in values]
    pixels = np.stack([p for p, _ in decoded]) if decoded else np.empty((0, PIXELS), np.uint8)
    return pixels / PIXEL_MAX, np.array([label for _, label in decoded], dtype=np.int64)


# ---------------------------------------------------------------- model


def init_mlp(seed: int, inputs: int = PIXELS, hidden: int = HIDDEN, classes: int = NUM_CLASSES) -> Params:
    """A one-hidden-layer ReLU MLP, He-initialised from ``seed``."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0.0, math.sqrt(2.0 / inputs), (inputs, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0.0, math.sqrt(2.0 / hidden), (hidden, classes)),
        "b2": np.zeros(classes),
    }


def logits(params: Params, x: np.ndarray) -> np.ndarray:
    hidden = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    out: np.ndarray = hidden @ params["w2"] + params["b2"]
    return out


def gradients(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[Params, float]:
    """Mean cross-entropy over the batch and its gradient with respect to every parameter."""
    pre = x @ params["w1"] + params["b1"]
    hidden = np.maximum(pre, 0.0)
    scores = hidden @ params["w2"] + params["b2"]
    scores -= scores.max(axis=1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(probs[np.arange(n), y] + 1e-12).mean())
    d_scores = probs
    d_scores[np.arange(n), y] -= 1.0
    d_scores /= n
    d_hidden = (d_scores @ params["w2"].T) * (pre > 0)
    grads = {"w1": x.T @ d_hidden, "b1": d_hidden.sum(axis=0), "w2": hidden.T @ d_scores, "b2": d_scores.sum(axis=0)}
    return grads, loss


def sgd_step(params: Params, x: np.ndarray, y: np.ndarray, lr: float) -> float:
    """One SGD step on the batch, in place; returns the batch's loss before the step."""
    grads, loss = gradients(params, x, y)
    for name, grad in grads.items():
        params[name] -= lr * grad
    return loss


def cosine_lr(base: float, epoch: int, epochs: int) -> float:
    """The learning rate of ``epoch``: ``base`` decayed along a half cosine towards 0 at ``epochs``.

    A decayed rate makes the final accuracy a property of the run rather
    than of the last few noisy steps.
    """
    return base * 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


def average(replicas: Sequence[Params]) -> Params:
    """The parameter-wise mean of equally weighted replicas."""
    return {name: np.mean([r[name] for r in replicas], axis=0) for name in replicas[0]}


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    return float((logits(params, x).argmax(axis=1) == y).mean())


class SyncTrainer:
    """Synchronous data-parallel SGD: one model, gradient of the whole global batch."""

    def __init__(self, seed: int, lr: float) -> None:
        self.params = init_mlp(seed)
        self.lr = lr

    def step(self, node_batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        x = np.concatenate([b[0] for b in node_batches])
        y = np.concatenate([b[1] for b in node_batches])
        sgd_step(self.params, x, y, self.lr)

    def model(self) -> Params:
        return self.params


class LocalSgdTrainer:
    """One replica per node, trained on that node's ranks only, averaged every ``sync_every`` steps."""

    def __init__(self, seed: int, lr: float, nodes: int, sync_every: int) -> None:
        start = init_mlp(seed)
        self.replicas = [{k: v.copy() for k, v in start.items()} for _ in range(nodes)]
        self.lr = lr
        self.sync_every = sync_every
        self.steps = 0

    def step(self, node_batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        for replica, (x, y) in zip(self.replicas, node_batches):
            sgd_step(replica, x, y, self.lr)
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self._synchronise()

    def _synchronise(self) -> None:
        mean = average(self.replicas)
        self.replicas = [{k: v.copy() for k, v in mean.items()} for _ in self.replicas]

    def model(self) -> Params:
        return average(self.replicas)


# ----------------------------------------------------------------- skew


def class_skew(labels: np.ndarray, reference: np.ndarray, num_classes: int = NUM_CLASSES) -> tuple[int, float]:
    """(distinct classes, KL divergence in nats) of ``labels`` from ``reference``'s class mix.

    ``reference`` is the labels of the whole training set: 0 nats means a node
    read classes in the same proportions as a full shuffle would give it.
    """
    counts = np.bincount(labels, minlength=num_classes).astype(float)
    if not counts.sum():
        return 0, 0.0
    p = counts / counts.sum()
    q = np.bincount(reference, minlength=num_classes).astype(float)
    q /= q.sum()
    seen = p > 0
    return int(seen.sum()), float(np.sum(p[seen] * np.log(p[seen] / q[seen])))


# ------------------------------------------------------------------ runs


@dataclass(frozen=True)
class RunSpec:
    """One training run: a layout, a placement mode and a seed."""

    partition: str
    mode: str
    q: float | None
    seed: int

    @property
    def mode_label(self) -> str:
        return self.mode if self.q is None else f"{self.mode} q={self.q:g}"

    @property
    def name(self) -> str:
        """Job id and dataset name: distinct per run, so no cache or job carries over."""
        q = "" if self.q is None else f"-q{self.q:g}"
        return f"sq-{self.partition}-{self.mode}{q}-s{self.seed}"


@dataclass
class RunResult:
    spec: RunSpec
    sync_accuracy: float
    local_sgd_accuracy: float
    #: Test accuracy after each epoch.
    sync_curve: list[float]
    local_sgd_curve: list[float]
    #: Per epoch, mean over nodes of the distinct classes its ranks read and their KL from the training mix.
    node_classes: list[float]
    node_kl: list[float]
    #: Share of the samples read that came from each tier (local, peer, pfs, ...).
    tiers: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class Settings:
    epochs: int
    batch_size: int = BATCH_SIZE
    lr: float = LEARNING_RATE
    sync_every: int = SYNC_EVERY
