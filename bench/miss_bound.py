"""How close any miss path can come to reading the files directly, on this machine.

A miss must at least be read, framed as a cache value (checksum and copy),
handed to the client (a copy into its shared-memory segment and one out of
it) and inserted into LMDB. This does exactly that work in one thread of
one process, with no RPC, no thread hop and no checksum check on the client
side, against the same process reading the files with open().read(), both on
page-cached files in the random order of ``bench/reads.py``. The ratios are
ceilings for the real miss path: once with the insert in the same thread,
once without it (as if another core did every insert for free).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np
from common import SIZES, back_free_memory, progress, report

from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.records import CHECKSUM_BYTES, encode_value, sample_key

BATCH = 64
DATASET_BYTES = 192 << 20


def _rate(run, samples: int) -> float:  # type: ignore[no-untyped-def]
    run()  # warm
    back_free_memory()
    started = time.perf_counter()
    run()
    return samples / (time.perf_counter() - started)


def bound(base: Path, size: int) -> dict[str, float]:
    count = DATASET_BYTES // size
    paths = []
    for i in range(count):
        path = base / f"{i}.bin"
        path.write_bytes(os.urandom(size))
        paths.append(str(path))
    batches = np.random.default_rng(0).permutation(count)[: count - count % BATCH].reshape(-1, BATCH)
    segment = mmap.mmap(-1, BATCH * size)
    envs = iter(range(100))

    def direct() -> None:
        for batch in batches:
            for i in batch:
                with open(paths[i], "rb") as f:
                    f.read()

    def least_work(insert: bool) -> None:
        env = lmdb.open(str(base / f"env-{next(envs)}"), map_size=1 << 32, sync=False, metasync=False)
        for batch in batches:
            values = []
            for i in batch:
                with open(paths[i], "rb") as f:
                    values.append(encode_value(f.read()))
            for slot, value in enumerate(values):
                segment[slot * size : (slot + 1) * size] = memoryview(value)[CHECKSUM_BYTES:]
            received = [segment[slot * size : (slot + 1) * size] for slot in range(len(values))]
            assert len(received) == len(batch)
            if insert:
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti([(sample_key(int(i)), v) for i, v in zip(batch, values)])
        env.close()

    samples = batches.size
    direct_rate = _rate(direct, samples)
    handover = _rate(lambda: least_work(False), samples)
    with_insert = _rate(lambda: least_work(True), samples)
    return {
        "direct_per_s": direct_rate,
        "handover_per_s": handover,
        "handover_ratio": handover / direct_rate,
        "with_insert_per_s": with_insert,
        "with_insert_ratio": with_insert / direct_rate,
    }


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    rows: list[dict[str, object]] = []
    for label, size in SIZES.items():
        if label in wanted:
            progress(f"{label}: least work of a miss against direct reads")
            with tempfile.TemporaryDirectory(prefix="dq-bench-bound-") as tmp:
                rows.append({"size": label, **bound(Path(tmp), size)})
    report(
        "miss_bound",
        rows,
        ["size", "direct_per_s", "handover_per_s", "handover_ratio", "with_insert_per_s", "with_insert_ratio"],
    )


if __name__ == "__main__":
    main()
