"""Bytes a node change moves: stable placement against the 1/M ideal and the index blocks.

When one of M nodes leaves, at least its share (1/M of the dataset) must move;
when a spare joins, at least the spare's new share (1/(M+1)). This counts the
samples whose holder changes under :func:`dataquay.client.placement.initial_owners`
(canonical partitions placed on node names by rendezvous hashing with
balanced shares) and under the index blocks it replaced (a seeded
permutation cut into M blocks, node m owning block m of the sorted names),
for M = 4, 16, 64, 256, ``TRIALS`` node sets each: the leaving node drawn at
random, the spare named to sort last. Pure computation: no daemons, no I/O.
Also reports the shares' balance (largest and smallest over the mean) and
the CPU seconds one placement takes (each node set is new, so none is
cached; CPU time moves less than wall time with a shared machine's load).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import report

from dataquay.client.placement import initial_owners
from dataquay.client.placement.orders import INITIAL_SAMPLES_KEY, keyed_generator

SAMPLES = 1_000_000
SAMPLE_BYTES = 110 << 10
NODE_COUNTS = (4, 16, 64, 256)
TRIALS = 3


def index_blocks(num_samples: int, names: list[str], seed: int) -> np.ndarray:
    """The holder (a name) of each sample under the index blocks: node m of the sorted names owns block m."""
    names = sorted(names)
    order = keyed_generator(seed, INITIAL_SAMPLES_KEY).permutation(num_samples)
    bounds = np.arange(len(names) + 1, dtype=np.int64) * num_samples // len(names)
    owner = np.empty(num_samples, dtype=np.int32)
    owner[order] = np.repeat(np.arange(len(names), dtype=np.int32), np.diff(bounds))
    return np.array(names)[owner]


def stable(num_samples: int, names: list[str]) -> np.ndarray:
    """The holder (a name) of each sample under the stable placement."""
    return np.array(names)[initial_owners(num_samples, names, dataset="bench")]


def node_set(count: int, trial: int) -> list[str]:
    rng = np.random.default_rng(trial)
    return [f"nid{n:06d}" for n in rng.choice(1_000_000, size=count, replace=False)]


def trial_rows(m: int, trial: int, samples: int) -> list[dict[str, object]]:
    names = node_set(m, trial)
    gone = names[int(np.random.default_rng(1000 + trial).integers(m))]
    changes = {"leave": [n for n in names if n != gone], "join": [*names, "zz-spare"]}
    started = time.process_time()
    before = stable(samples, names)
    seconds = time.process_time() - started
    loads = np.unique(before, return_counts=True)[1]
    blocks_before = index_blocks(samples, names, trial)
    rows = []
    for change, after_names in changes.items():
        ideal = 1 / m if change == "leave" else 1 / (m + 1)
        moved = float(np.mean(before != stable(samples, after_names)))
        blocks = float(np.mean(blocks_before != index_blocks(samples, after_names, trial)))
        rows.append(
            {
                "nodes": m,
                "trial": trial,
                "change": change,
                "ideal_fraction": ideal,
                "moved_fraction": moved,
                "moved_over_ideal": moved / ideal,
                "moved_bytes": round(moved * samples) * SAMPLE_BYTES,
                "ideal_bytes": round(ideal * samples) * SAMPLE_BYTES,
                "index_blocks_fraction": blocks,
                "index_blocks_over_ideal": blocks / ideal,
                "share_max_over_mean": float(loads.max() / loads.mean()),
                "share_min_over_mean": float(loads.min() / loads.mean()),
                "placement_cpu_s": seconds,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--nodes", type=int, nargs="+", default=list(NODE_COUNTS))
    args = parser.parse_args()
    rows = [row for m in args.nodes for trial in range(args.trials) for row in trial_rows(m, trial, args.samples)]
    summary = []
    for m in args.nodes:
        for change in ("leave", "join"):
            mine = [r for r in rows if r["nodes"] == m and r["change"] == change]
            summary.append(
                {
                    "nodes": m,
                    "change": change,
                    "moved_over_ideal_mean": float(np.mean([r["moved_over_ideal"] for r in mine])),
                    "moved_over_ideal_max": float(np.max([r["moved_over_ideal"] for r in mine])),
                    "index_blocks_over_ideal_mean": float(np.mean([r["index_blocks_over_ideal"] for r in mine])),
                    "moved_gib_mean": float(np.mean([r["moved_bytes"] for r in mine])) / (1 << 30),
                    "ideal_gib": float(mine[0]["ideal_bytes"]) / (1 << 30),
                    "share_max_over_mean": float(np.max([r["share_max_over_mean"] for r in mine])),
                    "share_min_over_mean": float(np.min([r["share_min_over_mean"] for r in mine])),
                    "placement_cpu_s_median": float(np.median([r["placement_cpu_s"] for r in mine])),
                }
            )
    report(
        "placement_moves",
        summary,
        list(summary[0]),
        {"samples": args.samples, "sample_bytes": SAMPLE_BYTES, "trials": args.trials, "raw": rows},
    )


if __name__ == "__main__":
    main()
