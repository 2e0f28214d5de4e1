"""The same job read three ways on one machine: the PFS directly, dataquay, and
Mosaic StreamingDataset, every one through the same PFS cap.

    .venv/bin/pip install mosaicml-streaming torch   # Mosaic's package, into this venv only
    .venv/bin/python bench/peer_loader.py            # writes bench/results/peer_loader.json

A loopback cluster of ``NODES`` nodes, one trainer rank each; every rank sleeps
``COMPUTE_SECONDS`` per batch of ``BATCH`` samples (the GPU step) and the wait
for its next batch is its stall. The PFS is real files read at most
``PFS_BYTES_PER_SECOND`` for the whole job, split evenly between nodes:

- ``direct``: each rank reads its batches from the files with a pool of
  ``DIRECT_WORKERS`` threads, as DataLoader workers would, through a token
  bucket of its share of the cap (``data_stall``'s ``Direct``);
- ``dataquay global`` and ``dataquay partial q=0.1``: each daemon reads the PFS
  through ``--pfs-bandwidth`` of its share; staging, before the first epoch,
  is counted in that epoch's time;
- ``mosaic``: the files packed into MDS shards in a local "remote" directory;
  each rank's StreamingDataset copies shards into its own cache directory
  through a token bucket of its share of the cap (Mosaic's copy from a local
  remote, wrapped), then reads them from there.

Per system and epoch: the slowest rank's wall time, the mean data wait, stall
% and the bytes read from the PFS (counted where the cap is applied).
"""

from __future__ import annotations

import argparse
import json
import os
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

NODES = 2
SAMPLES = 1024
SIZES = (32 << 10, 64 << 10, 96 << 10)
BATCH = 16
EPOCHS = 4
#: The whole job's share of the PFS: two ranks want 2 x 1 MiB per 50 ms, about 5x this.
PFS_BYTES_PER_SECOND = 8e6
COMPUTE_SECONDS = 0.05
DIRECT_WORKERS = 4
READ_AHEAD = 4
Q = 0.1
SHARD_BYTES = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--mosaic-rank", nargs=5, metavar=("REMOTE", "LOCAL", "RANK", "EPOCHS", "RATE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.mosaic_rank:
        remote, local, rank, epochs, rate = args.mosaic_rank
        _mosaic_rank(remote, local, int(rank), int(epochs), float(rate))
        return
    samples = args.samples - args.samples % (NODES * BATCH)
    total = sum(SIZES[i % len(SIZES)] for i in range(samples))
    rows: list[EpochRow] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-peer-") as tmp:
        base = Path(tmp)
        root = make_files_dataset(base / "pfs", samples, sizes=SIZES)
        cap = f"{int(PFS_BYTES_PER_SECOND / NODES)}"
        for k, (name, mode) in enumerate(
            (("direct", ""), ("dataquay global", "global"), (f"dataquay partial q={Q}", "partial"))
        ):
            # A fresh cluster each: no system starts with another's cache.
            with LocalCluster(base / f"cluster-{k}", NODES, ("--pfs-bandwidth", cap), dataset_roots=(base,)) as cluster:
                run_or_exit("dataset", "add", "bench", str(root), "--addr", cluster.daemons[0].address)
                progress(f"{name}: {args.epochs} epochs")
                rows += _dataquay_or_direct(cluster, base, name, mode, args.epochs)
        progress(f"mosaic: {args.epochs} epochs")
        rows += _mosaic(root, base, samples, args.epochs)
    out = {
        "benchmark": "peer_loader",
        "machine": machine(),
        "argv": sys.argv,
        "nodes": NODES,
        "ranks_per_node": 1,
        "samples": samples,
        "dataset_mb": total / 1e6,
        "pfs_mb_per_s": PFS_BYTES_PER_SECOND / 1e6,
        "compute_s_per_batch": COMPUTE_SECONDS,
        "batch": BATCH,
        "direct_workers": DIRECT_WORKERS,
        "mosaic_version": _mosaic_version(),
        "rows": [asdict(r) for r in rows],
        "summary": summary(rows),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "peer_loader.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))


def _dataquay_or_direct(cluster: LocalCluster, base: Path, name: str, mode: str, epochs: int) -> list[EpochRow]:
    """``epochs`` epochs of one system; a dataquay mode's staging is part of its first epoch."""
    job = name.replace(" ", "-").replace("=", "")
    staged = staged_mb = 0.0
    if mode:
        settings = ["--mode", mode, "--batch-size", str(BATCH)] + (["--q", str(Q)] if mode == "partial" else [])
        before = _daemon_pfs_mb(cluster)
        started = time.perf_counter()
        run_or_exit(
            "stage",
            "bench",
            "--job",
            job,
            *settings,
            "--ranks-per-node",
            "1",
            "--quiet",
            "--directory",
            cluster.directory_address,
        )
        staged = time.perf_counter() - started
        staged_mb = _daemon_pfs_mb(cluster) - before
    envs = [cluster.rank_env(rank, 1, job) for rank in range(NODES)]
    direct = Direct(PFS_BYTES_PER_SECOND / NODES, DIRECT_WORKERS)
    rows = []
    with RankGroup(
        envs, "bench", base / "ranks" / job, batch=BATCH, compute_seconds=COMPUTE_SECONDS, timeout=600
    ) as ranks:
        for epoch in range(epochs):
            results = ranks.epoch(epoch, direct=None if mode else direct, read_ahead=READ_AHEAD)
            row = epoch_row(name, epoch, results, 0)
            if epoch == 0 and staged:
                # Staging read the PFS bytes the first epoch then found cached: a trainer waits for both.
                row = EpochRow(
                    **{
                        **asdict(row),
                        "wall_s": row.wall_s + staged,
                        "wait_s": row.wait_s + staged,
                        "pfs_mb": row.pfs_mb + staged_mb,
                    }
                )
                row = EpochRow(**{**asdict(row), "stall_pct": 100 * row.wait_s / row.wall_s})
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


def _mosaic(root: Path, base: Path, samples: int, epochs: int) -> list[EpochRow]:
    """Packs the files into MDS shards, then runs one StreamingDataset rank per node at once."""
    from streaming import MDSWriter
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    remote = base / "mosaic-remote"
    files = sorted(root.rglob("*.bin"), key=lambda p: p.name)
    with MDSWriter(out=str(remote), columns={"data": "bytes"}, size_limit=SHARD_BYTES) as writer:
        for path in files[:samples]:
            writer.write({"data": path.read_bytes()})
    rate = PFS_BYTES_PER_SECOND / NODES
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--mosaic-rank",
                str(remote),
                str(base / f"mosaic-cache-{rank}"),
                str(rank),
                str(epochs),
                str(rate),
            ],
            stdout=subprocess.PIPE,
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(NODES),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for rank in range(NODES)
    ]
    per_rank = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode:
            raise SystemExit(f"a Mosaic rank failed (exit {proc.returncode})")
        per_rank.append(json.loads(out.decode().strip().splitlines()[-1]))
    rows = []
    for epoch in range(epochs):
        mine = [r[epoch] for r in per_rank]
        wall = max(e["wall"] for e in mine)
        wait = sum(e["wait"] for e in mine) / len(mine)
        pfs = sum(e["pfs_bytes"] for e in mine) / 1e6
        local = sum(e["bytes"] for e in mine) / 1e6
        rows.append(
            EpochRow(
                "mosaic",
                epoch,
                wall,
                wait,
                100 * sum(e["wait"] for e in mine) / sum(e["wall"] for e in mine),
                local,
                0.0,
                pfs,
                0.0,
            )
        )
    return rows


