"""Tight storage: caches that hold little more than their node's share, and
caches that hold less (the regime of Nguyen et al., IPDPS 2022, and Mohan et al., VLDB 2021).

4 daemons, 8 rank processes (2 per node) reading a files dataset of
``SAMPLES`` samples of 60-100 KB, a ``partial`` job, ``--spare-copies-fill 0``;
each rank sleeps ``COMPUTE_SECONDS`` per batch of 16 (a GPU step), and nothing
waits for the exchange between epochs.

1. Fits: every node's ``--cache-size`` is what docs/guides/sizing.md asks for,
   ``cache_need`` = 1.05 x the largest share (in cache bytes) + 16 MiB, for
   Q = 0.1, 0.5 and 1 over ``EPOCHS`` epochs. Per epoch: the tiers the ranks
   read from and whether every node's exchange into the next epoch had
   finished when the epoch ended. Targets: >= 99% local hits, no PFS reads,
   every epoch. ``old_need_MB`` is what the exchange needed before it deleted
   as the ranks read: the share plus everything arriving, (1 + Q(1 - 1/M)) x.
2. Short: ``--cache-size`` = 0.5 and 0.75 x the largest share, Q = 0.5, each batch
   ``SHORT_COMPUTE_SECONDS`` (epochs of about 7 s: a short receiver takes a
   sample only once its sender's ranks read it, so the exchange runs at the
   pace of the reads, not ahead of them). Per epoch the PFS reads and the
   network bytes (the exchange into the epoch plus the ranks' peer reads),
   against ``dataquay simulate --cache-bytes``'s prediction for the same job.
   Target: level (within 2%) and predicted within 5%, from epoch 1 on
   (simulate's epoch 0 is staging).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from common import progress, report

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import cache_need, node_shares
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.simulate import Scenario, simulate
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import RankGroup

NODES = 4
RANKS_PER_NODE = 2
SAMPLES = 2400
SIZES = (60_000, 80_000, 100_000)
BATCH = 16
COMPUTE_SECONDS = 0.1
SHORT_COMPUTE_SECONDS = 0.3
EPOCHS = 10
JOB = "tight"
LEASES = ("--lease-seconds", "2", "--heartbeat-seconds", "0.5")


def largest_share(q: float) -> int:
    settings = JobSettings(
        job_id=JOB, mode="partial", q=q, ranks_per_node=RANKS_PER_NODE, nodes=tuple(f"n{m}" for m in range(NODES))
    )
    plan = JobPlan(settings, num_samples=SAMPLES, num_nodes=NODES)
    return int(node_shares(plan, sizes(), EPOCHS + 1).max())


def sizes() -> np.ndarray:
    return np.array([SIZES[i % len(SIZES)] for i in range(SAMPLES)], dtype=np.int64)


def run(base: Path, q: float, capacity: int, compute: float = COMPUTE_SECONDS) -> list[dict[str, object]]:
    """EPOCHS epochs of the job on caches of ``capacity``; a row per epoch."""
    local = LocalCluster(
        base / f"cluster-{q}-{capacity}",
        NODES,
        ("--cache-size", str(capacity), "--spare-copies-fill", "0"),
        LEASES,
        dataset_roots=(base,),
    ).start()
    channels = []
    try:
        root = base / "pfs"
        if not root.exists():
            make_files_dataset(root, SAMPLES, sizes=SIZES)
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
                    "--ranks-per-node",
                    str(RANKS_PER_NODE),
                    "--quiet",
                    "--directory",
                    local.directory_address,
                ]
            )
            == 0
        )
        stubs = []
        for daemon in local.daemons:
            assert daemon.ready is not None
            channels.append(grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()))
            stubs.append(cache_pb2_grpc.CacheStub(channels[-1]))
        envs = [local.rank_env(r, RANKS_PER_NODE, JOB) for r in range(NODES * RANKS_PER_NODE)]
        rows: list[dict[str, object]] = []
        received = [0]  # exchange bytes the nodes received during each epoch so far, after a 0 for "before"
        received_before = sum(s.Stats(pb.StatsRequest(), timeout=10).exchange_received_bytes for s in stubs)
        with RankGroup(envs, "imgs", base / "ranks", batch=BATCH, compute_seconds=compute, timeout=300) as group:
            for epoch in range(EPOCHS):
                started = time.perf_counter()
                results = group.epoch(epoch)
                wall = time.perf_counter() - started
                stats = [s.Stats(pb.StatsRequest(), timeout=10) for s in stubs]
                runs = [next((x for x in st.exchanges if x.epoch == epoch + 1), None) for st in stats]
                tiers = {t: sum(r.samples[t] for r in results) for t in results[0].samples}
                received_now = sum(st.exchange_received_bytes for st in stats)
                received.append(received_now - received_before)
                received_before = received_now
                # The exchange into this epoch ran during the one before (simulate counts it here).
                network = received[epoch] + sum(r.bytes["peer"] for r in results)
                read = sum(tiers.values())
                rows.append(
                    {
                        "q": q,
                        "epoch": epoch,
                        "wall_s": round(wall, 2),
                        "local_pct": round(100 * tiers["local"] / read, 2),
                        "peer": tiers["peer"],
                        "pfs": tiers["pfs"],
                        "network_MB": round(network / 1e6, 2),
                        "exchange_hidden": all(x is not None and x.finished for x in runs),
                        "cache_MB": round(capacity / 1e6, 1),
                        "used_MB": round(max(st.cache_used_bytes for st in stats) / 1e6, 1),
                        "inserts_dropped": sum(st.inserts_dropped for st in stats),
                    }
                )
                progress(f"q={q} cache={capacity / 1e6:.1f} MB epoch {epoch}: {rows[-1]}")
        return rows
    finally:
        for channel in channels:
            channel.close()
        local.down()


def fits(base: Path) -> list[dict[str, object]]:
    rows = []
    for q in (0.1, 0.5, 1.0):
        share = largest_share(q)
        capacity = cache_need(share, "partial", q)
        old_need = share * (1 + q * (1 - 1 / NODES))
        for row in run(base, q, capacity):
            rows.append({**row, "share_MB": round(share / 1e6, 1), "old_need_MB": round(old_need / 1e6, 1)})
    return rows


def short(base: Path) -> list[dict[str, object]]:
    return [row for fraction in (0.5, 0.75) for row in short_run(base, fraction)]


def short_run(base: Path, fraction: float) -> list[dict[str, object]]:
    q = 0.5
    share = largest_share(q)
    capacity = int(fraction * share)
    settings = JobSettings(
        job_id=JOB,
        mode="partial",
        q=q,
        ranks_per_node=RANKS_PER_NODE,
        batch_size=BATCH,
        nodes=tuple(f"n{m}" for m in range(NODES)),
    )
    mean = int(sizes().mean())
    scenario = Scenario(JobPlan(settings, num_samples=SAMPLES, num_nodes=NODES), mean, capacity)
    predicted = list(simulate(scenario, EPOCHS))
    rows = []
    for row, expected in zip(run(base, q, capacity, SHORT_COMPUTE_SECONDS), predicted):
        pfs = expected.pfs_bytes / mean
        network = expected.network_bytes / 1e6
        rows.append(
            {
                **row,
                "share_MB": round(share / 1e6, 1),
                "simulate_pfs": round(pfs),
                "pfs_vs_simulate": round(int(row["pfs"]) / pfs, 3),
                "simulate_network_MB": round(network, 2),
                "network_vs_simulate": round(float(row["network_MB"]) / network, 3) if network else None,
            }
        )
    return rows


def main(parts: list[str] | None = None) -> None:
    """Runs the parts named (``fits``, ``short``; default both)."""
    parts = parts or ["fits", "short"]
    with tempfile.TemporaryDirectory(prefix="dq-bench-tight-") as tmp:
        base = Path(tmp)
        if "fits" in parts:
            report(
                "tight_storage_fits",
                fits(base),
                [
                    "q",
                    "epoch",
                    "wall_s",
                    "local_pct",
                    "peer",
                    "pfs",
                    "exchange_hidden",
                    "share_MB",
                    "cache_MB",
                    "old_need_MB",
                    "used_MB",
                    "inserts_dropped",
                ],
            )
            print()
        if "short" in parts:
            report(
                "tight_storage_short",
                short(base),
                [
                    "cache_MB",
                    "epoch",
                    "wall_s",
                    "local_pct",
                    "peer",
                    "pfs",
                    "simulate_pfs",
                    "pfs_vs_simulate",
                    "network_MB",
                    "simulate_network_MB",
                    "network_vs_simulate",
                    "share_MB",
                    "used_MB",
                ],
            )


if __name__ == "__main__":
    main(sys.argv[1:])
