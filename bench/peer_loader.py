"""The same job read three ways on one machine: the PFS directly, dataquay, and
Mosaic StreamingDataset, every one through the same PFS cap.

    .venv/bin/python bench/peer_loader.py                     # about 8 minutes on 2 cores
    .venv/bin/python bench/peer_loader.py --cache-share 0.6   # caches short of a node's share: 14 minutes

Mosaic runs in a virtual environment of its own, ``bench/.venv-mosaic``, which
this script makes (``MOSAIC_PACKAGES``) the first time: Mosaic pins numpy and
pulls in torch, and neither may change dataquay's environment.

A loopback cluster of ``NODES`` nodes, one trainer rank each; every rank sleeps
``--compute`` seconds per batch of ``BATCH`` samples (none by default: pure
loading) and the wait for its next batch is its stall. The PFS is real files
read at most ``PFS_BYTES_PER_NODE`` per node by every system, counted where
the cap is applied; every node's cache holds ``--cache-share`` of a node's
share of the dataset:

- ``direct``: each rank reads its batches from the files with a pool of
  ``DIRECT_WORKERS`` threads, as DataLoader workers would, through a token
  bucket of its node's cap (``data_stall``'s ``Direct``);
- ``dataquay local``, ``partial q=0.1`` and ``global``: each daemon reads the
  PFS through ``--pfs-bandwidth`` of the cap and ``--cache-size`` of the
  cache; the ranks train while staging (``stage --background``), so epoch 0
  includes the time ``stage`` takes to return;
- ``mosaic``: the files packed into MDS shards of ``SHARD_BYTES`` in a local
  "remote" directory; each rank's StreamingDataset copies shards into its own
  cache directory through a token bucket of its node's cap (Mosaic's copy
  from a local remote, wrapped), with ``cache_limit`` the cache, then reads
  them from there.

Each of ``--runs`` runs takes every system in turn, each on a fresh cluster
and cache; the summary gives per system the median over runs of its epoch
times and of its job time against direct's and Mosaic's in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import RESULTS, machine, progress

from dataquay.server.tools.data_stall import EpochRow, epoch_row, run_or_exit
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import Direct, RankGroup

NODES = 4
SAMPLES = 8192
SIZE = 110 << 10
BATCH = 32
EPOCHS = 4
RUNS = 3
PFS_BYTES_PER_NODE = 25 << 20
DIRECT_WORKERS = 4
READ_AHEAD = 4
Q = 0.1
#: Small shards, so that a Mosaic node copies few bytes it does not need.
SHARD_BYTES = 1 << 20
#: (name, mode) of every system but Mosaic, in the order each run takes them.
SYSTEMS = (
    ("direct", ""),
    ("dataquay local", "local"),
    (f"dataquay partial q={Q}", "partial"),
    ("dataquay global", "global"),
)
BENCH = Path(__file__).resolve().parent
MOSAIC_VENV = BENCH / ".venv-mosaic"
#: Mosaic imports torchvision, which loads only beside the torch it was built for.
MOSAIC_PACKAGES = ("mosaicml-streaming==0.13.0", "torch==2.14.1", "torchvision==0.29.1")
MOSAIC_LOADER = BENCH / "mosaic_loader.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of compute per batch")
    parser.add_argument("--cache-share", type=float, default=1.2, help="each node's cache, in node shares")
    args = parser.parse_args()
    python = mosaic_python()
    samples = args.samples - args.samples % (NODES * BATCH)
    dataset_bytes = samples * SIZE
    cache = int(args.cache_share * dataset_bytes / NODES)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-peer-") as tmp:
        base = Path(tmp)
        root = make_files_dataset(base / "pfs", samples, sizes=(SIZE,))
        remote = base / "mosaic-remote"
        mosaic(python, "pack", root, remote, SHARD_BYTES)
        for run in range(args.runs):
            for name, mode in SYSTEMS:
                # A fresh cluster each: no system starts with another's cache.
                home = base / f"run-{run}" / name.replace(" ", "-")
                settings = ("--pfs-bandwidth", str(PFS_BYTES_PER_NODE), "--cache-size", str(cache))
                with LocalCluster(home / "cluster", NODES, settings, dataset_roots=(base,)) as cluster:
                    run_or_exit("dataset", "add", "bench", str(root), "--addr", cluster.daemons[0].address)
                    progress(f"run {run + 1}/{args.runs}, {name}: {args.epochs} epochs")
                    epochs = _dataquay_or_direct(cluster, home, name, mode, args.epochs, args.compute)
                rows += [{"run": run, **asdict(r)} for r in epochs]
            progress(f"run {run + 1}/{args.runs}, mosaic: {args.epochs} epochs")
            epochs = _mosaic(python, remote, base / f"run-{run}" / "mosaic", args.epochs, cache, args.compute)
            rows += [{"run": run, **asdict(r)} for r in epochs]
    out = {
        "benchmark": "peer_loader",
        "machine": machine(),
        "argv": sys.argv,
        "nodes": NODES,
        "ranks_per_node": 1,
        "samples": samples,
        "sample_bytes": SIZE,
        "dataset_mb": dataset_bytes / 1e6,
        "pfs_mb_per_s_per_node": PFS_BYTES_PER_NODE / 1e6,
        "cache_share": args.cache_share,
        "cache_mb": cache / 1e6,
        "compute_s_per_batch": args.compute,
        "batch": BATCH,
        "direct_workers": DIRECT_WORKERS,
        "mosaic_shard_bytes": SHARD_BYTES,
        "mosaic_packages": _mosaic_versions(python),
        "rows": rows,
        "summary": summary(rows),
    }
    RESULTS.mkdir(exist_ok=True)
    name = "peer_loader.json" if args.cache_share >= 1 else "peer_loader-short.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))


def mosaic_python() -> Path:
    """Mosaic's interpreter, installing ``MOSAIC_PACKAGES`` into its virtual
    environment first unless an install of exactly these completed there."""
    python, installed = MOSAIC_VENV / "bin" / "python", MOSAIC_VENV / "installed.txt"
    wanted = "\n".join(MOSAIC_PACKAGES) + "\n"
    if not installed.exists() or installed.read_text() != wanted:
        progress(f"installing {', '.join(MOSAIC_PACKAGES)} into {MOSAIC_VENV} (a few minutes, once)")
        subprocess.run([sys.executable, "-m", "venv", str(MOSAIC_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        if subprocess.run([*pip, *MOSAIC_PACKAGES]).returncode:
            raise SystemExit(f"installing {' '.join(MOSAIC_PACKAGES)} into {MOSAIC_VENV} failed (see above)")
        installed.write_text(wanted)
    return python


def mosaic(python: Path, *args: object, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Runs bench/mosaic_loader.py in Mosaic's environment; a failure ends the benchmark."""
    done: subprocess.CompletedProcess[str] = subprocess.run(
        [str(python), str(MOSAIC_LOADER), *map(str, args)], text=True, **kwargs
    )
    if done.returncode:
        raise SystemExit(f"mosaic_loader.py {args[0]} failed (exit {done.returncode})")
    return done


