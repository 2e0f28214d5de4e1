"""The first epoch against reading the PFS directly: staging first, or training while staging.

    .venv/bin/python bench/train_while_staging.py             # the results page's scenario, 8,192 samples
    .venv/bin/python bench/train_while_staging.py --samples 2048

A loopback cluster of ``NODES`` nodes, one trainer rank each, mode ``local``,
samples of ``SIZE`` bytes, the PFS read at most ``PFS_BYTES_PER_NODE`` per
node by every system (no compute: pure loading):

- ``direct``: each rank reads its batches from the files with a pool of
  ``DIRECT_WORKERS`` threads through a token bucket of its node's cap;
- ``stage first``: ``dataquay stage --job`` to the end, then the epochs;
  staging's time and PFS bytes count in epoch 0;
- ``train while staging``: ``dataquay stage --job --background``, the
  ranks start at once; what is not cached yet each daemon reads as its rank
  needs it, and staging skips it.

Per system and epoch: the slowest rank's wall time and the PFS MB (from the
daemons' counters for dataquay: every byte read over staging and the epoch),
and epoch 0 against direct's, the target being 1.05x for training while staging.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from common import RESULTS, machine, progress
from peer_loader import _daemon_pfs_mb

from dataquay.server.tools.data_stall import EpochRow, epoch_row, run_or_exit
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import Direct, RankGroup

NODES = 4
SAMPLES = 8192
SIZE = 110 << 10
BATCH = 32
EPOCHS = 2
PFS_BYTES_PER_NODE = 25 << 20
DIRECT_WORKERS = 4
READ_AHEAD = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--prefetch-memory", help="the daemons' --prefetch-memory (default theirs)")
    args = parser.parse_args()
    samples = args.samples - args.samples % (NODES * BATCH)
    rows: list[EpochRow] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-tws-") as tmp:
        base = Path(tmp)
        root = make_files_dataset(base / "pfs", samples, sizes=(SIZE,))
        for k, (name, how) in enumerate(
            (("direct", ""), ("stage first", "first"), ("train while staging", "background"))
        ):
            cap = ("--pfs-bandwidth", str(PFS_BYTES_PER_NODE))
            if args.prefetch_memory is not None:
                cap += ("--prefetch-memory", args.prefetch_memory)
            with LocalCluster(base / f"cluster-{k}", NODES, cap, dataset_roots=(base,)) as cluster:
                run_or_exit("dataset", "add", "bench", str(root), "--addr", cluster.daemons[0].address)
                progress(f"{name}: {args.epochs} epochs")
                rows += _system(cluster, base, name, how, args.epochs)
    direct0 = next(r.wall_s for r in rows if r.system == "direct" and r.epoch == 0)
    summary = {
        r.system: {"epoch0_s": r.wall_s, "epoch0_vs_direct": r.wall_s / direct0, "epoch0_pfs_mb": r.pfs_mb}
        for r in rows
        if r.epoch == 0
    }
    out = {
        "benchmark": "train_while_staging",
        "machine": machine(),
        "argv": sys.argv,
        "nodes": NODES,
        "ranks_per_node": 1,
        "samples": samples,
        "dataset_mb": samples * SIZE / 1e6,
        "pfs_mb_per_s_per_node": PFS_BYTES_PER_NODE / 1e6,
        "prefetch_memory": args.prefetch_memory,
        "rows": [asdict(r) for r in rows],
        "summary": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_while_staging.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))


def _system(cluster: LocalCluster, base: Path, name: str, how: str, epochs: int) -> list[EpochRow]:
    """``epochs`` epochs of one system; the time `stage` took to return and every
    PFS byte the daemons read up to the end of epoch 0 count in epoch 0."""
    job = name.replace(" ", "-")
    staged = 0.0
    started = time.perf_counter()
    if how:
        stage = ["stage", "bench", "--job", job, "--mode", "local", "--batch-size", str(BATCH)]
        stage += ["--ranks-per-node", "1", "--quiet", "--directory", cluster.directory_address]
        run_or_exit(*stage, *(["--background"] if how == "background" else []))
        staged = time.perf_counter() - started
    envs = [cluster.rank_env(rank, 1, job) for rank in range(NODES)]
    direct = Direct(PFS_BYTES_PER_NODE, DIRECT_WORKERS)
    rows = []
    with RankGroup(envs, "bench", base / "ranks" / job, batch=BATCH, compute_seconds=0.0, timeout=900) as ranks:
        for epoch in range(epochs):
            results = ranks.epoch(epoch, direct=None if how else direct, read_ahead=READ_AHEAD)
            row = epoch_row(name, epoch, results, 0)
            if how:
                pfs = _daemon_pfs_mb(cluster) - sum(r.pfs_mb for r in rows)
                row = EpochRow(**{**asdict(row), "pfs_mb": pfs})
            if epoch == 0 and how:  # the user waits for `stage` (to the end, or to its start) first
                row = EpochRow(**{**asdict(row), "wall_s": row.wall_s + staged, "wait_s": row.wait_s + staged})
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
