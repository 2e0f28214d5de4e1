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

Run: ``.venv/bin/python bench/experiments/shuffle_quality.py [--quick] [--seeds N] [--epochs E]``;
it prints one table and writes bench/results/shuffle_quality.{json,md}.
scikit-learn only provides the data: ``pip install scikit-learn``.

The data, model, trainers and skew measure are in shuffle_quality_training.py,
the summary and the written report in shuffle_quality_report.py; this module
drives them on the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from shuffle_quality_report import gaps_to_global, summarise, table, write_reports
from shuffle_quality_training import (
    FORMAT_OF_PARTITION,
    LEARNING_RATE,
    MODES,
    NODES,
    PARTITIONS,
    PIXEL_MAX,
    RANKS_PER_NODE,
    SYNC_EVERY,
    WORLD,
    LocalSgdTrainer,
    RunResult,
    RunSpec,
    Settings,
    Split,
    SyncTrainer,
    accuracy,
    class_skew,
    cosine_lr,
    decode_batch,
    folder_labels,
    load_digits_split,
    write_label_sorted_shards,
    write_sample_files,
)

from dataquay.client import connect
from dataquay.client.client import Client
from dataquay.client.sampler import Sampler

EPOCHS = 20
QUICK_EPOCHS = 5
RESULTS = Path(__file__).resolve().parents[1] / "results"


# ------------------------------------------------------------------ runs


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
    spec: RunSpec, root: Path, clients: Sequence[Client], directory: str, split: Split, settings: Settings
) -> RunResult:
    """Registers the layout under the run's own name, stages it for the run's job, trains."""
    started = time.perf_counter()
    fmt = FORMAT_OF_PARTITION[spec.partition]
    job_settings = [
        "--mode",
        spec.mode,
        "--seed",
        str(spec.seed),
        "--partition",
        spec.partition,
        "--batch-size",
        str(settings.batch_size),
        "--ranks-per-node",
        str(RANKS_PER_NODE),
    ]
    if spec.q is not None:
        job_settings += ["--q", str(spec.q)]
    _cli("dataset", "add", spec.name, str(root), "--format", fmt, "--addr", clients[0].address)
    _cli("stage", spec.name, "--job", spec.name, *job_settings, "--quiet", "--directory", directory)

    datasets = [clients[rank // RANKS_PER_NODE].dataset(spec.name) for rank in range(WORLD)]
    samplers: list[Sampler] = [
        ds.sampler(
            job=spec.name,
            mode=spec.mode,
            q=spec.q,
            seed=spec.seed,
            partition=spec.partition,
            batch_size=settings.batch_size,
            rank=rank,
            world_size=WORLD,
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
        with LocalCluster(base / "cluster", NODES, dataset_roots=(base,)) as cluster, contextlib.ExitStack() as stack:
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
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join([".venv/bin/python", "bench/experiments/shuffle_quality.py", *given])
    write_reports(args.out, rows, results, settings, len(split.train_y), command, wall)
    print(f"\n{len(results)} runs in {wall:.0f} s; wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
