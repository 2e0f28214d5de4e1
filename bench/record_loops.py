"""The local-hit loop with the compiled record loops and with their Python
fallback (an install without a C compiler): batches of 256 random ids, each
key built, looked up in a warm LMDB and its value checked and copied.

    .venv/bin/python bench/record_loops.py      # about 20 s
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import lmdb
import numpy as np
from common import REPEATS, SIZES, report

from dataquay.client.wire import _records, _records_py
from dataquay.client.wire.records import encode_value

SAMPLES = 4096
BATCH = 256
SECONDS = 1.0


def rate(loops: ModuleType, env: lmdb.Environment, rng: np.random.Generator) -> float:
    """Samples per second through keys, lookups and checked copies, for SECONDS."""
    batches = [rng.integers(0, SAMPLES, BATCH).tolist() for _ in range(64)]
    done = 0
    started = time.perf_counter()
    with env.begin(buffers=True) as txn:
        get: Callable[[bytes], memoryview | None] = txn.get
        while time.perf_counter() - started < SECONDS:
            for ids in batches:
                payloads, absent, corrupt = loops.payload_copies(list(map(get, loops.sample_keys(ids))), True)
                assert not absent and not corrupt
                done += len(payloads)
    return done / (time.perf_counter() - started)


def main() -> None:
    rows: list[dict[str, object]] = []
    rng = np.random.default_rng(0)
    for label, size in SIZES.items():
        if size > 128 * 1024:
            continue
        with tempfile.TemporaryDirectory(prefix="dataquay-bench-") as tmp:
            env = lmdb.open(str(Path(tmp) / "db"), map_size=SAMPLES * (size + 8192) * 2)
            with env.begin(write=True) as txn:
                for i in range(SAMPLES):
                    txn.put(i.to_bytes(8, "big"), encode_value(rng.bytes(size)))
            rates = {
                name: statistics.median(rate(loops, env, rng) for _ in range(REPEATS))
                for name, loops in (("c", _records), ("python", _records_py))
            }
            env.close()
        rows.append(
            {
                "size": label,
                "compiled_per_s": rates["c"],
                "python_per_s": rates["python"],
                "compiled_over_python": rates["c"] / rates["python"],
            }
        )
    report("record_loops", rows, ["size", "compiled_per_s", "python_per_s", "compiled_over_python"])


if __name__ == "__main__":
    main()
