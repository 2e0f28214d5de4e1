"""``dataquay bench``: how long trainers wait for data, with and without dataquay.

A loopback cluster of 4 nodes and 8 simulated trainer ranks (2 per node).
The PFS is real files behind a bandwidth cap (``PFS_BYTES_PER_SECOND`` for the
whole cluster, as on a busy shared file system), and each rank sleeps a fixed
time per batch standing for the GPU step, chosen so that compute alone would
need the PFS to deliver several times its cap. Per epoch and system: wall
time, data wait (time a rank waited for its next batch) and stall % (wait /
wall), and where the bytes came from. The systems:

1. ``direct``: each rank reads its batches straight from the PFS with a pool
   of worker threads (a plain DataLoader), through its share of the cap;
2. ``page cache``: the same, behind a page cache half the dataset's size
   (emulated: an LRU of whole samples per rank of 1/(2 x ranks) of the
   dataset, since an unprivileged run cannot give the real OS page cache a
   budget);
3.-6. dataquay ``global``, ``partial`` (q = 0.1 drawn), ``local`` and ``locality``,
   staged once through the same cap, with the client reading 4 batches ahead;
7. dataquay ``global`` without read-ahead, to show what it hides.

"Network" is what crossed between nodes: the ranks' peer reads plus the
exchange's bytes. Results go to bench/results/stall.json and stall.png
(matplotlib, an optional extra).
"""

from __future__ import annotations

import json
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
SIZES = (32 << 10, 64 << 10, 96 << 10)
BATCH = 16
#: The whole cluster's share of the PFS.
PFS_BYTES_PER_SECOND = 40e6
#: The simulated GPU step per batch: 8 ranks x 1 MiB per 50 ms is about 4x the PFS cap.
COMPUTE_SECONDS = 0.05
DIRECT_WORKERS = 4
READ_AHEAD = 4
Q = 0.1


@dataclass(frozen=True)
class System:
    name: str
    mode: str = ""  # a dataquay job's mode; "" reads the PFS directly
    page_cache: bool = False
    read_ahead: int = READ_AHEAD


SYSTEMS = (
    System("direct"),
    System("page cache", page_cache=True),
    System("dataquay global", "global"),
    System(f"dataquay partial q={Q}", "partial"),
    System("dataquay local", "local"),
    System("dataquay locality", "locality"),
    System("dataquay global, no read-ahead", "global", read_ahead=0),
)


@dataclass(frozen=True)
class EpochRow:
    system: str
    epoch: int
    wall_s: float
    wait_s: float
    stall_pct: float
    local_mb: float
    peer_mb: float
    pfs_mb: float
    network_mb: float


def run_benchmark(samples: int, epochs: int, out_dir: Path, progress: bool = True) -> list[EpochRow]:
    """Runs every system for ``epochs`` epochs; writes stall.json to ``out_dir``."""
    world = NODES * RANKS_PER_NODE
    samples -= samples % (world * BATCH)
    total = sum(SIZES[i % len(SIZES)] for i in range(samples))
    rows: list[EpochRow] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-bench-") as tmp:
        base = Path(tmp)
        root = make_files_dataset(base / "pfs", samples, sizes=SIZES)
        cap = f"{int(PFS_BYTES_PER_SECOND / NODES)}"
        with LocalCluster(base / "cluster", NODES, ("--pfs-bandwidth", cap), dataset_roots=(base,)) as cluster:
            run_or_exit("dataset", "add", "bench", str(root), "--addr", cluster.daemons[0].address)
            for system in SYSTEMS:
                if progress:
                    print(f"  .. {system.name}: {epochs} epochs", flush=True)
                rows += _run_system(cluster, base, system, epochs, total, samples)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stall.json").write_text(
        json.dumps(
            {
                "benchmark": "stall",
                "samples": samples,
                "dataset_mb": total / 1e6,
                "pfs_mb_per_s": PFS_BYTES_PER_SECOND / 1e6,
                "compute_s_per_batch": COMPUTE_SECONDS,
                "batch": BATCH,
                "rows": [asdict(r) for r in rows],
            },
            indent=1,
        )
    )
    return rows