def _mosaic_rank(remote: str, local: str, rank: int, epochs: int, rate: float) -> None:
    """One rank's epochs through StreamingDataset; prints a JSON list, one entry per epoch."""
    import shutil

    import streaming.base.shared.prefix as mosaic_prefix
    import streaming.base.storage.download as download
    from streaming import StreamingDataset

    from dataquay.server.ratelimit import TokenBucket

    bucket = TokenBucket(rate)
    copied = [0]
    copy = shutil.copy

    def capped_copy(src: str, dst: str, *args: Any, **kwargs: Any) -> Any:
        size = os.path.getsize(src)
        bucket.acquire(size)
        copied[0] += size
        return copy(src, dst, *args, **kwargs)

    download.shutil.copy = capped_copy  # type: ignore[assignment]
    # Each rank stands for a node of its own, but they share this host's /dev/shm, where Mosaic's
    # local leaders would all pick the same free prefix: each rank takes its own.
    find_prefix = mosaic_prefix._check_and_find_retrying

    def own_prefix(*args: Any, **kwargs: Any) -> int:
        return int(find_prefix(*args, **kwargs)) + rank

    mosaic_prefix._check_and_find_retrying = own_prefix
    dataset = StreamingDataset(remote=remote, local=local, batch_size=BATCH, shuffle=True, shuffle_seed=7)
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=BATCH, num_workers=0, collate_fn=lambda b: b)
    out = []
    for _ in range(epochs):
        before = copied[0]
        wait = 0.0
        nbytes = 0
        started = time.perf_counter()
        fetched = time.perf_counter()
        for batch in loader:
            wait += time.perf_counter() - fetched
            nbytes += sum(len(s["data"]) for s in batch)
            time.sleep(COMPUTE_SECONDS)
            fetched = time.perf_counter()
        wall = time.perf_counter() - started
        out.append({"wall": wall, "wait": wait, "bytes": nbytes, "pfs_bytes": copied[0] - before})
    print(json.dumps(out), flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _mosaic_version() -> str:
    from importlib.metadata import version

    return version("mosaicml-streaming")


# ---------------------------------------------------------------- summary


def summary(rows: list[EpochRow]) -> dict[str, dict[str, float]]:
    """Per system: first epoch, mean later epoch, whole job, PFS MB and mean stall; ratios to direct and Mosaic."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r.system for r in rows):
        mine = sorted((r for r in rows if r.system == name), key=lambda r: r.epoch)
        later = mine[1:]
        out[name] = {
            "first_epoch_s": mine[0].wall_s,
            "later_epoch_s": sum(r.wall_s for r in later) / len(later),
            "job_s": sum(r.wall_s for r in mine),
            "pfs_mb": sum(r.pfs_mb for r in mine),
            "later_stall_pct": sum(r.stall_pct for r in later) / len(later),
        }
    for figures in out.values():
        for baseline in ("direct", "mosaic"):
            if baseline in out:
                figures[f"job_speedup_vs_{baseline}"] = out[baseline]["job_s"] / figures["job_s"]
                figures[f"later_speedup_vs_{baseline}"] = out[baseline]["later_epoch_s"] / figures["later_epoch_s"]
    return out


if __name__ == "__main__":
    main()
