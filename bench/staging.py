"""Staging throughput, capped and uncapped, and cache space per payload byte.

Datasets of 1 GiB (256 MiB of 4 KiB files). Uncapped staging is compared
with the slower of its two halves done raw in this process: a parallel read
of the same files (as many threads as the daemon's --pfs-threads) and a
batched LMDB write of the same bytes into a fresh environment. Capped staging
is compared with the cap.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
from common import REPEATS, SIZES, MiB, back_free_memory, progress, register, report, stage, stub

from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.records import encode_value, sample_key
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

#: Enough for the daemon's steady state to dominate a run: its first 100 MiB
#: or so are slower while a fresh process's heap and map warm up.
DATASET_BYTES = 1024 * MiB
#: 4 KiB samples stop here (256 MiB), where creating the files would take longest.
MAX_FILES = 65_536
THREADS = 8


def raw_parallel_read(paths: list[str]) -> list[bytes]:
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(read, paths, chunksize=16))


def raw_lmdb_write(directory: Path, payloads: list[bytes], batch_bytes: int = 64 * MiB) -> None:
    env = lmdb.open(str(directory), map_size=2 * DATASET_BYTES, max_dbs=2, sync=False, metasync=False)
    db = env.open_db(b"bench")
    pending = 0
    txn = env.begin(write=True, db=db)
    for i, payload in enumerate(payloads):
        txn.put(sample_key(i), encode_value(payload))
        pending += len(payload)
        if pending >= batch_bytes:
            txn.commit()
            txn, pending = env.begin(write=True, db=db), 0
    txn.commit()
    env.close()


def main() -> None:
    tune_malloc()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-stage-") as tmp:
        base = Path(tmp)
        for label, size in SIZES.items():
            if label not in os.environ.get("BENCH_SIZES", label).split(","):
                continue
            count = min(DATASET_BYTES // size, MAX_FILES)
            total = count * size
            progress(f"staging {label}: {count} files")
            root = make_files_dataset(base / f"pfs-{label}", count, sizes=(size,))
            paths = sorted(str(p) for p in root.rglob("*.bin"))
            payloads = raw_parallel_read(paths)  # also warms the page cache for both sides

            # Raw reads, raw writes and staging runs take turns, each starting
            # on backed memory (see back_free_memory) and removing what it wrote.
            runs = iter(range(100))

            def read_all() -> float:
                back_free_memory()
                started = time.perf_counter()
                nbytes = sum(map(len, raw_parallel_read(paths)))
                return nbytes / (time.perf_counter() - started)

            def write_fresh() -> float:
                directory = base / f"raw-{label}-{next(runs)}"
                back_free_memory()
                started = time.perf_counter()
                raw_lmdb_write(directory, payloads)
                rate = total / (time.perf_counter() - started)
                shutil.rmtree(directory)
                return rate

            def stage_fresh(extra: tuple[str, ...] = ()) -> tuple[float, int]:
                """Stages into a new, empty cache; returns (bytes/s, cache bytes used)."""
                node = base / f"node-{label}-{next(runs)}"
                back_free_memory()
                daemon = DaemonProcess(node, ("--pfs-threads", str(THREADS), *extra), dataset_roots=(base,))
                daemon.start()
                register(daemon, "d", root)
                started = time.perf_counter()
                staged = stage(daemon, "d").read_bytes
                rate = staged / (time.perf_counter() - started)
                used = int(stub(daemon).Stats(pb.StatsRequest()).cache_used_bytes)
                daemon.stop()
                shutil.rmtree(node)
                return rate, used

            write_fresh()  # warm-up
            reads, writes, timed = [], [], []
            for _ in range(REPEATS):
                reads.append(read_all())
                writes.append(write_fresh())
                timed.append(stage_fresh())
                progress(
                    f"  raw read {reads[-1] / 1e6:,.0f} MB/s, raw LMDB write {writes[-1] / 1e6:,.0f} MB/s,"
                    f" staging {timed[-1][0] / 1e6:,.0f} MB/s"
                )
            read_rate = statistics.median(reads)
            write_rate = statistics.median(writes)
            stage_rate = statistics.median(rate for rate, _ in timed)
            used = timed[0][1]

            cap = int(min(read_rate, write_rate) / 4)
            capped_rate, _ = stage_fresh(("--pfs-bandwidth", str(cap)))

            baseline = min(read_rate, write_rate)
            rows.append(
                {
                    "size": label,
                    "raw_read_MBps": read_rate / 1e6,
                    "raw_lmdb_write_MBps": write_rate / 1e6,
                    "staging_MBps": stage_rate / 1e6,
                    "staging_vs_slower_raw": stage_rate / baseline,
                    "cap_MBps": cap / 1e6,
                    "capped_MBps": capped_rate / 1e6,
                    "capped_vs_cap": capped_rate / cap,
                    "cache_bytes_per_payload_byte": used / total,
                }
            )
    report(
        "staging",
        rows,
        [
            "size",
            "raw_read_MBps",
            "raw_lmdb_write_MBps",
            "staging_MBps",
            "staging_vs_slower_raw",
            "cap_MBps",
            "capped_MBps",
            "capped_vs_cap",
            "cache_bytes_per_payload_byte",
        ],
    )


if __name__ == "__main__":
    main()
