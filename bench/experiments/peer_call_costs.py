"""A peer hit's CPU split into what each call costs and what each byte
costs, per process: the bound a compiled per-call step could reach.

Setup: a directory and two daemons on loopback (LocalCluster), a ``global``
job staged on both, a client on node-0 reading the ids node-1 owns with
``get_batch(copy=False)`` (the trainer's segment holds the payloads, as
shipped). The reads run in rounds of ``SECONDS`` each at batch sizes of 16,
64 and 256, in turn, ``ROUNDS`` times; every process's CPU (user + system,
from /proc; this process's own clock for the client) is then fitted per
process by least squares as ``calls x per_call + GB x per_GB``. At a fixed
sample size the per-GB part holds what each sample costs too.

The table gives each process's two parts, the fit's largest miss over the
rounds, and, for batches of 64, the share of a peer hit's CPU that is per
call, against a raw TCP stream's CPU per GB (cpu_per_gb.py's, which this
does not rerun): what taking the per-call part to nothing would reach.

    .venv/bin/python bench/experiments/peer_call_costs.py [--size-kib 110] [--seconds 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import load_average, progress, report, stub
from cpu_meter import Meter

from dataquay.client import connect
from dataquay.client.malloc import tune_malloc
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

BATCHES = (16, 64, 256)
#: Bytes of the dataset; node-1 owns about half.
DATASET_BYTES = 240 << 20
ROLES = ("node0", "node1", "client")


def _rounds(local: LocalCluster, size: int, seconds: float, rounds: int) -> list[dict[str, float]]:
    """Calls, GB and each process's CPU seconds of every round."""
    node0, node1 = local.daemons
    assert node0.process is not None and node1.process is not None
    meter = Meter({"node0": node0.process.pid, "node1": node1.process.pid})
    with connect(node0.address) as client:
        ds = client.dataset("calls")
        theirs = np.flatnonzero(ds.sampler(job="calls", rank=0, world_size=2).owners(0) == 1)
        out = []
        for batch in BATCHES * rounds:
            batches = [theirs[i : i + batch].tolist() for i in range(0, len(theirs) - batch + 1, batch)]
            for ids in batches:  # untimed: the segment sized for this batch, connections made
                ds.get_batch(ids, copy=False)
            calls = 0
            with meter.measure():
                started = time.perf_counter()
                while time.perf_counter() - started < seconds:
                    for ids in batches:
                        ds.get_batch(ids, copy=False)
                    calls += len(batches)
            out.append({"batch": batch, "calls": calls, "GB": calls * batch * size / 1e9, **meter.spent})
            progress(f"batch {batch}: {calls} calls")
    return out


def fit(rounds: list[dict[str, float]]) -> list[dict[str, object]]:
    """Per process: ms per call, s per GB, and the fit's largest relative miss."""
    design = np.array([[r["calls"], r["GB"]] for r in rounds])
    rows = []
    for role in ROLES:
        spent = np.array([r[role] for r in rounds])
        (per_call, per_gb), *_ = np.linalg.lstsq(design, spent, rcond=None)
        miss = float(np.max(np.abs(design @ [per_call, per_gb] - spent) / spent))
        rows.append({"process": role, "ms_per_call": per_call * 1e3, "s_per_GB": per_gb, "worst_miss": miss})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-kib", type=int, default=110, help="bytes of every sample, in KiB")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of reads a round")
    parser.add_argument("--rounds", type=int, default=2, help="times each batch size is measured")
    args = parser.parse_args()
    tune_malloc()
    size = args.size_kib * 1024
    loads = [load_average()]
    with tempfile.TemporaryDirectory(prefix="dq-bench-calls-") as tmp:
        base = Path(tmp)
        root = make_files_dataset(base / "pfs", DATASET_BYTES // size, sizes=(size,))
        with LocalCluster(base / "cluster", 2, dataset_roots=(base,)) as local:
            stubs = [stub(daemon) for daemon in local.daemons]
            stubs[0].AddDataset(pb.AddDatasetRequest(name="calls", root=str(root)))
            spec = jpb.JobSpec(job_id="calls", dataset="calls", nodes=["node-0", "node-1"])
            stubs[0].JoinJob(jpb.JoinJobRequest(spec=spec))
            for node in stubs:
                *_, last = node.Stage(pb.StageRequest(dataset="calls", job="calls"))
                assert not last.error and last.done_samples == last.total_samples, last
            rounds = _rounds(local, size, args.seconds, args.rounds)
    loads.append(load_average())
    rows = fit(rounds)
    per_call_64 = sum(float(r["ms_per_call"]) for r in rows) / 1e3 / (64 * size / 1e9)  # type: ignore[arg-type]
    per_gb = sum(float(r["s_per_GB"]) for r in rows)  # type: ignore[arg-type]
    summary = {
        "per_call_s_per_GB_at_64": per_call_64,
        "per_GB_s": per_gb,
        "share_per_call_at_64": per_call_64 / (per_call_64 + per_gb),
    }
    report(
        "peer_call_costs",
        rows,
        ["process", "ms_per_call", "s_per_GB", "worst_miss"],
        {"rounds": rounds, "load_average": loads, **summary},
    )
    print(
        f"batches of 64: {per_call_64:.3f} s/GB per call + {per_gb:.3f} s/GB per byte; "
        f"{summary['share_per_call_at_64']:.0%} of a peer hit's CPU is per call"
    )


if __name__ == "__main__":
    main()
