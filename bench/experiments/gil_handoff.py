"""What a thread that lets go of the GIL around each LMDB call pays for it
beside a thread running Python, at three GIL switch intervals.

The bulk path's sending thread looks up an exchange chunk's values in one
read transaction, a ``get`` each (74 for 8 MiB of 110 KiB values); py-lmdb
releases the GIL around every call, so each lookup has to take it back from
whatever else runs Python then (in a daemon, the event loop). Here a chunk's
lookups run alone, then beside a thread that never stops running Python (the
worst case) and beside one that wakes every millisecond for a little work,
each at CPython's default interval (5 ms), the daemon's
(:data:`dataquay.server.loops.GIL_SWITCH_SECONDS`) and a shorter one. The
ratio is against the lookups alone in the same run; medians of ``REPEATS``.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import REPEATS, MiB, progress, report

from dataquay.client.wire.records import sample_key
from dataquay.server.loops import GIL_SWITCH_SECONDS

VALUES = 2048
VALUE_BYTES = 110 * 1024
CHUNK_VALUES = 74
CHUNKS = 40
INTERVALS = {"5 ms (CPython's default)": 0.005, "1 ms (the daemon's)": GIL_SWITCH_SECONDS, "0.2 ms": 0.0002}


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _waking(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)
        sum(range(2000))


def _chunks_seconds(env: lmdb.Environment, chunks: list[list[bytes]]) -> float:
    """Seconds a chunk: its values' lookups in a read transaction of their own."""
    started = time.perf_counter()
    for keys in chunks:
        with env.begin(buffers=True) as txn:
            get = txn.get
            values = [get(key) for key in keys]
            assert all(value is not None for value in values)
    return (time.perf_counter() - started) / len(chunks)


def _beside(
    env: lmdb.Environment,
    chunks: list[list[bytes]],
    neighbour: Callable[[threading.Event], None] | None,
    interval: float,
) -> float:
    default = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    stop = threading.Event()
    thread = threading.Thread(target=neighbour, args=(stop,)) if neighbour else None
    try:
        if thread is not None:
            thread.start()
        return statistics.median(_chunks_seconds(env, chunks) for _ in range(REPEATS))
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        sys.setswitchinterval(default)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dq-bench-gil-") as tmp:
        env = lmdb.open(str(Path(tmp) / "cache"), map_size=VALUES * (VALUE_BYTES + 8192) + 64 * MiB, sync=False)
        value = os.urandom(VALUE_BYTES)
        with env.begin(write=True) as txn:
            for i in range(VALUES):
                txn.put(sample_key(i), value)
        rng = random.Random(0)
        chunks = [[sample_key(i) for i in sorted(rng.sample(range(VALUES), CHUNK_VALUES))] for _ in range(CHUNKS)]
        _chunks_seconds(env, chunks)  # the map's pages in memory
        alone = _beside(env, chunks, None, 0.005)
        rows: list[dict[str, object]] = [
            {"beside": "nothing", "interval": "5 ms", "us_per_chunk": alone * 1e6, "ratio_to_alone": 1.0}
        ]
        for name, neighbour in (("a thread running Python", _busy), ("a thread waking every ms", _waking)):
            for label, interval in INTERVALS.items():
                progress(f"{CHUNK_VALUES} lookups a chunk beside {name}, switch interval {label}")
                seconds = _beside(env, chunks, neighbour, interval)
                rows.append(
                    {
                        "beside": name,
                        "interval": label,
                        "us_per_chunk": seconds * 1e6,
                        "ratio_to_alone": seconds / alone,
                    }
                )
        env.close()
    report("gil_handoff", rows, ["beside", "interval", "us_per_chunk", "ratio_to_alone"])


if __name__ == "__main__":
    main()
