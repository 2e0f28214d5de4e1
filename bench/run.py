"""Runs every benchmark: the single-node read path and the cluster figures: `make bench`.

Each prints its table and writes bench/results/<name>.json; BENCHMARKS.md
records a run with the machine it ran on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cache_behind  # noqa: E402
import cache_policy  # noqa: E402
import coded_shuffle  # noqa: E402
import coordinated_prep  # noqa: E402
import directory_load  # noqa: E402
import exchange  # noqa: E402
import memory  # noqa: E402
import miss_bound  # noqa: E402
import peers  # noqa: E402
import placement  # noqa: E402
import reads  # noqa: E402
import record_loops  # noqa: E402
import spill  # noqa: E402
import staging  # noqa: E402
import tight_storage  # noqa: E402
from common import RESULTS, machine  # noqa: E402

from dataquay.server.tools import data_stall, overflow_stall  # noqa: E402


def main() -> None:
    print(f"machine: {machine()}\n")
    benchmarks = (
        ("reads", reads.main),
        ("miss_bound", miss_bound.main),
        ("cache_behind", cache_behind.main),
        ("record_loops", record_loops.main),
        ("staging", staging.main),
        ("memory", memory.main),
        ("placement", lambda: placement.main([])),
        ("peers", peers.main),
        ("exchange", exchange.main),
        ("tight_storage", tight_storage.main),
        ("spill", lambda: spill.main("after")),
        ("stall", lambda: data_stall.main(quick=False, out_dir=RESULTS)),
        ("overflow", lambda: overflow_stall.main(quick=False, out_dir=RESULTS)),
        ("cache_policy", lambda: cache_policy.main([])),
        ("directory_load", directory_load.main),
        ("coordinated_prep", lambda: coordinated_prep.main([])),
        ("coded_shuffle", coded_shuffle.main),
    )
    for name, run in benchmarks:
        started = time.perf_counter()
        print(f"== {name}")
        run()
        print(f"   ({time.perf_counter() - started:.0f} s)\n")


if __name__ == "__main__":
    main()
