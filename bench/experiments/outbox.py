"""The exchange ledger's cost per chunk on the sender's event loop, as an
exchange grows to millions of samples.

Every chunk a stream sends takes the receiver's next pending ids from the
ledger (:class:`Outbox`) and, once acknowledged, marks them delivered; both
run on the sending daemon's event loop, between the sends of its stream's
thread and every other request the daemon serves. This times a stream's
chunks through a ledger of N give-aways over 4 receivers (8 MiB chunks of
110 KiB samples), against a whole scan of the ledger per chunk in the same
run (what a take cost when it looked at every row: ``flatnonzero`` over a
mask of all of them, then a row per id from a dict), and the ledger's build
at the start of a run beside the time that dict took to build. Each figure is the median of ``REPEATS`` runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import REPEATS, progress, report

from dataquay.server.node.exchange.outbox import DELIVERED, IN_FLIGHT, PENDING, Outbox

SIZES = (10_000, 100_000, 1_000_000)
SAMPLE_BYTES = 110 * 1024
CHUNK_BYTES = 8 << 20
CHUNK_ITEMS = 2048
RECEIVERS = 4
#: Chunks timed per run.
CHUNKS = 200


def whole_scan_chunks(box: Outbox, receiver: int, chunks: int) -> tuple[float, float]:
    """Seconds per chunk of the same takes and deliveries, each looking at
    every row; and the seconds to index the rows by id for them."""
    started = time.perf_counter()
    position = {int(sample_id): row for row, sample_id in enumerate(box.ids.tolist())}
    indexed = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(chunks):
        rows = np.flatnonzero((box.receivers == receiver) & (box.state == PENDING))
        fits = int(np.searchsorted(np.cumsum(box.sizes[rows]), CHUNK_BYTES, side="right"))
        rows = rows[: max(1, min(fits, CHUNK_ITEMS))]
        box.state[rows] = IN_FLIGHT
        held = box.ids[rows].tolist()
        box.state[np.unique(np.fromiter((position[i] for i in held if i in position), dtype=np.int64))] = DELIVERED
    return (time.perf_counter() - started) / chunks, indexed


def ledger_chunks(box: Outbox, receiver: int, chunks: int) -> float:
    started = time.perf_counter()
    for _ in range(chunks):
        box.delivered(box.take(receiver, CHUNK_BYTES, CHUNK_ITEMS))
    return (time.perf_counter() - started) / chunks


def one_size(n: int) -> dict[str, object]:
    rng = np.random.default_rng(n)
    ids = rng.choice(8 * n, n, replace=False)
    receivers = rng.integers(0, RECEIVERS, n)
    sizes = np.full(n, SAMPLE_BYTES)
    build, ledger, scan, index = [], [], [], []
    for repeat in range(REPEATS):
        progress(f"outbox of {n} ids: run {repeat + 1} of {REPEATS}")
        started = time.perf_counter()
        box = Outbox(ids, receivers, sizes)
        build.append(time.perf_counter() - started)
        chunks = min(CHUNKS, len(box.pending(0)) * SAMPLE_BYTES // CHUNK_BYTES // 2)
        ledger.append(ledger_chunks(box, 0, chunks))
        per_chunk, indexed = whole_scan_chunks(Outbox(ids, receivers, sizes), 0, chunks)
        scan.append(per_chunk)
        index.append(indexed)
    per_chunk, whole = statistics.median(ledger), statistics.median(scan)
    return {
        "ids": n,
        "build_ms": statistics.median(build) * 1e3,
        "whole_scan_index_ms": statistics.median(index) * 1e3,
        "chunk_us": per_chunk * 1e6,
        "whole_scan_chunk_us": whole * 1e6,
        "whole_scan_over_ledger": whole / per_chunk,
        "rounds_build_s": build,
        "rounds_whole_scan_index_s": index,
        "rounds_chunk_s": ledger,
        "rounds_whole_scan_chunk_s": scan,
    }


def main() -> None:
    report(
        "outbox",
        [one_size(n) for n in SIZES],
        ["ids", "build_ms", "whole_scan_index_ms", "chunk_us", "whole_scan_chunk_us", "whole_scan_over_ledger"],
    )


if __name__ == "__main__":
    main()
