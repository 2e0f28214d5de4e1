"""Coded shuffling: the planner's time per epoch, against an earlier planner in the same run.

The planner (:func:`dataquay.server.node.exchange.coding.plan`) runs once per
epoch on every daemon; at 256 nodes and 7x10^5 samples an epoch is 2,734
samples per node, a few seconds for a fast trainer. Per setting (the caches
and owners of ``coded_shuffle.py``'s model, sample sizes log-normal around
110 KiB), each scheme is timed ``REPEATS`` rounds, the baseline planner and
this one interleaved within a round; medians of wall time (``*_s``) and of
the process's CPU time (``*_cpu``, less sensitive to other load on a shared
machine). ``*_tx`` are the transmissions of each plan, ``same`` whether
the two planners gave the same packets (in any order) for every scheme, and
``identical`` whether they gave the same arrays (packets in the same order,
senders, fetches).

``--baseline REV`` takes the baseline planner from git revision REV of this
repository; ``--python-loops`` takes this planner with the loops of an
install without the C extension (``dataquay.server._coding_py``) instead,
and writes ``coded_planning_python.json``; without either only this planner
is timed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from coded_shuffle import MEDIAN_BYTES, SCHEMES, SIGMA
from common import REPEATS, progress, report

from dataquay.server import _coding_py
from dataquay.server.node.exchange import coding
from dataquay.server.tools.spare_copies import balanced_owners, refill

SETTINGS = [(20, 0.2), (20, 0.14), (256, 0.2), (256, 4 / 256), (256, 2.8 / 256)]
SAMPLES = 7 * 10**5
SOURCE = "server/dataquay/server/node/exchange/coding.py"
#: The loops that the C extension and its Python fallback both define.
LOOPS = ("greedy", "packet_rows", "pick_bits", "table_hashes", "set_numbers", "dag_edges")


def baseline(revision: str) -> types.ModuleType:
    root = Path(__file__).resolve().parents[2]
    text = subprocess.run(
        ["git", "-C", str(root), "show", f"{revision}:{SOURCE}"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("coding_baseline")
    sys.modules[module.__name__] = module
    exec(compile(text, f"{revision}:{SOURCE}", "exec"), module.__dict__)
    return module


def python_loops() -> types.ModuleType:
    module = types.ModuleType("coding_python_loops")
    sys.modules[module.__name__] = module
    exec(compile(Path(coding.__file__).read_text(), coding.__file__, "exec"), module.__dict__)
    for name in LOOPS:
        setattr(module, name, getattr(_coding_py, name))
    return module


def timed(
    planner: types.ModuleType, holders: np.ndarray, owners: np.ndarray, scheme: str, sizes: np.ndarray
) -> tuple[coding.Packets, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    packets = planner.plan(holders, owners, scheme, sizes)
    return packets, time.perf_counter() - wall, time.process_time() - cpu


def grouping(packets: coding.Packets) -> np.ndarray:
    """Each needed sample's packet, named by the packet's smallest sample: equal for two
    plans with the same packets in any order (every needed sample is in one packet)."""
    if not len(packets):
        return packets.samples
    smallest = np.minimum.reduceat(packets.samples, packets.start[:-1])[packets.packet_of_part]
    return smallest[np.argsort(packets.samples)]


def row(nodes: int, alpha: float, old: types.ModuleType | None) -> dict[str, object]:
    rng = np.random.default_rng(0)
    capacity = int(alpha * SAMPLES)
    caches = refill([np.arange(SAMPLES)] * nodes, balanced_owners(SAMPLES, nodes, rng), capacity, rng)
    caches = refill(caches, balanced_owners(SAMPLES, nodes, rng), capacity, rng)
    owners = balanced_owners(SAMPLES, nodes, rng)
    sizes = np.maximum(1, rng.lognormal(np.log(MEDIAN_BYTES), SIGMA, SAMPLES)).astype(np.int64)
    holders = coding.holder_bits(caches, SAMPLES)
    planners = {"new": coding} if old is None else {"old": old, "new": coding}
    out: dict[str, object] = {
        "nodes": nodes,
        "alpha": round(alpha, 4),
        "samples": SAMPLES,
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    same = identical = True
    for scheme in SCHEMES:
        walls: dict[str, list[float]] = {name: [] for name in planners}
        cpus: dict[str, list[float]] = {name: [] for name in planners}
        plans: dict[str, coding.Packets] = {}
        for _ in range(REPEATS):
            for name, planner in planners.items():
                plans[name], wall, cpu = timed(planner, holders, owners, scheme, sizes)
                walls[name].append(wall)
                cpus[name].append(cpu)
        for name in planners:
            out[f"{name}_{scheme}_s"] = statistics.median(walls[name])
            out[f"{name}_{scheme}_cpu"] = statistics.median(cpus[name])
            out[f"{name}_{scheme}_tx"] = coding.load(plans[name], sizes).transmissions
        if old is not None:
            same &= np.array_equal(grouping(plans["old"]), grouping(plans["new"]))
            identical &= all(
                np.array_equal(getattr(plans["old"], field), getattr(plans["new"], field))
                for field in coding.Packets.__dataclass_fields__
            )
    out["same"] = same if old is not None else None
    out["identical"] = identical if old is not None else None
    out["load_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> None:
    old = baseline(sys.argv[sys.argv.index("--baseline") + 1]) if "--baseline" in sys.argv else None
    if "--python-loops" in sys.argv:
        old = python_loops()
    rows = []
    for nodes, alpha in SETTINGS:
        progress(f"{nodes} nodes, alpha {alpha:.4f}, {SAMPLES:,} samples")
        rows.append(row(nodes, alpha, old))
    names = ["old", "new"] if old is not None else ["new"]
    columns = ["nodes", "alpha", "samples", "load", "load_end", "same", "identical"]
    columns += [f"{name}_{scheme}_{unit}" for scheme in SCHEMES for unit in ("s", "cpu", "tx") for name in names]
    report("coded_planning_python" if "--python-loops" in sys.argv else "coded_planning", rows, columns)


if __name__ == "__main__":
    main()
