"""``dataquay bench overflow``: trainers on a dataset larger than the cluster's caches.

A loopback cluster of 4 nodes and 8 simulated ranks (2 per node) runs a
``local`` job over a dataset 1.5 times the caches' sum: every node holds two
thirds of its share, and the third it could not cache (the overflow) must
come from the PFS every epoch. The PFS is real files behind each daemon's
bandwidth cap (``--pfs-bandwidth``), and each rank sleeps a fixed time per
batch standing for the GPU step, chosen once staging measured the overflow
so that the PFS can deliver a node's overflow within 80% of an epoch:
reading it in time is possible, but only by keeping the PFS busy most of
the epoch. The systems:

1. ``dataquay, read ahead``: the daemons read the overflow from the PFS
   ahead of the ranks, in their order (the default ``--prefetch-memory``);
2. ``dataquay, on demand``: the same daemons with ``--prefetch-memory 0``,
   so the overflow is read when a rank misses (as before the read ahead);
3. ``direct``: each rank reads its batches straight from the PFS with a pool
   of worker threads, through its share of the same total cap.

The dataquay clients read 4 batches ahead and the direct ranks run 4
workers, as in ``dataquay bench``. Per epoch and system: wall time, data
wait per rank, stall % (wait / wall), what came from the PFS, and what the
daemons read ahead, served from it and wasted. The bound is the PFS time a
node's overflow needs (its bytes over the node's cap) against the epoch's
compute time; for ``direct``, a rank's bytes over its share of the cap.
Results go to bench/results/overflow.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.processes import run_command
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import Direct, RankEpoch, RankGroup

NODES = 4
RANKS_PER_NODE = 2
SIZES = (64 << 10, 96 << 10, 128 << 10)
BATCH = 8
#: The dataset over the sum of the caches.
OVERSIZE = 1.5
#: The PFS time a node's overflow needs, as a share of an epoch's compute time.
BOUND = 0.8
#: Payload an LMDB map of the cache's size holds (the rest is pages' overhead), about.
_MAP_FILL = 0.95
READ_AHEAD = 4
DIRECT_WORKERS = 4
JOB = "overflow"


@dataclass(frozen=True)
class EpochRow:
    system: str
    epoch: int
    wall_s: float
    wait_s: float
    stall_pct: float
    pfs_mb: float  #: what the daemons (or the direct ranks) read from the PFS
    read_ahead_mb: float  #: read from the PFS ahead of the ranks
    served_ahead_mb: float  #: handed to the ranks from what was read ahead
    wasted_mb: float  #: read ahead and dropped unread
    bound_pct: float  #: PFS time the epoch's reads from it need, % of its compute time


@dataclass(frozen=True)
class OverflowRun:
    """One run: the setting, as measured, and a row per system and epoch."""

    samples: int
    dataset_mb: float
    nodes: int
    ranks_per_node: int
    batch: int
    steps_per_epoch: int
    compute_s_per_batch: float
    compute_s_per_epoch: float
    cache_mb_per_node: float  #: --cache-size
    cached_mb: float  #: what the caches hold after staging, all nodes
    dataset_over_cached: float
    overflow_mb_per_node: list[float]
    pfs_mb_per_s_per_node: float  #: --pfs-bandwidth
    bound_s: float  #: the largest overflow over its node's cap
    bound_pct: float  #: bound_s, % of compute_s_per_epoch
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    seconds: float
    rows: list[EpochRow]


def run_benchmark(samples: int, epochs: int, epoch_seconds: float, out_dir: Path, progress: bool = True) -> OverflowRun:
    """Runs the three systems, their epochs about ``epoch_seconds`` long;
    writes overflow.json to ``out_dir``."""
    world = NODES * RANKS_PER_NODE
    samples -= samples % (world * BATCH)
    total = sum(SIZES[i % len(SIZES)] for i in range(samples))
    steps = samples // (world * BATCH)
    cache = int(total / OVERSIZE / NODES)
    # The cap that delivers a node's overflow (as it will about be) in BOUND of an epoch.
    cap = int((total / NODES - _MAP_FILL * cache) / (BOUND * epoch_seconds))
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[EpochRow] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-bench-") as tmp:
        base = Path(tmp)
        root = make_files_dataset(base / "pfs", samples, sizes=SIZES)
        daemon_args = ("--pfs-bandwidth", str(cap), "--cache-size", str(cache))
        with LocalCluster(base / "cluster", NODES, daemon_args, dataset_roots=(base,)) as cluster:
            _run("dataset", "add", "bench", str(root), "--addr", cluster.daemons[0].address)
            staging = time.perf_counter()
            _run(
                "stage",
                "bench",
                "--job",
                JOB,
                "--mode",
                "local",
                "--ranks-per-node",
                str(RANKS_PER_NODE),
                "--quiet",
                "--directory",
                cluster.directory_address,
            )
            staging = time.perf_counter() - staging
            shares = [_staged(cluster, i) for i in range(NODES)]
            overflows = [share - cached for share, cached in shares]
            # The compute per batch with which the largest overflow takes BOUND of an epoch at the cap.
            compute = max(overflows) / cap / BOUND / steps
            bound = max(overflows) / cap / (steps * compute)
            say = print if progress else (lambda *_: None)
            say(
                f"  .. {samples} samples, {total / 1e6:.0f} MB; the caches hold {sum(c for _, c in shares) / 1e6:.0f}"
                f" MB; PFS {cap * NODES / 1e6:.1f} MB/s; staged in {staging:.0f} s"
            )
            # One job throughout: each system reads epochs of its own, whose orders differ but whose
            # overflow (under local) is the same samples.
            say(f"  .. dataquay, read ahead: {epochs} epochs")
            rows += _dataquay(cluster, base, "dataquay, read ahead", range(epochs), compute, bound)
            cluster.daemon_args = (*daemon_args, "--prefetch-memory", "0")
            for index in range(NODES):
                cluster.restart_node(index)
            say(f"  .. dataquay, on demand: {epochs} epochs")
            rows += _dataquay(cluster, base, "dataquay, on demand", range(epochs, 2 * epochs), compute, bound)
            say("  .. direct: 1 epoch")
            rows += _direct(cluster, base, 2 * epochs, cap * NODES / world, total / world, compute, steps)
    cached = sum(c for _, c in shares)
    run = OverflowRun(
        samples=samples,
        dataset_mb=total / 1e6,
        nodes=NODES,
        ranks_per_node=RANKS_PER_NODE,
        batch=BATCH,
        steps_per_epoch=steps,
        compute_s_per_batch=compute,
        compute_s_per_epoch=steps * compute,
        cache_mb_per_node=cache / 1e6,
        cached_mb=cached / 1e6,
        dataset_over_cached=total / cached,
        overflow_mb_per_node=[o / 1e6 for o in overflows],
        pfs_mb_per_s_per_node=cap / 1e6,
        bound_s=max(overflows) / cap,
        bound_pct=100 * bound,
        load_before=load_before,
        load_after=os.getloadavg(),
        seconds=time.perf_counter() - started,
        rows=rows,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "overflow.json").write_text(json.dumps({"benchmark": "overflow", **asdict(run)}, indent=1))
    return run


def _dataquay(
    cluster: LocalCluster, base: Path, name: str, epochs: range, compute: float, bound: float
) -> list[EpochRow]:
    envs = [cluster.rank_env(rank, RANKS_PER_NODE, JOB) for rank in range(NODES * RANKS_PER_NODE)]
    rows = []
    log_dir = base / "ranks" / name.replace(" ", "").replace(",", "-")
    with RankGroup(envs, "bench", log_dir, batch=BATCH, compute_seconds=compute, timeout=600) as ranks:
        for epoch in epochs:
            before = _stats(cluster)
            results = ranks.epoch(epoch, read_ahead=READ_AHEAD)
            after = _stats(cluster)

            def mb(field: str) -> float:
                return sum(getattr(a.prefetch, field) - getattr(b.prefetch, field) for a, b in zip(after, before)) / 1e6

            pfs = sum(a.pfs_bytes - b.pfs_bytes for a, b in zip(after, before)) / 1e6
            rows.append(
                _row(
                    name,
                    epoch - epochs.start,
                    results,
                    pfs,
                    mb("overflow_read_bytes"),
                    mb("overflow_served_bytes"),
                    mb("overflow_wasted_bytes"),
                    bound,
                )
            )
    return rows


def _direct(
    cluster: LocalCluster, base: Path, epoch: int, rank_cap: float, rank_bytes: float, compute: float, steps: int
) -> list[EpochRow]:
    envs = [cluster.rank_env(rank, RANKS_PER_NODE, JOB) for rank in range(NODES * RANKS_PER_NODE)]
    with RankGroup(
        envs, "bench", base / "ranks" / "direct", batch=BATCH, compute_seconds=compute, timeout=600
    ) as ranks:
        results = ranks.epoch(epoch, direct=Direct(rank_cap, DIRECT_WORKERS))
    pfs = sum(r.bytes.get("direct", 0) for r in results) / 1e6
    return [_row("direct", 0, results, pfs, 0.0, 0.0, 0.0, rank_bytes / rank_cap / (steps * compute))]


def _row(
    name: str,
    epoch: int,
    results: list[RankEpoch],
    pfs_mb: float,
    ahead: float,
    served: float,
    wasted: float,
    bound: float,
) -> EpochRow:
    wall = sum(r.wall_seconds for r in results)
    wait = sum(r.wait_seconds for r in results)
    return EpochRow(
        system=name,
        epoch=epoch,
        wall_s=max(r.wall_seconds for r in results),
        wait_s=wait / len(results),
        stall_pct=100 * wait / wall if wall else 0.0,
        pfs_mb=pfs_mb,
        read_ahead_mb=ahead,
        served_ahead_mb=served,
        wasted_mb=wasted,
        bound_pct=100 * bound,
    )


def _staged(cluster: LocalCluster, index: int) -> tuple[int, int]:
    """(bytes of node ``index``'s share, bytes of it its cache holds)."""
    (stats,) = _stats(cluster, [index])
    run = next(s for s in stats.staging if s.dataset == "bench")
    return run.total_bytes, run.done_bytes


def _stats(cluster: LocalCluster, indexes: list[int] | None = None) -> list[pb.StatsReply]:
    out = []
    for index in range(NODES) if indexes is None else indexes:
        ready = cluster.daemons[index].ready
        assert ready is not None
        with grpc.insecure_channel(ready["tcp"], options=channel_options()) as channel:
            out.append(cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10))
    return out


