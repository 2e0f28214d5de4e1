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

``--locality-plan`` (also part of the default run) times ``locality``'s whole
plan of an epoch as one node computes it (owners, the split that every
rank's order and the balancer's cost share, one rank's order, the balance),
stage by stage, then :func:`rank_order` and :func:`locality_balance` called
alone, and the other modes' owners and orders; each round runs in a fresh
process and reports wall and CPU seconds (CPU time moves less with the load
of a shared machine). ``--against DIR`` interleaves rounds of the code of
another tree (DIR/client, e.g. a ``git archive`` of an older commit) and
gives each stage's ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
from common import REPEATS, progress, report

import dataquay.client.placement as placement_api
from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import MODES, PARTITIONS, JobPlan, locality_balance, moves, owners, rank_order

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
    "mode",
    "partition",
    "N",
    "M",
    "g",
    "b",
    "q",
    "groups",
    "owners_s",
    "rank_order_s",
    "transfers_s",
    "network_pct",
    "node_load_spread",
    "within_target",
]
#: Rounds of ``--locality-plan``, each a fresh process per tree; the epoch
#: it plans and the rank whose order it computes (the last).
PLAN_ROUNDS = 5
PLAN_EPOCH = 2
PLAN_RANK = NUM_NODES * RANKS_PER_NODE - 1
PLAN_COLUMNS = ["code", "stage", "seconds", "cpu_seconds", "vs_against", "cpu_vs_against", "load_1min"]


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


class Stages:
    """Wall and CPU seconds of consecutive stages."""

    def __init__(self) -> None:
        self.times: dict[str, tuple[float, float]] = {}
        self._last = (time.perf_counter(), time.process_time())

    def lap(self, stage: str) -> None:
        """Ends ``stage``: the time since the last lap or restart."""
        now = (time.perf_counter(), time.process_time())
        self.times[stage] = (now[0] - self._last[0], now[1] - self._last[1])
        self._last = now

    def restart(self) -> None:
        """Leaves the time since the last lap out of every stage."""
        self._last = (time.perf_counter(), time.process_time())

    def total(self, stage: str) -> None:
        """Records the sum of the stages so far as ``stage``."""
        self.times[stage] = (sum(t[0] for t in self.times.values()), sum(t[1] for t in self.times.values()))


def plan_stages() -> dict[str, tuple[float, float]]:
    """``locality``'s plan of epoch 2 as one node computes it, then the other
    modes' owners and one rank's order: (wall, CPU) seconds per stage."""
    clock = Stages()
    locality_stages(clock)
    for mode in ("global", "local", "partial"):
        plan = JobPlan(JobSettings(mode=mode, q=Q, seed=1, ranks_per_node=RANKS_PER_NODE), NUM_SAMPLES, NUM_NODES)
        before = owners(plan, PLAN_EPOCH - 1) if mode == "partial" else None
        clock.restart()
        epoch_owners = owners(plan, PLAN_EPOCH, before)
        clock.lap(f"{mode}: owners")
        rank_order(plan, PLAN_EPOCH, PLAN_RANK, epoch_owners)
        clock.lap(f"{mode}: rank order")
    return clock.times


def locality_stages(clock: Stages) -> None:
    """``locality``'s whole plan, then :func:`rank_order` and :func:`locality_balance` alone."""
    settings = JobSettings(mode="locality", seed=1, batch_size=BATCH_SIZE, ranks_per_node=RANKS_PER_NODE)
    plan = JobPlan(settings, NUM_SAMPLES, NUM_NODES)
    epoch_owners = owners(plan, PLAN_EPOCH)
    clock.lap("owners")
    locality_epoch = getattr(placement_api, "locality_epoch", None)
    if locality_epoch is None:  # a tree from before the shared split (--against): each call makes its own
        rank_order(plan, PLAN_EPOCH, PLAN_RANK, epoch_owners)
        clock.lap("API: rank_order")
        locality_balance(plan, PLAN_EPOCH)
        clock.lap("API: locality_balance")
        clock.total("whole plan")
        return
    split = locality_epoch(plan, PLAN_EPOCH, epoch_owners)
    clock.lap("split")
    split.rank_order(PLAN_RANK)
    clock.lap("rank order")
    split.balance()
    clock.lap("balance")
    clock.total("whole plan")
    del split
    clock.restart()
    rank_order(plan, PLAN_EPOCH, PLAN_RANK, epoch_owners)
    clock.lap("API: rank_order")
    locality_balance(plan, PLAN_EPOCH)
    clock.lap("API: locality_balance")


def locality_plan(against: Path | None) -> None:
    """The whole ``locality`` plan, rounds of this tree and the one ``against`` interleaved."""
    trees = {"this": None, **({"against": against} if against else {})}
    rounds: dict[str, list[dict[str, tuple[float, float]]]] = {name: [] for name in trees}
    loads: dict[str, list[float]] = {name: [] for name in trees}
    for index in range(PLAN_ROUNDS):
        for name, root in trees.items():
            progress(f"locality plan, {name}, round {index + 1} of {PLAN_ROUNDS}")
            env = dict(os.environ)
            if root is not None:
                env["PYTHONPATH"] = os.pathsep.join([str(root / "client"), env.get("PYTHONPATH", "")])
            loads[name].append(os.getloadavg()[0])
            out = subprocess.run(
                [sys.executable, __file__, "--stages"], env=env, check=True, capture_output=True, text=True
            ).stdout
            rounds[name].append(json.loads(out))
    medians = {
        name: {stage: [statistics.median(times[stage][i] for times in runs) for i in (0, 1)] for stage in runs[0]}
        for name, runs in rounds.items()
    }
    baseline = medians.get("against", {})
    rows: list[dict[str, object]] = []
    for name in trees:
        for stage, (seconds, cpu_seconds) in medians[name].items():
            compared = name == "this" and stage in baseline
            rows.append(
                {
                    "code": name if name == "this" else str(against),
                    "stage": stage,
                    "seconds": seconds,
                    "cpu_seconds": cpu_seconds,
                    "vs_against": seconds / baseline[stage][0] if compared else None,
                    "cpu_vs_against": cpu_seconds / baseline[stage][1] if compared else None,
                    "load_1min": statistics.median(loads[name]),
                    "rounds_wall_cpu": [times[stage] for times in rounds[name]],
                }
            )
    report("placement-locality", rows, PLAN_COLUMNS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locality-plan", action="store_true", help="only locality's whole plan, stage by stage")
    parser.add_argument("--against", type=Path, help="also time the code of this tree (its client/), interleaved")
    parser.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stages:
        print(json.dumps(plan_stages()))
        return
    if not args.locality_plan:
        cluster_scale()
    locality_plan(args.against)


def cluster_scale() -> None:
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
