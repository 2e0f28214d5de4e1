"""Placement cost at cluster scale: owners and one rank's order, N=10^7 over 1024 nodes.

Every rank computes its order and every daemon the owners of all samples, once
per epoch, so both must stay well under the time of an epoch's first batch:
the target is 2 s on two slow cores. ``shard`` deals 10^4 equal shards (a tar
dataset's layout). Each figure is the median of ``REPEATS`` runs.

Per mode (sample partition): ``owners_s`` is one epoch's owners as a daemon
computes them (``partial``: one exchange step from the previous epoch's);
``rank_order_s`` one rank's order given them; ``transfers_s`` what a simulator
or the exchange engine asks for (``partial``: :func:`moves`; ``locality``:
:func:`locality_balance`). ``network_pct`` is the share of an epoch's samples
that cross the network: one rank's peer reads in ``global``, the exchange in
``partial``, the balancer's moves in ``locality`` (mean over batches).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from common import REPEATS, progress, report
from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import (
    MODES,
    PARTITIONS,
    JobPlan,
    locality_balance,
    moves,
    owners,
    rank_order,
)

NUM_SAMPLES = 10**7
NUM_NODES = 1024
RANKS_PER_NODE = 8
NUM_GROUPS = 10**4
#: Exchanged fraction of ``partial``; per-rank batch of ``locality``.
Q = 0.1
BATCH_SIZE = 32
TARGET_SECONDS = 2.0
#: The simulator's budget for one simulated epoch (owners plus transfers).
SIMULATED_EPOCH_SECONDS = 10.0

COLUMNS = [
    "mode", "partition", "N", "M", "g", "b", "q", "groups", "owners_s", "rank_order_s", "transfers_s",
    "network_pct", "node_load_spread", "within_target",
]


def median_seconds(run: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def row(plan: JobPlan, groups: int | None) -> dict[str, object]:
    last = plan.world_size - 1
    before = owners(plan, 1)
    after = owners(plan, 2, previous=before)
    loads = np.bincount(after, minlength=NUM_NODES)
    owners_s = median_seconds(partial(owners, plan, 2, before))
    order_s = median_seconds(partial(rank_order, plan, 2, last, after))
    transfers_s: float | None = None
    if plan.settings.mode == "global":
        read = rank_order(plan, 2, last, after)
        network = float(np.mean(after[read] != last // plan.settings.ranks_per_node)) * 100
    elif plan.settings.mode == "partial":
        transfers_s = median_seconds(partial(moves, plan, 2, before))
        network = len(moves(plan, 2, before).ids) * 100 / plan.num_samples
    elif plan.settings.mode == "locality":
        transfers_s = median_seconds(partial(locality_balance, plan, 2))
        network = float(locality_balance(plan, 2).imbalance.mean())
    else:
        network = 0.0
    return {
        "mode": plan.settings.mode,
        "partition": plan.settings.partition,
        "N": plan.num_samples,
        "M": plan.num_nodes,
        "g": plan.settings.ranks_per_node,
        "b": plan.settings.batch_size if plan.settings.mode == "locality" else None,
        "q": plan.settings.q if plan.settings.mode == "partial" else None,
        "groups": groups,
        "owners_s": owners_s,
        "rank_order_s": order_s,
        "transfers_s": transfers_s,
        "network_pct": network,
        "node_load_spread": int(loads.max() - loads.min()),
        "within_target": max(owners_s, order_s) < TARGET_SECONDS
        and owners_s + (transfers_s or 0.0) < SIMULATED_EPOCH_SECONDS,
    }


def main() -> None:
    groups = (np.arange(NUM_SAMPLES, dtype=np.int64) * NUM_GROUPS // NUM_SAMPLES).astype(np.int32)
    rows: list[dict[str, object]] = []
    for partition in PARTITIONS:
        progress(f"global, {partition} partition")
        settings = JobSettings(seed=1, partition=partition, ranks_per_node=RANKS_PER_NODE)
        plan = JobPlan(settings, NUM_SAMPLES, NUM_NODES, groups)
        rows.append(row(plan, NUM_GROUPS if partition == "shard" else None))
    for mode in [name for name in MODES if name != "global"]:
        progress(f"{mode}, sample partition")
        settings = JobSettings(mode=mode, q=Q, seed=1, batch_size=BATCH_SIZE, ranks_per_node=RANKS_PER_NODE)
        plan = JobPlan(settings, NUM_SAMPLES, NUM_NODES)
        rows.append(row(plan, None))
    report("placement", rows, COLUMNS)


if __name__ == "__main__":
    main()
