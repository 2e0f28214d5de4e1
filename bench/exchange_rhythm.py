"""The partial exchange in a training job's rhythm: local hits per epoch by cache size.

4 daemons (``LocalCluster``), 2 free-running rank processes per node
(:mod:`dataquay.server.tools.free_rank`: no barrier between ranks, the two
ranks of a node taking turns at being half as slow again, each reading two
batches ahead as ``Dataset.batches`` does by default), a files dataset of
``--samples`` samples of 120 KiB, a ``partial`` job at ``--q`` staged with
``stage --job``, batches of 64. Each rank trains ``STEP_SECONDS`` per batch
(a job's rhythm: an epoch lasts several times the exchange) or not at all
(``step 0``). With ``--wait-for-exchange SECONDS`` each rank's sampler waits
up to that long at each epoch boundary for the exchange into the epoch
(``Dataset.sampler(wait_for_exchange=...)``); rows then say how long the
ranks waited. Caches per node, against the largest share S of any node (in
cache bytes, :func:`~dataquay.server.planning.capacity.node_shares`):

- 0.5, 0.75 and 0.9 x S, short of the share; their PFS and peer reads per
  epoch against ``dataquay simulate``'s for the same job and cache (its PFS
  reads, and the peer reads of samples the ranks read ahead before their
  sender had read, and so shipped, them);
- ``advice``: the sizing guide's advice, 1.05 x S + 16 MiB
  (:func:`~dataquay.server.planning.capacity.cache_need`);
- 1.2, 1.6 and 2.5 x S (those under the advice are short of it as well);
- ``10x``: 10 x S, where nothing given away is ever deleted (the cache stays
  under ``--spare-copies-fill``): the baseline, a cache too big to matter.

Per epoch: samples read from the node's own cache (client ``local`` plus the
daemon's ``cache``), from peers and from the PFS, as the ranks' clients count
them (an epoch counts the next one's first two batches, read ahead while
its own last ones train); per run, the PFS bytes the daemons read ahead of
the ranks and threw away unread (``dataquay_overflow_wasted_bytes``).
``local_vs_10x`` is the run's local hits over the 10x run's with the same step.
``nodes_marked_down`` counts the times the directory marked a node down
during the run (a run with any measured a lease, not the exchange);
``load_avg_1min`` is the machine's load average as the run ended.

Usage: python bench/exchange_rhythm.py [--samples N] [--epochs E] [--q Q] [--parts step,nostep]
[--caches 0.5x,0.75x,0.9x,advice,1.2x,1.6x,2.5x,10x] [--step SECONDS] [--wait-for-exchange SECONDS]
[--name RESULTS_NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from common import progress, report

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import cache_need, node_shares
from dataquay.server.tools import free_rank
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.simulate import Scenario, simulate
from dataquay.server.tools.synthetic import make_files_dataset

NODES = 4
RANKS_PER_NODE = 2
SIZE = 120 * 1024
BATCH = 64
READ_AHEAD = 2
STEP_SECONDS = 0.4
JOB = "rhythm"
#: Leases long enough that a daemon starved of CPU for a few seconds on a
#: loaded machine is not marked down: a node marked down changes the job's
#: holders, and its reads leave their caches for the rest of the run.
LEASES = ("--lease-seconds", "30", "--heartbeat-seconds", "1")


class Cache(NamedTuple):
    label: str
    capacity: int


def plan(samples: int, q: float) -> JobPlan:
    settings = JobSettings(
        job_id=JOB,
        mode="partial",
        q=q,
        ranks_per_node=RANKS_PER_NODE,
        batch_size=BATCH,
        nodes=tuple(f"n{m}" for m in range(NODES)),
    )
    return JobPlan(settings, num_samples=samples, num_nodes=NODES)


def caches(samples: int, q: float, epochs: int) -> tuple[int, list[Cache]]:
    """The largest share, and the caches to run, smallest first."""
    share = int(node_shares(plan(samples, q), np.full(samples, SIZE), epochs + 1).max())
    sized = [Cache("advice", cache_need(share, "partial", q))]
    sized += [Cache(f"{x}x", int(x * share)) for x in (0.5, 0.75, 0.9, 1.2, 1.6, 2.5, 10)]
    return share, sorted(sized, key=lambda c: c.capacity)


def run(
    base: Path, samples: int, q: float, epochs: int, cache: Cache, step: float, wait: float
) -> list[dict[str, object]]:
    """``epochs`` epochs on caches of ``cache.capacity``, ranks waiting up to
    ``wait`` seconds for each epoch's exchange; a row per epoch."""
    local = LocalCluster(
        base / f"cluster-{cache.label}-{step}",
        NODES,
        ("--cache-size", str(cache.capacity)),
        LEASES,
        dataset_roots=(base,),
    ).start()
    try:
        root = base / "pfs"
        if not root.exists():
            make_files_dataset(root, samples, sizes=(SIZE,))
        assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
        assert (
            cli_main(
                [
                    "stage",
                    "imgs",
                    "--job",
                    JOB,
                    "--mode",
                    "partial",
                    "--q",
                    str(q),
                    "--seed",
                    "5",
                    "--ranks-per-node",
                    str(RANKS_PER_NODE),
                    "--quiet",
                    "--directory",
                    local.directory_address,
                ]
            )
            == 0
        )
        started = time.perf_counter()
        lines = ranks(local, base, epochs, step, wait)
        wall = time.perf_counter() - started
        ahead = [daemon_stats(local, m).prefetch for m in range(NODES)]
    finally:
        local.down()
    down = nodes_marked_down(local)
    rows = []
    for epoch in range(epochs):
        tiers = {t: sum(rank[epoch]["samples"][t] for rank in lines) for t in lines[0][epoch]["samples"]}
        rows.append(
            {
                "cache": cache.label,
                "cache_MB": round(cache.capacity / 1e6, 1),
                "step_s": step,
                "epoch": epoch,
                "local": tiers["local"] + tiers["cache"],
                "peer": tiers["peer"],
                "pfs": tiers["pfs"],
                "read": sum(tiers.values()),
                "wall_s": round(wall, 1),
                "wait_for_exchange_s": wait,
                "exchange_wait_s_max": round(max(float(str(rank[epoch]["exchange_wait"])) for rank in lines), 2),
                "read_ahead_MB": round(sum(a.overflow_read_bytes for a in ahead) / 1e6, 2),
                "read_ahead_discarded_MB": round(sum(a.overflow_wasted_bytes for a in ahead) / 1e6, 2),
                "nodes_marked_down": down,
                "load_avg_1min": round(os.getloadavg()[0], 1),
            }
        )
    progress(
        f"{cache.label} step {step}: local {[r['local'] for r in rows]} peer {[r['peer'] for r in rows]} "
        f"pfs {[r['pfs'] for r in rows]} in {wall:.0f} s"
    )
    return rows


