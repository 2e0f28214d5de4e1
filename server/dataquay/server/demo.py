"""``dataquay demo``: a daemon, a synthetic dataset on a stand-in PFS, staging,
a few epochs of a simulated training loop, and a report.

Everything lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dataquay.client import Dataset, Sampler, connect
from dataquay.client.malloc import tune_malloc
from dataquay.server.cli import main as cli_main
from dataquay.server.launch import DaemonProcess
from dataquay.server.sizes import format_bytes
from dataquay.server.synthetic import make_files_dataset

SIZES = (4 << 10, 16 << 10, 64 << 10, 110 << 10, 256 << 10)
BATCH = 64
#: Simulated GPU time per batch: enough that a cached epoch is compute-bound.
COMPUTE_SECONDS = 0.002


@dataclass
class EpochReport:
    epoch: int
    samples: int
    tiers: dict[str, int]
    nbytes: int
    wall: float
    wait: float


def _train_epoch(ds: Dataset, sampler: Sampler, epoch: int) -> EpochReport:
    client = ds.client
    before = client.stats()
    sampler.set_epoch(epoch)
    ids = np.fromiter(sampler, dtype=np.int64)
    started = time.perf_counter()
    nbytes = 0
    for start in range(0, len(ids), BATCH):
        batch = ds.get_batch(ids[start : start + BATCH])
        nbytes += sum(map(len, batch))
        time.sleep(COMPUTE_SECONDS)
    wall = time.perf_counter() - started
    after = client.stats()
    tiers = {t: after.samples[t] - before.samples[t] for t in after.samples}
    return EpochReport(epoch, len(ids), tiers, nbytes, wall, after.data_wait_seconds - before.data_wait_seconds)


def _direct_epoch(ds: Dataset, sampler: Sampler) -> tuple[float, float]:
    """The same epoch read straight from the files: (wall, wait) seconds."""
    manifest = ds.manifest
    paths = [f"{manifest.root}/{manifest.location(i).path}" for i in range(len(manifest))]
    sampler.set_epoch(0)
    ids = list(sampler)
    started = time.perf_counter()
    wait = 0.0
    for start in range(0, len(ids), BATCH):
        t0 = time.perf_counter()
        for i in ids[start : start + BATCH]:
            with open(paths[i], "rb") as f:
                f.read()
        wait += time.perf_counter() - t0
        time.sleep(COMPUTE_SECONDS)
    return time.perf_counter() - started, wait


def run_demo(samples: int = 4000, epochs: int = 3) -> None:
    tune_malloc()
    with tempfile.TemporaryDirectory(prefix="dataquay-demo-") as tmp:
        base = Path(tmp)
        print(f"dataquay demo: one node, {samples} samples of {len(SIZES)} sizes, {epochs} epochs\n")
        root = make_files_dataset(base / "pfs" / "demo", samples, sizes=SIZES, classes=10)
        total = sum(SIZES[i % len(SIZES)] for i in range(samples))
        print(f"PFS      {root}  ({samples} files in 10 class folders, {format_bytes(total)})")
        daemon = DaemonProcess(base / "node0").start()
        try:
            assert daemon.ready is not None
            print(f"daemon   pid {daemon.ready['pid']}, socket {daemon.address}")
            print(f"metrics  {daemon.metrics_url}\n")
            addr = ["--addr", daemon.address]
            if cli_main(["dataset", "add", "demo", str(root), *addr]) or cli_main(["stage", "demo", *addr]):
                raise SystemExit(1)
            print()
            client = connect(daemon.address)
            ds = client.dataset("demo")
            sampler = ds.sampler(rank=0, world_size=1, seed=42)
            print(f"training: batches of {BATCH}, {COMPUTE_SECONDS * 1e3:.0f} ms of simulated compute per batch\n")
            header = ("epoch", "samples", "local", "daemon", "pfs", "wall s", "samples/s", "MB/s", "data-wait s", "stall %")
            rows: list[tuple[object, ...]] = []
            for epoch in range(epochs):
                r = _train_epoch(ds, sampler, epoch)
                daemon_served = r.tiers["daemon-local"] + r.tiers["peer"]
                pfs = r.tiers["pfs"] + r.tiers["fallback"]
                rows.append((
                    r.epoch, r.samples, f"{100 * r.tiers['local'] / r.samples:.0f}%",
                    f"{100 * daemon_served / r.samples:.0f}%", f"{100 * pfs / r.samples:.0f}%",
                    f"{r.wall:.2f}", f"{r.samples / r.wall:,.0f}", f"{r.nbytes / r.wall / 1e6:,.0f}",
                    f"{r.wait:.3f}", f"{100 * r.wait / r.wall:.1f}",
                ))
            wall, wait = _direct_epoch(ds, sampler)
            rows.append((
                "direct", samples, "", "", "100%", f"{wall:.2f}", f"{samples / wall:,.0f}",
                f"{total / wall / 1e6:,.0f}", f"{wait:.3f}", f"{100 * wait / wall:.1f}",
            ))
            widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
            for row in (header, *rows):
                print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
            print(
                "\n'direct' is the same epoch read straight from the files. Here the files sit in\n"
                "this machine's page cache; on a shared PFS every one of those reads crosses the\n"
                "network, which is the load the cache takes off it from the first epoch on."
            )
            client.close()
        finally:
            daemon.stop()