def _run(*argv: str) -> None:
    if run_command(*argv):
        raise SystemExit(f"dataquay {' '.join(argv)} failed")


def print_table(rows: list[EpochRow]) -> None:
    header = (
        "system",
        "epoch",
        "wall s",
        "wait s",
        "stall %",
        "PFS MB",
        "ahead MB",
        "served MB",
        "wasted MB",
        "bound %",
    )
    cells = [
        (
            r.system,
            r.epoch,
            f"{r.wall_s:.2f}",
            f"{r.wait_s:.2f}",
            f"{r.stall_pct:.1f}",
            f"{r.pfs_mb:.0f}",
            f"{r.read_ahead_mb:.0f}",
            f"{r.served_ahead_mb:.0f}",
            f"{r.wasted_mb:.0f}",
            f"{r.bound_pct:.0f}",
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *cells)]
    for line in (header, *cells):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def main(quick: bool, out_dir: Path) -> OverflowRun:
    started = time.perf_counter()
    run = run_benchmark(768 if quick else 1536, 2, 4.0 if quick else 10.0, out_dir)
    print(
        f"  dataset {run.dataset_mb:.0f} MB = {run.dataset_over_cached:.2f} x what the caches hold; "
        f"overflow {max(run.overflow_mb_per_node):.1f} MB a node at {run.pfs_mb_per_s_per_node:.2f} MB/s = "
        f"{run.bound_s:.1f} s of a {run.compute_s_per_epoch:.1f} s epoch ({run.bound_pct:.0f}%)\n"
    )
    print_table(run.rows)
    load = ", ".join(f"{x:.2f}" for x in run.load_before), ", ".join(f"{x:.2f}" for x in run.load_after)
    print(
        f"\n({time.perf_counter() - started:.0f} s; load average {load[0]} before, {load[1]} after; "
        f"results in {out_dir}/overflow.json)"
    )
    return run