def _dataquay_or_direct(
    cluster: LocalCluster, home: Path, name: str, mode: str, epochs: int, compute: float
) -> list[EpochRow]:
    """``epochs`` epochs of one system; with a dataquay mode, the time `stage
    --background` takes to return and every PFS byte the daemons read up to
    the end of an epoch count in that epoch."""
    job = name.replace(" ", "-").replace("=", "")
    started = time.perf_counter()
    if mode:
        settings = ["--mode", mode, "--batch-size", str(BATCH)] + (["--q", str(Q)] if mode == "partial" else [])
        stage = ["stage", "bench", "--job", job, *settings, "--ranks-per-node", "1", "--quiet", "--background"]
        run_or_exit(*stage, "--directory", cluster.directory_address)
    staged = time.perf_counter() - started
    envs = [cluster.rank_env(rank, 1, job) for rank in range(NODES)]
    direct = Direct(PFS_BYTES_PER_NODE, DIRECT_WORKERS)
    rows: list[EpochRow] = []
    with RankGroup(envs, "bench", home / "ranks", batch=BATCH, compute_seconds=compute, timeout=900) as ranks:
        for epoch in range(epochs):
            results = ranks.epoch(epoch, direct=None if mode else direct, read_ahead=READ_AHEAD)
            row = epoch_row(name, epoch, results, 0)
            if mode:
                row = EpochRow(**{**asdict(row), "pfs_mb": _daemon_pfs_mb(cluster) - sum(r.pfs_mb for r in rows)})
            if epoch == 0 and staged:
                wall, wait = row.wall_s + staged, row.wait_s + staged
                row = EpochRow(**{**asdict(row), "wall_s": wall, "wait_s": wait, "stall_pct": 100 * wait / wall})
            rows.append(row)
    return rows