def ranks(local: LocalCluster, base: Path, epochs: int, step: float, wait: float) -> list[list[dict[str, object]]]:
    """Every rank run to its end at its own pace; its JSON line per epoch.

    Each rank writes to a file, not a pipe: a pipe read only once the ranks
    before it ended fills (64 KiB, six epochs of ids) and stops its rank."""
    count = NODES * RANKS_PER_NODE
    logs = [open(base / f"rank-{r}.log", "wb") for r in range(count)]
    outs = [open(base / f"rank-{r}.out", "wb") for r in range(count)]
    try:
        procs = [
            subprocess.Popen(
                free_rank.command("imgs", epochs, BATCH, step, READ_AHEAD, wait),
                env={**os.environ, **local.rank_env(r, RANKS_PER_NODE, JOB)},
                stdout=out,
                stderr=log,
            )
            for r, (log, out) in enumerate(zip(logs, outs))
        ]
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for file in logs + outs:
            file.close()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: {(base / 'rank-0.log').read_text()[-2000:]}")
    return [[json.loads(line) for line in (base / f"rank-{r}.out").read_text().splitlines()] for r in range(count)]


def nodes_marked_down(local: LocalCluster) -> int:
    """Times the directory marked a node down in the run (its log): a run with
    any measured a lease, not the exchange."""
    return sum(log.read_text().count("node down") for log in local.base_dir.glob("directory*/*.log"))


def daemon_stats(local: LocalCluster, node: int) -> pb.StatsReply:
    with local.credentials().channel(local.daemons[node].address, channel_options()) as channel:
        return cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=30)


def predicted_misses(samples: int, q: float, epochs: int, capacity: int) -> tuple[list[float], list[float]]:
    """simulate's PFS reads, and peer reads ahead of the exchange, per epoch
    (in samples) for this job on caches of ``capacity``."""
    scenario = Scenario(plan(samples, q), SIZE, capacity, read_ahead=READ_AHEAD)
    traffic = list(simulate(scenario, epochs))
    return [t.pfs_bytes / SIZE for t in traffic], [t.early_read_bytes / SIZE for t in traffic]


