"""Shuffle quality: what each placement mode costs in accuracy, and what Q buys back.

``local`` and ``partial`` shuffling keep most samples on the node that staged
them, which saves the network but shuffles less. Whether that costs accuracy
depends on the data layout and on how the ranks combine their gradients, so
this trains a small real model (a numpy MLP on scikit-learn's digits) on a
4-node loopback cluster, 8 ranks, every batch read through dataquay, in each
mode and over several seeds, with two layouts:

* ``sample``: one file per sample, the random initial partition; every node
  holds a fair share of every class.
* ``shard``: label-sorted tar shards dealt whole to nodes, so each node owns a
  few classes only: the layout where a node-local shuffle sees skewed classes.

Two trainers consume the very same reads:

* ``sync``: synchronous data-parallel SGD; the gradient is averaged over the
  global batch, the union of the 8 ranks' batches, which mixes all nodes.
* ``local SGD``: each node trains its own replica on its 2 ranks' batches and
  the replicas are averaged every ``--sync-every`` steps (local SGD /
  federated averaging), where a node's skew reaches the model.

Run: ``.venv/bin/python bench/shuffle_quality.py [--quick] [--seeds N] [--epochs E]``;
it prints one table and writes bench/results/shuffle_quality.{json,md}.
scikit-learn only provides the data: ``pip install scikit-learn``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dataquay.client import connect
from dataquay.client.client import Client
from dataquay.client.dataset import Dataset
from dataquay.client.records import unframe_members
from dataquay.client.sampler import Sampler

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
EPOCHS = 20
QUICK_EPOCHS = 5
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
RESULTS = Path(__file__).resolve().parent / "results"
SKLEARN_MISSING = (
    "shuffle_quality needs scikit-learn for its data set: pip install scikit-learn "
    "(or pip install -e .[experiments])"
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
    grads = {
        "w1": x.T @ d_hidden,
        "b1": d_hidden.sum(axis=0),
        "w2": hidden.T @ d_scores,
        "b2": d_scores.sum(axis=0),
    }
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


def _cli(*argv: str) -> None:
    """A dataquay command, as a user would type it, with its output kept off the table."""
    from dataquay.server.cli import main as cli_main

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        failed = cli_main(list(argv))
    if failed:
        raise RuntimeError(f"dataquay {' '.join(argv)} failed: {captured.getvalue().strip()}")


def _tier_counts(clients: Sequence[Client]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for client in clients:
        for tier, count in client.stats().samples.items():
            totals[tier] = totals.get(tier, 0) + count
    return totals


def run_one(
    spec: RunSpec,
    root: Path,
    clients: Sequence[Client],
    directory: str,
    split: Split,
    settings: Settings,
) -> RunResult:
    """Registers the layout under the run's own name, stages it for the run's job, trains."""
    started = time.perf_counter()
    fmt = FORMAT_OF_PARTITION[spec.partition]
    job_settings = ["--mode", spec.mode, "--seed", str(spec.seed), "--partition", spec.partition,
                    "--batch-size", str(settings.batch_size), "--ranks-per-node", str(RANKS_PER_NODE)]
    if spec.q is not None:
        job_settings += ["--q", str(spec.q)]
    _cli("dataset", "add", spec.name, str(root), "--format", fmt, "--addr", clients[0].address)
    _cli("stage", spec.name, "--job", spec.name, *job_settings, "--quiet", "--directory", directory)

    datasets = [clients[rank // RANKS_PER_NODE].dataset(spec.name) for rank in range(WORLD)]
    samplers: list[Sampler] = [
        ds.sampler(
            job=spec.name, mode=spec.mode, q=spec.q, seed=spec.seed, partition=spec.partition,
            batch_size=settings.batch_size, rank=rank, world_size=WORLD,
        )
        for rank, ds in enumerate(datasets)
    ]
    labels_by_id = folder_labels(datasets[0]) if fmt == "files" else None

    sync = SyncTrainer(spec.seed, settings.lr)
    local_sgd = LocalSgdTrainer(spec.seed, settings.lr, NODES, settings.sync_every)
    before = _tier_counts(clients)
    result = RunResult(spec, 0.0, 0.0, [], [], [], [])
    for epoch in range(settings.epochs):
        sync.lr = local_sgd.lr = cosine_lr(settings.lr, epoch, settings.epochs)
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [sampler.indices() for sampler in samplers]
        node_labels: list[list[np.ndarray]] = [[] for _ in range(NODES)]
        for start in range(0, len(orders[0]), settings.batch_size):
            node_batches = []
            for node in range(NODES):
                xs, ys = [], []
                for rank in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE):
                    ids = orders[rank][start : start + settings.batch_size]
                    x, y = decode_batch(datasets[rank].get_batch(ids), ids, labels_by_id)
                    xs.append(x)
                    ys.append(y)
                node_batches.append((np.concatenate(xs), np.concatenate(ys)))
                node_labels[node].append(node_batches[-1][1])
            sync.step(node_batches)
            local_sgd.step(node_batches)
        skews = [class_skew(np.concatenate(labels), split.train_y) for labels in node_labels]
        result.node_classes.append(statistics.fmean(s[0] for s in skews))
        result.node_kl.append(statistics.fmean(s[1] for s in skews))
        result.sync_curve.append(accuracy(sync.model(), split.test_x / PIXEL_MAX, split.test_y))
        result.local_sgd_curve.append(accuracy(local_sgd.model(), split.test_x / PIXEL_MAX, split.test_y))
    after = _tier_counts(clients)
    read = {tier: after.get(tier, 0) - before.get(tier, 0) for tier in after}
    total = sum(read.values()) or 1
    result.tiers = {tier: count / total for tier, count in read.items() if count}
    result.sync_accuracy = result.sync_curve[-1]
    result.local_sgd_accuracy = result.local_sgd_curve[-1]
    result.seconds = time.perf_counter() - started
    return result


def run_all(
    split: Split, seeds: int, settings: Settings, modes: Sequence[tuple[str, float | None]] = MODES
) -> list[RunResult]:
    """Every (partition, mode, seed) on one 4-node loopback cluster in a temporary directory."""
    from dataquay.server.tools.local_cluster import LocalCluster

    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-shuffle-quality-") as tmp:
        base = Path(tmp)
        roots = {
            "sample": write_sample_files(base / "pfs" / "digits-files", split.train_x, split.train_y),
            "shard": write_label_sorted_shards(base / "pfs" / "digits-shards", split.train_x, split.train_y),
        }
        _progress(f"starting a {NODES}-node cluster under {base / 'cluster'}")
        with LocalCluster(base / "cluster", NODES) as cluster, contextlib.ExitStack() as stack:
            clients = [stack.enter_context(connect(d.address)) for d in cluster.daemons]
            specs = [RunSpec(p, m, q, s) for p in PARTITIONS for m, q in modes for s in range(seeds)]
            for n, spec in enumerate(specs, 1):
                result = run_one(spec, roots[spec.partition], clients, cluster.directory_address, split, settings)
                _progress(
                    f"[{n}/{len(specs)}] {spec.name}: sync {result.sync_accuracy:.3f}, "
                    f"local SGD {result.local_sgd_accuracy:.3f}, {result.node_classes[0]:.1f} classes/node, "
                    f"{result.seconds:.1f} s"
                )
                results.append(result)
    return results


# --------------------------------------------------------------- report


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(results: Sequence[RunResult]) -> list[dict[str, object]]:
    """One row per (partition, mode): accuracy mean and std over seeds, skew, read tiers."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.spec.partition, r.spec.mode_label), []).append(r)
    rows: list[dict[str, object]] = []
    for (partition, mode), runs in groups.items():
        sync_mean, sync_std = _mean_std([r.sync_accuracy for r in runs])
        lsgd_mean, lsgd_std = _mean_std([r.local_sgd_accuracy for r in runs])
        tiers = sorted({t for r in runs for t in r.tiers})
        rows.append({
            "partition": partition,
            "mode": mode,
            "seeds": len(runs),
            "sync_acc_mean": sync_mean,
            "sync_acc_std": sync_std,
            "local_sgd_acc_mean": lsgd_mean,
            "local_sgd_acc_std": lsgd_std,
            "classes_per_node_epoch0": statistics.fmean(r.node_classes[0] for r in runs),
            "classes_per_node_last": statistics.fmean(r.node_classes[-1] for r in runs),
            "node_kl_epoch0": statistics.fmean(r.node_kl[0] for r in runs),
            "node_kl_last": statistics.fmean(r.node_kl[-1] for r in runs),
            "node_kl_mean": statistics.fmean(statistics.fmean(r.node_kl) for r in runs),
            "read_share": {t: statistics.fmean(r.tiers.get(t, 0.0) for r in runs) for t in tiers},
            "run_seconds_mean": statistics.fmean(r.seconds for r in runs),
        })
    return rows