def _daemon_pfs_mb(cluster: LocalCluster) -> float:
    """PFS MB every daemon has read so far."""
    import grpc

    from dataquay.client.wire.channels import channel_options
    from dataquay.protos import cache_pb2 as pb
    from dataquay.protos import cache_pb2_grpc

    total = 0
    for daemon in cluster.daemons:
        assert daemon.ready is not None
        with grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()) as channel:
            stats = cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10)
        total += stats.pfs_bytes
    return total / 1e6


# ---------------------------------------------------------------- Mosaic


def _mosaic(python: Path, remote: Path, home: Path, epochs: int, cache: int, compute: float) -> list[EpochRow]:
    """``epochs`` epochs of one StreamingDataset rank per node, all at once, each in a process of its own."""
    subprocess.run(
        [str(python), "-c", "from streaming.base.util import clean_stale_shared_memory as c; c()"], check=True
    )
    port = _free_port()
    procs = []
    for rank in range(NODES):
        args = (remote, home / f"cache-{rank}", rank, epochs, PFS_BYTES_PER_NODE, cache, BATCH, compute)
        env = {"RANK": str(rank), "WORLD_SIZE": str(NODES), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        command = [str(python), str(MOSAIC_LOADER), "rank", *map(str, args)]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, env={**os.environ, **env}))
    per_rank = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode:
            raise SystemExit(f"a Mosaic rank failed (exit {proc.returncode})")
        per_rank.append(json.loads(out.decode().strip().splitlines()[-1]))
    rows = []
    for epoch in range(epochs):
        mine = [r[epoch] for r in per_rank]
        wait = sum(e["wait"] for e in mine) / len(mine)
        stall = 100 * sum(e["wait"] for e in mine) / sum(e["wall"] for e in mine)
        local_mb, pfs_mb = (sum(e[key] for e in mine) / 1e6 for key in ("bytes", "pfs_bytes"))
        rows.append(EpochRow("mosaic", epoch, max(e["wall"] for e in mine), wait, stall, local_mb, 0.0, pfs_mb, 0.0))
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _mosaic_versions(python: Path) -> dict[str, str]:
    """The versions of the packages the Mosaic ranks ran with."""
    names = [package.split("==")[0] for package in MOSAIC_PACKAGES]
    versions: dict[str, str] = json.loads(mosaic(python, "versions", *names, capture_output=True).stdout)
    return versions


# ---------------------------------------------------------------- summary


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per system, the median over runs of: first epoch, mean later epoch,
    whole job, PFS MB and later stall; and of its job and later epochs' speed
    against direct's and Mosaic's in the same run (each run's ratio, then
    the median), with the range of the job ratios."""
    per_run: dict[str, list[dict[str, float]]] = {}
    for run in sorted({r["run"] for r in rows}):
        in_run = [r for r in rows if r["run"] == run]
        for name in dict.fromkeys(r["system"] for r in in_run):
            epochs = sorted((r for r in in_run if r["system"] == name), key=lambda r: r["epoch"])
            later = epochs[1:]
            per_run.setdefault(name, []).append(
                {
                    "first_epoch_s": epochs[0]["wall_s"],
                    "later_epoch_s": statistics.fmean(r["wall_s"] for r in later),
                    "job_s": sum(r["wall_s"] for r in epochs),
                    "pfs_mb": sum(r["pfs_mb"] for r in epochs),
                    "later_stall_pct": statistics.fmean(r["stall_pct"] for r in later),
                }
            )
    for runs in per_run.values():
        for baseline in ("direct", "mosaic"):
            for mine, theirs in zip(runs, per_run.get(baseline, [])):
                mine[f"job_speedup_vs_{baseline}"] = theirs["job_s"] / mine["job_s"]
                mine[f"later_speedup_vs_{baseline}"] = theirs["later_epoch_s"] / mine["later_epoch_s"]
    out: dict[str, dict[str, float]] = {}
    for name, runs in per_run.items():
        figures = out[name] = {key: statistics.median(f[key] for f in runs) for key in runs[0]}
        for baseline in ("direct", "mosaic"):
            if f"job_speedup_vs_{baseline}" in runs[0]:
                ratios = [f[f"job_speedup_vs_{baseline}"] for f in runs]
                figures[f"job_speedup_vs_{baseline}_min"] = min(ratios)
                figures[f"job_speedup_vs_{baseline}_max"] = max(ratios)
    return out


if __name__ == "__main__":
    main()
