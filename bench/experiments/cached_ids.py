"""Which of a window of ids the cache holds: the store's in-memory bit set
(``Store.cached_mask``, :mod:`dataquay.server.node.cache.cached_ids`) against the
LMDB key lookups it replaced (a cursor's ``set_key`` per id, in one read
transaction), on the same store.

The stager, the read ahead's scan of each epoch and both ends of the
exchange ask this of windows of thousands of ids, on the event loop. Each
LMDB lookup releases and takes back the GIL; with a bulk stream's threads
sending and receiving beside it (a socket pair here, 1 MiB a call) each of
those hand-offs may wait for them. Both are timed alone and beside such a
stream.

    .venv/bin/python bench/experiments/cached_ids.py      # about 10 s
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import REPEATS, progress, report

from dataquay.client.wire.record_loops import sample_keys
from dataquay.client.wire.records import encode_value
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite

CACHED = 1_000_000
#: Ids asked at once, as the read ahead's scan asks them.
WINDOW = 4096
LOOKUPS = 400_000


def lmdb_lookups(store: Store, ids: np.ndarray) -> np.ndarray:
    """What ``Store.cached_mask`` did before the bit set."""
    with store.env.begin(db=store.env.open_db(b"ds", create=False), buffers=True) as txn:
        return np.fromiter(map(txn.cursor().set_key, sample_keys(ids.tolist())), dtype=bool, count=len(ids))


def ns_per_id(mask: Callable[[np.ndarray], np.ndarray], windows: list[np.ndarray], expected: list[int]) -> float:
    started = time.perf_counter()
    for ids, held in zip(windows, expected):
        assert int(mask(ids).sum()) == held
    return (time.perf_counter() - started) / sum(len(w) for w in windows) * 1e9


@contextmanager
def bulk_stream() -> Iterator[None]:
    """A socket pair streaming 1 MiB a call each way between two threads until the block ends."""
    sender, receiver = socket.socketpair()
    stop = threading.Event()
    payload = memoryview(bytes(1 << 20))

    def send() -> None:
        while not stop.is_set():
            sender.sendall(payload)
        sender.close()

    def receive() -> None:
        buffer = bytearray(1 << 20)
        while receiver.recv_into(buffer):
            pass

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        receiver.close()


async def filled_store(path: Path) -> Store:
    store = Store(path, 1 << 30)
    store.open()
    await store.open_dataset("ds")
    writer = asyncio.get_running_loop().create_task(store.run_writer())
    value = encode_value(bytes(16))
    for first in range(0, 2 * CACHED, 2 * 65536):  # every other id
        ids = range(first, min(2 * CACHED, first + 2 * 65536), 2)
        await store.committed(await store.put_all(PendingWrite(b"ds", i, value) for i in ids))
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)
    return store


def main() -> None:
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 2 * CACHED, WINDOW) for _ in range(LOOKUPS // WINDOW)]
    expected = [int((w % 2 == 0).sum()) for w in windows]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="dataquay-bench-") as tmp:
        progress(f"caching {CACHED} ids")
        store = asyncio.run(filled_store(Path(tmp) / "cache"))
        try:
            for beside in ("alone", "beside a bulk stream"):
                progress(f"asking {LOOKUPS} ids, {beside}")
                with bulk_stream() if beside != "alone" else nullcontext():
                    lmdb_ns = statistics.median(
                        ns_per_id(lambda ids: lmdb_lookups(store, ids), windows, expected) for _ in range(REPEATS)
                    )
                    bits_ns = statistics.median(
                        ns_per_id(lambda ids: store.cached_mask("ds", ids), windows, expected) for _ in range(REPEATS)
                    )
                rows.append(
                    {
                        "asked": beside,
                        "lmdb_ns_per_id": lmdb_ns,
                        "bit_set_ns_per_id": bits_ns,
                        "lmdb_over_bit_set": lmdb_ns / bits_ns,
                    }
                )
        finally:
            store.close()
    report(
        "cached_ids",
        rows,
        ["asked", "lmdb_ns_per_id", "bit_set_ns_per_id", "lmdb_over_bit_set"],
        {"cached_ids": CACHED, "window": WINDOW},
    )


if __name__ == "__main__":
    main()