def summary(
    rows: list[dict[str, object]], samples: int, q: float, epochs: int, share: int, sized: list[Cache]
) -> list[dict[str, object]]:
    """One row per run: local hits' range over the epochs, against the 10x
    run's; for a cache short of the ``share``, its misses against simulate's."""
    out = []
    for cache in sized:
        for step in sorted({float(str(r["step_s"])) for r in rows}, reverse=True):
            mine = [r for r in rows if r["cache"] == cache.label and r["step_s"] == step]
            base = [r for r in rows if r["cache"] == "10x" and r["step_s"] == step]
            if not mine:
                continue
            local = [int(str(r["local"])) for r in mine]
            misses = [int(str(r["peer"])) + int(str(r["pfs"])) for r in mine]
            row: dict[str, object] = {
                "cache": cache.label,
                "cache_MB": mine[0]["cache_MB"],
                "step_s": step,
                "local_min": min(local),
                "local_max": max(local),
                "local_min_pct": round(100 * min(lo / int(str(r["read"])) for lo, r in zip(local, mine)), 2),
                "peer_max": max(int(str(r["peer"])) for r in mine),
                "pfs_max": max(int(str(r["pfs"])) for r in mine),
                "read_ahead_discarded_MB": mine[0]["read_ahead_discarded_MB"],
                "nodes_marked_down": mine[0]["nodes_marked_down"],
                "load_avg_1min": mine[-1]["load_avg_1min"],
                "local_vs_10x": round(sum(local) / sum(int(str(r["local"])) for r in base), 3) if base else None,
                "wall_s": mine[0]["wall_s"],
                "exchange_wait_s_max": max(float(str(r["exchange_wait_s_max"])) for r in mine),
            }
            if cache.capacity < share:
                pfs, early = (np.mean(each[1:]) for each in predicted_misses(samples, q, epochs, cache.capacity))
                row["simulate_pfs"], row["simulate_peer"] = round(float(pfs)), round(float(early))
                row["misses_vs_simulate"] = round(float(np.mean(misses[1:])) / float(pfs + early), 3)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3200)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--q", type=float, default=1.0)
    parser.add_argument("--parts", default="step,nostep", help="step, nostep or both")
    parser.add_argument("--caches", default="", help="the caches to run, by label (default: all)")
    parser.add_argument("--step", type=float, default=STEP_SECONDS, help="seconds of training per batch")
    parser.add_argument(
        "--wait-for-exchange", type=float, default=0.0, help="seconds a rank may wait for each epoch's exchange"
    )
    parser.add_argument("--name", default="exchange_rhythm", help="results file name under bench/results/")
    args = parser.parse_args()
    steps = [args.step] * ("step" in args.parts.split(",")) + [0.0] * ("nostep" in args.parts.split(","))
    share, sized = caches(args.samples, args.q, args.epochs)
    if args.caches:
        sized = [c for c in sized if c.label in args.caches.split(",")]
    progress(f"largest share {share / 1e6:.1f} MB; caches {[(c.label, round(c.capacity / 1e6, 1)) for c in sized]}")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-rhythm-") as tmp:
        for step in steps:
            for cache in sized:
                rows += run(Path(tmp), args.samples, args.q, args.epochs, cache, step, args.wait_for_exchange)
    extra = {
        "share_MB": round(share / 1e6, 1),
        "samples": args.samples,
        "sample_bytes": SIZE,
        "q": args.q,
        "epochs": args.epochs,
        "batch": BATCH,
        "read_ahead": READ_AHEAD,
        "wait_for_exchange_s": args.wait_for_exchange,
        "summary": summary(rows, args.samples, args.q, args.epochs, share, sized),
    }
    report(
        args.name,
        rows,
        ["cache", "cache_MB", "step_s", "epoch", "local", "peer", "pfs", "read", "read_ahead_discarded_MB"],
        extra,
    )
    print()
    report(
        f"{args.name}_summary",
        list(extra["summary"]),  # type: ignore[call-overload]
        [
            "cache",
            "cache_MB",
            "step_s",
            "local_min",
            "local_max",
            "local_min_pct",
            "peer_max",
            "pfs_max",
            "read_ahead_discarded_MB",
            "nodes_marked_down",
            "load_avg_1min",
            "local_vs_10x",
            "wall_s",
            "exchange_wait_s_max",
            "simulate_pfs",
            "simulate_peer",
            "misses_vs_simulate",
        ],
    )


if __name__ == "__main__":
    main()
