"""Placement cost at cluster scale: owners and one rank's order, N=10^7 over 1024 nodes.

Every rank computes its order and every daemon the owners of all samples, once
per epoch, so both must stay well under the time of an epoch's first batch:
the target is 2 s on two slow cores. ``shard`` deals 10^4 equal shards (a tar
dataset's layout). Each figure is the median of ``REPEATS`` runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from common import REPEATS, progress, report
from dataquay.client.placement import PARTITIONS, JobPlan, owners, rank_order

NUM_SAMPLES = 10**7
NUM_NODES = 1024
RANKS_PER_NODE = 8
NUM_GROUPS = 10**4
TARGET_SECONDS = 2.0


def median_seconds(run: Callable[[], object], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    groups = (np.arange(NUM_SAMPLES, dtype=np.int64) * NUM_GROUPS // NUM_SAMPLES).astype(np.int32)
    rows: list[dict[str, object]] = []
    for partition in PARTITIONS:
        progress(f"{partition} partition")
        plan = JobPlan(NUM_SAMPLES, NUM_NODES, RANKS_PER_NODE, seed=1, partition=partition, groups=groups)
        loads = np.bincount(owners(plan, 0), minlength=NUM_NODES)
        owners_s = median_seconds(partial(owners, plan, 1))
        order_s = median_seconds(partial(rank_order, plan, 1, plan.world_size - 1))
        rows.append(
            {
                "partition": partition,
                "N": NUM_SAMPLES,
                "M": NUM_NODES,
                "g": RANKS_PER_NODE,
                "groups": NUM_GROUPS if partition == "shard" else None,
                "owners_s": owners_s,
                "rank_order_s": order_s,
                "node_load_spread": int(loads.max() - loads.min()),
                "within_target": max(owners_s, order_s) < TARGET_SECONDS,
            }
        )
    report(
        "placement",
        rows,
        ["partition", "N", "M", "g", "groups", "owners_s", "rank_order_s", "node_load_spread", "within_target"],
    )


if __name__ == "__main__":
    main()
