"""Caches of unequal capacity: PFS reads per epoch with and without spilling
(CoorDL's (Mohan et al., VLDB 2021) Partitioned MinIO: the aggregate cache is the
sum of the caches).

4 daemons, 8 rank processes (2 per node) reading a files dataset of
``SAMPLES`` samples of 60-100 KB, a ``local`` job staged with ``stage --job``.
Every node but node 0 starts with the same ``--cache-size``; then node 0 (and
others) are restarted with their own, as fractions of a node's share in cache
pages (``dataquay.server.planning.capacity.cached_bytes``):

- ``room``: 0.5, 1.5, 1.5, 1.5 shares (together 5: they hold the dataset);
- ``short``: 0.25, 0.5, 1.25, 1.5 shares (together 3.5: they do not).

Per epoch: the samples the ranks read by tier. Run it on the code before
spilling (``PYTHONPATH`` set to an export of that commit's three roots) with
the label ``before``, and on this code with ``after``; each label writes
``bench/results/spill-LABEL.json``. It imports nothing the earlier code lacks.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import progress, report

from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import cached_bytes
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import RankGroup

NODES = 4
RANKS_PER_NODE = 2
SAMPLES = 1200
SIZES = (60_000, 80_000, 100_000)
BATCH = 16
COMPUTE_SECONDS = 0.02
EPOCHS = 3
JOB = "spill"
LEASES = ("--lease-seconds", "2", "--heartbeat-seconds", "0.5")
SCENARIOS = {"room": (0.5, 1.5, 1.5, 1.5), "short": (0.25, 0.5, 1.25, 1.5)}


def share_bytes() -> int:
    sizes = np.array([SIZES[i % len(SIZES)] for i in range(SAMPLES)], dtype=np.int64)
    return cached_bytes(sizes[: SAMPLES // NODES])


def run(base: Path, scenario: str, label: str) -> list[dict[str, object]]:
    share = share_bytes()
    capacities = [int(f * share) for f in SCENARIOS[scenario]]
    local = LocalCluster(
        base / f"cluster-{scenario}", NODES, ("--cache-size", str(max(capacities))), LEASES, dataset_roots=(base,)
    ).start()
    try:
        for node, capacity in enumerate(capacities):
            if capacity != max(capacities):
                local.restart_node(node, extra_args=("--cache-size", str(capacity)))
        deadline = time.monotonic() + 30
        while {n.info.name: n.info.cache_capacity for n in local.wait_for_nodes(up=[node_name(0)])} != {
            node_name(m): c for m, c in enumerate(capacities)
        }:
            assert time.monotonic() < deadline, "the directory does not list the restarted nodes' capacities"
            time.sleep(0.2)
        root = base / "pfs"
        if not root.exists():
            make_files_dataset(root, SAMPLES, sizes=SIZES)
        assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[1].address]) == 0
        assert (
            cli_main(
                [
                    "stage",
                    "imgs",
                    "--job",
                    JOB,
                    "--mode",
                    "local",
                    "--ranks-per-node",
                    str(RANKS_PER_NODE),
                    "--quiet",
                    "--directory",
                    local.directory_address,
                ]
            )
            == 0
        )
        envs = [local.rank_env(r, RANKS_PER_NODE, JOB) for r in range(NODES * RANKS_PER_NODE)]
        rows: list[dict[str, object]] = []
        with RankGroup(
            envs, "imgs", base / "ranks", batch=BATCH, compute_seconds=COMPUTE_SECONDS, timeout=300
        ) as group:
            for epoch in range(EPOCHS):
                results = group.epoch(epoch)
                tiers = {t: sum(r.samples[t] for r in results) for t in results[0].samples}
                rows.append(
                    {
                        "code": label,
                        "scenario": scenario,
                        "epoch": epoch,
                        "caches_x_share": "/".join(f"{f:g}" for f in SCENARIOS[scenario]),
                        "share_MB": round(share / 1e6, 1),
                        "local": tiers["local"],
                        "peer": tiers["peer"],
                        "pfs": tiers["pfs"],
                        "pfs_MB": round(sum(r.bytes["pfs"] for r in results) / 1e6, 1),
                    }
                )
                progress(f"{label} {scenario} epoch {epoch}: {rows[-1]}")
        return rows
    finally:
        local.down()


def main(label: str) -> None:
    with tempfile.TemporaryDirectory(prefix="dq-bench-spill-") as tmp:
        rows = [row for scenario in SCENARIOS for row in run(Path(tmp), scenario, label)]
    report(
        f"spill-{label}",
        rows,
        ["code", "scenario", "caches_x_share", "epoch", "local", "peer", "pfs", "pfs_MB", "share_MB"],
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "after")