HEADER = ("partition", "mode", "sync acc", "local SGD acc", "classes/node e0 -> last", "KL e0 -> last",
          "local / peer / pfs reads", "s per run")


def table(rows: Sequence[dict[str, object]]) -> list[str]:
    """The summary as markdown table lines."""

    def pct(row: dict[str, object], *tiers: str) -> str:
        share = row["read_share"]
        assert isinstance(share, dict)
        return f"{100 * sum(share.get(t, 0.0) for t in tiers):.0f}%"

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        cells = (
            row["partition"], row["mode"],
            f"{row['sync_acc_mean']:.4f} ± {row['sync_acc_std']:.4f}",
            f"{row['local_sgd_acc_mean']:.4f} ± {row['local_sgd_acc_std']:.4f}",
            f"{row['classes_per_node_epoch0']:.1f} -> {row['classes_per_node_last']:.1f}",
            f"{row['node_kl_epoch0']:.3f} -> {row['node_kl_last']:.3f}",
            " / ".join((pct(row, "local", "daemon-local"), pct(row, "peer"), pct(row, "pfs", "fallback"))),
            f"{row['run_seconds_mean']:.1f}",
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def gaps_to_global(rows: Sequence[dict[str, object]]) -> list[str]:
    """Per layout and trainer, each mode's mean accuracy minus global's, in points."""
    lines = []
    for partition in PARTITIONS:
        mine = {str(r["mode"]): r for r in rows if r["partition"] == partition}
        if "global" not in mine:
            continue
        for trainer, key in (("sync", "sync_acc_mean"), ("local SGD", "local_sgd_acc_mean")):
            base = float(mine["global"][key])  # type: ignore[arg-type]
            deltas = ", ".join(
                f"{mode} {100 * (float(row[key]) - base):+.1f}"  # type: ignore[arg-type]
                for mode, row in mine.items()
                if mode != "global"
            )
            lines.append(f"- {partition}, {trainer}: global {100 * base:.1f}%; {deltas} points")
    return lines


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "nproc": nproc or str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


def write_reports(
    out: Path, rows: list[dict[str, object]], results: Sequence[RunResult], settings: Settings,
    num_train: int, command: str, wall_seconds: float,
) -> None:
    """The JSON (every run and the summary) and a markdown page next to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    host = machine()
    seeds = len({r.spec.seed for r in results})
    record = {
        "benchmark": "shuffle_quality",
        "command": command,
        "wall_seconds": wall_seconds,
        "machine": host,
        "settings": {
            **asdict(settings), "nodes": NODES, "ranks_per_node": RANKS_PER_NODE, "hidden": HIDDEN,
            "test_fraction": TEST_FRACTION, "shards_per_class": SHARDS_PER_CLASS,
        },
        "summary": rows,
        "runs": [{**asdict(r), "spec": {**asdict(r.spec), "mode_label": r.spec.mode_label}} for r in results],
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# Shuffle quality: accuracy per placement mode",
        "",
        f"Command: `{command}` ({wall_seconds:.0f} s wall)",
        f"Machine: {host['nproc']} cores ({host['cpu']}), Python {host['python']}, {host['system']}",
        "",
        (
            f"sklearn digits, {num_train} training samples read through a {NODES}-node loopback cluster by "
            f"{WORLD} ranks (batch {settings.batch_size} per rank, global batch {settings.batch_size * WORLD}), "
            f"{settings.epochs} epochs, a 64-{HIDDEN}-10 MLP, SGD with lr {settings.lr} on a cosine decay by "
            f"epoch; test accuracy on a fixed "
            f"{TEST_FRACTION:.0%} held-out split, mean ± std over {seeds} seeds."
        ),
        "",
        *table(rows),
        "",
        "Accuracy against global, in points (mean over seeds; compare with the ± above):",
        "",
        *gaps_to_global(rows),
        "",
        (
            f"- **sync**: synchronous SGD, gradient averaged over the global batch (all {WORLD} ranks). "
            "global and locality give it the same global batches except each epoch's last, which global "
            "leaves short and locality fills with repeated ids; global's orders do not depend on the layout "
            "(both layouts number the samples class by class), so its rows are the same runs."
        ),
        (
            f"- **local SGD**: one replica per node on its {RANKS_PER_NODE} ranks' batches, averaged every "
            f"{settings.sync_every} steps: the setting where a node's class skew reaches the model."
        ),
        (
            "- **classes/node**: distinct classes the ranks of one node read in an epoch (mean over nodes), "
            "first and last epoch; **KL**: that node mix's KL divergence (nats) from the training set's."
        ),
        (
            "- **reads**: where the samples came from: the rank's own node's cache, a peer's cache, the PFS. "
            "Under partial, a traded sample is a local hit where the daemons' exchange delivered it ahead "
            "of its epoch, else its new owner reads it from the PFS. **s per run**: staging plus all epochs "
            "of one run, both trainers included, on this machine's loopback cluster."
        ),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"2 seeds and {QUICK_EPOCHS} epochs unless given")
    parser.add_argument("--seeds", type=int, help="seeds per mode (default 5, --quick 2)")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {EPOCHS}, --quick {QUICK_EPOCHS})")
    parser.add_argument("--sync-every", type=int, default=SYNC_EVERY, help="local SGD: steps between averages")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="SGD learning rate of the first epoch")
    parser.add_argument("--out", type=Path, default=RESULTS / "shuffle_quality.json")
    args = parser.parse_args(argv)
    seeds = args.seeds or (2 if args.quick else 5)
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else EPOCHS)
    split = load_digits_split()
    settings = Settings(epochs=epochs, lr=args.lr, sync_every=args.sync_every)
    started = time.perf_counter()
    results = run_all(split, seeds, settings)
    wall = time.perf_counter() - started
    rows = summarise(results)
    print("\n".join([*table(rows), "", *gaps_to_global(rows)]))
    command = " ".join([".venv/bin/python", "bench/shuffle_quality.py", *(argv if argv is not None else sys.argv[1:])])
    write_reports(args.out, rows, results, settings, len(split.train_y), command, wall)
    print(f"\n{len(results)} runs in {wall:.0f} s; wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
