"""Runs every benchmark: the single-node read path and the cluster figures: `make bench`.

Each prints its table and writes bench/results/<name>.json; docs/results.md
records a run with the machine it ran on. The one-off experiments that
docs/results.md also cites are in bench/experiments/, each run on its own.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cache_behind
import cache_policy
import coded_shuffle
import coordinated_prep
import directory_load
import exchange
import memory
import miss_bound
import peers
import placement
import read_stream
import reads
import record_loops
import reply_loop
import spill
import staging
import tight_storage
import wide_job
import zero_copy
from common import RESULTS, machine

from dataquay.server.tools import data_stall, overflow_stall


def main() -> None:
    print(f"machine: {machine()}\n")
    benchmarks = (
        ("reads", reads.main),
        ("miss_bound", miss_bound.main),
        ("cache_behind", cache_behind.main),
        ("record_loops", record_loops.main),
        ("reply_loop", lambda: reply_loop.main([])),
        ("read_stream", read_stream.main),
        ("zero_copy", zero_copy.main),
        ("staging", staging.main),
        ("memory", memory.main),
        ("placement", lambda: placement.main([])),
        ("wide_job", lambda: wide_job.main([])),
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
