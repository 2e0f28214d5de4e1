"""Coordinated prep for a sweep: k jobs on one node, each with a CPU-bound prep
and a fixed simulated training step, as k independent loaders (every job preps
every batch) against one coordinated group (each batch prepped once), in the
same run on the same staged dataset.

Per k and way: the samples/s each job trains at, and the CPU seconds all jobs
and the daemon spent together. The claim (CoorDL: Mohan et al., VLDB 2021) is that redundant
prep goes away, so total CPU falls toward 1/k of the independent loaders',
and on a machine with fewer cores than jobs need the jobs train faster too.

    python bench/coordinated_prep.py                 # k = 1, 2, 4
    python bench/coordinated_prep.py --quick         # a short check that it runs

The independent loaders are groups of one (the same code path, prep in the
loader's thread), so the comparison measures the sharing, not two loaders.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import progress, register, report, stage

from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

#: A sample: a 64x64 RGBA image's raw bytes.
SIDE = 64
SAMPLE_BYTES = SIDE * SIDE * 4


def prep(sample: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Decode and augment, as an image pipeline would: crop, flip, blur, normalise
    (seeded by the sample, so every member makes the same bytes)."""
    image = np.frombuffer(sample, np.uint8).reshape(SIDE, SIDE, 4)[..., :3].astype(np.float32)
    rng = np.random.default_rng(int.from_bytes(sample[:8], "little"))
    top, left = rng.integers(0, 8, size=2)
    crop = image[top : top + 56, left : left + 56]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    for _ in range(3):
        crop = (crop[:-2, :-2] + crop[1:-1, 1:-1] + crop[2:, 2:]) / 3
    crop = (crop - crop.mean(axis=(0, 1))) / (crop.std(axis=(0, 1)) + 1e-6)
    return np.int64(sample[0]), np.ascontiguousarray(crop.transpose(2, 0, 1))


def worker(args: argparse.Namespace) -> None:
    """One job: trains ``epochs`` epochs, then prints its figures as one JSON line
    (CPU seconds of the training loop and its prep thread, not of start-up)."""
    import dataquay.client as dq

    with dq.connect(args.addr, timeout=30) as client:
        ds = client.dataset(args.dataset)
        with ds.coordinated(
            group=args.group, jobs=args.jobs, prep=prep, batch_size=args.batch_size, timeout=60, workers=args.workers
        ) as loader:
            samples, started, before = 0, time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                for _, images in loader:
                    samples += len(images)
                    time.sleep(args.step)
            wall = time.perf_counter() - started
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
            print(
                json.dumps(
                    {
                        "samples": samples,
                        "wall": wall,
                        "cpu": cpu,
                        "prepped_here": loader.prepped_here,
                        "wait": loader.wait_seconds,
                    }
                ),
                flush=True,
            )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_jobs(daemon: DaemonProcess, args: argparse.Namespace, k: int, coordinated: bool, run: int) -> dict[str, object]:
    """k jobs at once; their mean samples/s and everyone's CPU seconds."""
    assert daemon.process is not None
    groups = [f"coord-{run}"] * k if coordinated else [f"solo-{run}-{i}" for i in range(k)]
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--addr",
        daemon.address,
        "--dataset",
        "bench",
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--step",
        str(args.step),
        "--workers",
        str(args.workers),
    ]
    daemon_cpu = cpu_seconds(daemon.process.pid)
    jobs = [
        subprocess.Popen(
            [*command, "--group", group, "--jobs", str(k if coordinated else 1)], stdout=subprocess.PIPE, text=True
        )
        for group in groups
    ]
    results = []
    for job in jobs:
        out, _ = job.communicate()
        if job.returncode:
            raise RuntimeError(f"a job failed ({job.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    daemon_cpu = cpu_seconds(daemon.process.pid) - daemon_cpu
    jobs_cpu = sum(r["cpu"] for r in results)
    return {
        "k": k,
        "way": "coordinated" if coordinated else "independent",
        "samples/s per job": float(np.mean([r["samples"] / r["wall"] for r in results])),
        "jobs CPU s": jobs_cpu,
        "daemon CPU s": daemon_cpu,
        "total CPU s": jobs_cpu + daemon_cpu,
        "batches prepped": sum(r["prepped_here"] for r in results),
        "wait s per job": float(np.mean([r["wait"] for r in results])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,2,4", help="jobs per run, comma-separated")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--step", type=float, default=0.02, help="seconds of simulated training per batch")
    parser.add_argument("--workers", type=int, default=1, help="prep threads per job, either way")
    parser.add_argument("--quick", action="store_true", help="a short run that only checks the benchmark works")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("addr", "dataset", "group"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.samples, args.epochs, args.ks = 512, 1, "1,2"
    with tempfile.TemporaryDirectory(prefix="dq-bench-coord-") as tmp:
        base = Path(tmp)
        progress(f"writing {args.samples} samples of {SAMPLE_BYTES} bytes")
        root = synthetic.make_files_dataset(base / "pfs", args.samples, sizes=(SAMPLE_BYTES,))
        daemon = DaemonProcess(base / "node", (), dataset_roots=(base,)).start()
        try:
            register(daemon, "bench", root)
            stage(daemon, "bench")
            rows: list[dict[str, object]] = []
            for run, k in enumerate(int(k) for k in args.ks.split(",")):
                pair = []
                for coordinated in (False, True):
                    progress(f"k={k} {'coordinated' if coordinated else 'independent'}")
                    pair.append(run_jobs(daemon, args, k, coordinated, run))
                independent, together = pair
                together["CPU vs independent"] = (
                    together["total CPU s"] / independent["total CPU s"]  # type: ignore[operator]
                )
                together["speed vs independent"] = (
                    together["samples/s per job"] / independent["samples/s per job"]  # type: ignore[operator]
                )
                rows += pair
        finally:
            daemon.stop()
    name = "coordinated_prep-quick" if args.quick else "coordinated_prep"
    report(
        name,
        rows,
        [
            "k",
            "way",
            "samples/s per job",
            "total CPU s",
            "jobs CPU s",
            "daemon CPU s",
            "batches prepped",
            "wait s per job",
            "CPU vs independent",
            "speed vs independent",
        ],
    )


if __name__ == "__main__":
    main()
