"""Read paths through the client against raw baselines in the same process.

local: ``ds.get_batch`` of 64 random ids, all cached, against a raw py-lmdb
loop over the same environment doing the same work: it gets the batch's 64
values into a list (as get_batch returns them) and computes the xxh3 of each
(get only when verification is off). Both run in this process, one after the
other, each with the environment opened once and warmed.

miss: ``ds.get_batch`` of 64 ids that no cache holds (the daemon reads the PFS
and hands the samples back), against this process reading the same files
directly with open().read(). The files are in the page cache for both.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lmdb
import numpy as np

from common import REPEATS, SIZES, MiB, progress, register, report, stage, stub
from dataquay.client import connect
from dataquay.client.malloc import tune_malloc
from dataquay.client.records import checksum, sample_key
from dataquay.protos import cache_pb2 as pb
from dataquay.server.launch import DaemonProcess
from dataquay.server.synthetic import make_files_dataset

BATCH = 64
LOCAL_BYTES = 256 * MiB
MISS_BYTES = 192 * MiB


def _rate(run, units: int) -> float:  # type: ignore[no-untyped-def]
    import time

    started = time.perf_counter()
    run()
    return units / (time.perf_counter() - started)


def _median(values: list[float]) -> float:
    return float(np.median(values))


def bench_local(daemon: DaemonProcess, root: Path, count: int, label: str) -> dict[str, object]:
    register(daemon, "local", root)
    stage(daemon, "local")
    info = stub(daemon).GetDataset(pb.GetDatasetRequest(name="local"))
    rng = np.random.default_rng(0)
    order = rng.permutation(count)
    batches = [order[i : i + BATCH] for i in range(0, count - BATCH + 1, BATCH)]
    keys = [[sample_key(int(i)) for i in b] for b in batches]
    total = len(batches) * BATCH

    env = lmdb.open(str(daemon.cache_dir), readonly=True, lock=True, max_dbs=8)
    db = env.open_db(info.cache_db.encode(), create=False)

    def raw(verify: bool) -> None:
        for batch in keys:
            with env.begin(db=db) as txn:
                values = [txn.get(k) for k in batch]
                if verify:
                    for value in values:
                        checksum(memoryview(value)[8:])

    raw(True)  # warm
    raw_verify = _median([_rate(lambda: raw(True), total) for _ in range(REPEATS)])
    raw_plain = _median([_rate(lambda: raw(False), total) for _ in range(REPEATS)])
    env.close()

    rows = {}
    for verify in (True, False):
        client = connect(daemon.address, verify=verify)
        ds = client.dataset("local")

        def run() -> None:
            for b in batches:
                ds.get_batch(b)

        run()
        rows[verify] = _median([_rate(run, total) for _ in range(REPEATS)])
        assert client.stats().samples["local"] == (REPEATS + 1) * total, "reads were not all local hits"
        client.close()
    return {
        "size": label,
        "raw_get_xxh3_per_s": raw_verify,
        "client_verified_per_s": rows[True],
        "verified_ratio": rows[True] / raw_verify,
        "raw_get_per_s": raw_plain,
        "client_unverified_per_s": rows[False],
        "unverified_ratio": rows[False] / raw_plain,
    }


def bench_miss(daemon: DaemonProcess, base: Path, size: int, label: str) -> dict[str, object]:
    count = MISS_BYTES // size
    root = make_files_dataset(base / f"miss-{label}", count, sizes=(size,))
    register(daemon, "miss", root)
    manifest_paths = sorted(str(p) for p in root.rglob("*.bin"))
    rng = np.random.default_rng(1)
    direct_rates, miss_rates = [], []
    client = connect(daemon.address)
    for run in range(REPEATS):
        order = rng.permutation(count)
        batches = [order[i : i + BATCH] for i in range(0, count - BATCH + 1, BATCH)]
        total = len(batches) * BATCH

        def direct() -> None:
            for b in batches:
                for i in b:
                    with open(manifest_paths[i], "rb") as f:
                        f.read()

        direct_rates.append(_rate(direct, total))
        stub(daemon).DropDataset(pb.DropDatasetRequest(name="miss"))
        register(daemon, "miss", root)
        ds = client.dataset("miss")
        before = client.stats().samples["pfs"]
        miss_rates.append(_rate(lambda: [ds.get_batch(b) for b in batches], total))
        assert client.stats().samples["pfs"] - before == total, "reads were not all misses"
    client.close()
    direct_rate, miss_rate = _median(direct_rates), _median(miss_rates)
    return {
        "size": label,
        "direct_read_per_s": direct_rate,
        "miss_path_per_s": miss_rate,
        "miss_ratio": miss_rate / direct_rate,
    }


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    parts = os.environ.get("BENCH_PARTS", "local,miss").split(",")
    local_rows, miss_rows = [], []
    with tempfile.TemporaryDirectory(prefix="dq-bench-reads-") as tmp:
        base = Path(tmp)
        for label, size in SIZES.items():
            if label not in wanted:
                continue
            count = LOCAL_BYTES // size
            progress(f"{label}: local hits over {count} cached samples")
            daemon = DaemonProcess(base / f"node-{label}").start()
            root = make_files_dataset(base / f"local-{label}", count, sizes=(size,))
            if "local" in parts:
                local_rows.append(bench_local(daemon, root, count, label))
            if "miss" in parts:
                progress(f"{label}: misses")
                miss_rows.append(bench_miss(daemon, base, size, label))
            daemon.stop()
    report(
        "local_hits",
        local_rows,
        ["size", "raw_get_xxh3_per_s", "client_verified_per_s", "verified_ratio",
         "raw_get_per_s", "client_unverified_per_s", "unverified_ratio"],
    )
    report("miss_path", miss_rows, ["size", "direct_read_per_s", "miss_path_per_s", "miss_ratio"])


if __name__ == "__main__":
    main()