def _run_system(
    cluster: LocalCluster, base: Path, system: System, epochs: int, total: int, samples: int
) -> list[EpochRow]:
    job = system.name.replace(" ", "-").replace(",", "").replace("=", "")
    if system.mode:
        settings = ["--mode", system.mode, "--batch-size", str(BATCH)]
        if system.mode == "partial":
            settings += ["--q", str(Q)]
        run_or_exit(
            "stage",
            "bench",
            "--job",
            job,
            *settings,
            "--ranks-per-node",
            str(RANKS_PER_NODE),
            "--quiet",
            "--directory",
            cluster.directory_address,
        )
    world = NODES * RANKS_PER_NODE
    envs = [cluster.rank_env(rank, RANKS_PER_NODE, job) for rank in range(world)]
    direct = Direct(PFS_BYTES_PER_SECOND / world, DIRECT_WORKERS, total // (2 * world) if system.page_cache else 0)
    rows = []
    with RankGroup(
        envs, "bench", base / "ranks" / job, batch=BATCH, compute_seconds=COMPUTE_SECONDS, timeout=600
    ) as ranks:
        for epoch in range(epochs):
            exchanged = _exchange_bytes(cluster)
            results = ranks.epoch(epoch, direct=None if system.mode else direct, read_ahead=system.read_ahead)
            rows.append(epoch_row(system.name, epoch, results, _exchange_bytes(cluster) - exchanged))
    return rows


def epoch_row(name: str, epoch: int, results: list[RankEpoch], exchanged: int) -> EpochRow:
    def mb(*tiers: str) -> float:
        return sum(r.bytes.get(t, 0) for r in results for t in tiers) / 1e6

    wall = sum(r.wall_seconds for r in results)
    wait = sum(r.wait_seconds for r in results)
    peer = mb("peer")
    return EpochRow(
        system=name,
        epoch=epoch,
        wall_s=max(r.wall_seconds for r in results),
        wait_s=wait / len(results),
        stall_pct=100 * wait / wall if wall else 0.0,
        local_mb=mb("local", "cache", "page-cache"),
        peer_mb=peer,
        pfs_mb=mb("pfs", "fallback", "direct"),
        network_mb=peer + exchanged / 1e6,
    )


def _exchange_bytes(cluster: LocalCluster) -> int:
    """Bytes every daemon has received in exchanges so far."""
    total = 0
    for daemon in cluster.daemons:
        assert daemon.ready is not None
        with grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()) as channel:
            stats = cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10)
        total += stats.exchange_received_bytes
    return total


def run_or_exit(*argv: str) -> None:
    """Runs ``dataquay ARGV``; a failure ends the benchmark, naming the command."""
    if run_command(*argv):
        raise SystemExit(f"dataquay {' '.join(argv)} failed")


def plot(rows: list[EpochRow], path: Path) -> bool:
    """Draws the stall of every system per epoch to ``path``; False, writing
    nothing, without matplotlib (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    names = list(dict.fromkeys(r.system for r in rows))
    for k, name in enumerate(names):
        mine = [r for r in rows if r.system == name]
        # Each system a little apart in x, on a log scale (a floor of 0.05%): the baselines at 76% and the
        # modes at 0.1-1% all show, and none hides another.
        offset = (k - (len(names) - 1) / 2) * 0.05
        axes.plot([r.epoch + offset for r in mine], [max(r.stall_pct, 0.05) for r in mine], marker="o", label=name)
    axes.set_xticks(sorted({r.epoch for r in rows}))
    axes.set_xlabel("epoch")
    axes.set_ylabel("stall, % of wall time waiting for data (log)")
    axes.set_yscale("log")
    axes.set_title(f"{NODES} nodes x {RANKS_PER_NODE} ranks, PFS capped at {PFS_BYTES_PER_SECOND / 1e6:.0f} MB/s")
    axes.legend(fontsize=7, ncol=2, loc="center right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def results_line(out_dir: Path, plotted: bool) -> str:
    """Where the results went, naming only files that were written."""
    if plotted:
        return f"results in {out_dir}/stall.json and stall.png"
    return f"results in {out_dir}/stall.json; no plot (pip install matplotlib for one)"


def print_table(rows: list[EpochRow]) -> None:
    header = ("system", "epoch", "wall s", "wait s", "stall %", "local MB", "peer MB", "PFS MB", "network MB")
    cells = [
        (
            r.system,
            r.epoch,
            f"{r.wall_s:.2f}",
            f"{r.wait_s:.2f}",
            f"{r.stall_pct:.1f}",
            f"{r.local_mb:.0f}",
            f"{r.peer_mb:.0f}",
            f"{r.pfs_mb:.0f}",
            f"{r.network_mb:.0f}",
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *cells)]
    for line in (header, *cells):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def main(quick: bool, out_dir: Path) -> list[EpochRow]:
    started = time.perf_counter()
    # A rank's first batch of the first epoch, which no read-ahead can hide
    # (those of later epochs are read during the epoch before), weighs about
    # 1% of the full run's first epoch and a few % of the quick run's.
    rows = run_benchmark(1600 if quick else 9600, 3 if quick else 5, out_dir)
    plotted = plot(rows, out_dir / "stall.png")
    print_table(rows)
    print(f"\n({time.perf_counter() - started:.0f} s; {results_line(out_dir, plotted)})")
    return rows
