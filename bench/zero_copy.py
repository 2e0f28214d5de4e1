"""Samples handed over without a copy (``get_batch(ids, copy=False)``)
against the bytes path (``get_batch(ids)``), both served by the daemon from
its cache through the trainer's sealed memfd segment.

One daemon with the dataset staged; the trainer's client reads every sample
through it (its in-process cache reads off, misses sent to the daemon), as
a trainer does whose samples another node's daemon holds. Per sample size:
random batches of up to 64 ids (at most 16 MiB a batch, so that a batch fits
a segment whole), each batch handed to a step that makes a NumPy array over
every sample (``np.frombuffer``, no copy of its own) and drops the batch.
The two paths take turns, each timed over whole passes; the figures are the
median of REPEATS rounds: GB/s of wall time, and the trainer's CPU time per
GB (the copy saved is the trainer's work, the daemon's is the same). With
verification on (the default), each payload's checksum is still computed.

    .venv/bin/python bench/zero_copy.py      # about a minute
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPEATS, SIZES, MiB, progress, register, report, stage

import dataquay.client as dq
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

DATASET_BYTES = 192 * MiB
BATCH = 64
BATCH_BYTES = 16 * MiB
PASSES = 3


def one_pass(ds: dq.Dataset, batches: list[np.ndarray], copy: bool) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) to read and step over ``batches``."""
    wall, cpu = time.perf_counter(), time.process_time()
    for ids in batches:
        arrays = [np.frombuffer(sample, np.uint8) for sample in ds.get_batch(ids, copy=copy)]
        assert len(arrays) == len(ids)
        del arrays
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(ds: dq.Dataset, size: int, verify: bool) -> dict[str, object]:
    samples = len(ds)
    per_batch = max(1, min(BATCH, BATCH_BYTES // size))
    rng = np.random.default_rng(size)
    batches = [rng.permutation(samples)[i : i + per_batch] for i in range(0, samples, per_batch)]
    nbytes = PASSES * samples * size
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    one_pass(ds, batches, True)
    one_pass(ds, batches, False)  # both warm: segments made, the daemon's cache in memory
    for _ in range(REPEATS):
        for copy in (True, False):
            times = [one_pass(ds, batches, copy) for _ in range(PASSES)]
            runs[copy].append((sum(t[0] for t in times), sum(t[1] for t in times)))
    row: dict[str, object] = {"size": next(k for k, v in SIZES.items() if v == size), "verify": verify}
    for copy, name in ((True, "bytes"), (False, "views")):
        row[f"{name}_GBps"] = nbytes / float(np.median([w for w, _ in runs[copy]])) / 1e9
        row[f"{name}_cpu_s_per_GB"] = float(np.median([c for _, c in runs[copy]])) / (nbytes / 1e9)
    row["speedup"] = float(row["views_GBps"]) / float(row["bytes_GBps"])  # type: ignore[arg-type]
    return row


def main() -> None:
    rows: list[dict[str, object]] = []
    os.environ["DATAQUAY_MISS_READS"] = "daemon"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        os.environ["DATAQUAY_DATASET_ROOTS"] = str(base)
        daemon = DaemonProcess(base / "node", ("--cache-size", "2G"), dataset_roots=(base,)).start()
        try:
            for label, size in SIZES.items():
                name = f"zc{size}"
                make_files_dataset(base / name, DATASET_BYTES // size, sizes=(size,))
                register(daemon, name, base / name)
                stage(daemon, name)
                for verify in (True, False):
                    progress(f"{label}, verify={verify}")
                    with dq.connect(daemon.address, verify=verify) as client:
                        client.local_cache.release()  # every read through the daemon
                        rows.append(measure(client.dataset(name), size, verify))
        finally:
            daemon.kill()
    columns = ["size", "verify", "bytes_GBps", "views_GBps", "speedup", "bytes_cpu_s_per_GB", "views_cpu_s_per_GB"]
    report("zero_copy", rows, columns, {"load_average": os.getloadavg()})


if __name__ == "__main__":
    main()
