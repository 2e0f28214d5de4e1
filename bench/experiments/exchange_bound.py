"""How close any exchange can come to a raw TCP stream, on this machine.

An exchanged sample must at least be sent out of the sender's cache, received,
checked against its checksum and committed to the receiver's LMDB. This does
exactly that work, with the daemon's own frames (``bulk/frames.py``) and with
none of the rest: no event loop, no offer, no reservation, no acknowledgement,
no read ahead competing at the epoch's start. A child process holds the
samples in an LMDB cache (``writemap`` over a file allocated ahead, as the
store) and writes 4 MiB chunks straight out of its map with ``sendmsg`` on a
blocking socket; this process receives each chunk's body with ``recv_into``
into a fresh buffer, checks every value's checksum and hands the chunk to a
writer thread, which commits it with ``putmulti`` in a transaction of its own
into such a cache. Against it, in the same rounds, the raw TCP stream of
``bench/experiments/wire.py`` over the same bytes: the child answers an 8-byte request
per batch of 64 samples with one ``sendall``, this process receives each
batch into one buffer it reuses. Before each timed run the free memory is
backed (``common.back_free_memory``), as ``bench/experiments/wire.py`` does.

The ratio is a ceiling for the daemon's exchange (``bench/experiments/wire.py``) on this
machine; the CPU seconds per GB say what the two ends cost, all threads.
``BENCH_CHUNK_MIB`` sets the chunk (4 MiB by default; the daemon sends up
to ``streams.CHUNK_BYTES``): how much the receiver holds between receiving
a value and committing it. ``BENCH_PART_KIB`` has the receiver take each
chunk in parts of that size, each committed as soon as it is in.

A third receiver, ``in_place``, bounds the design that LMDB's ``MDB_RESERVE``
would allow (py-lmdb does not expose it): each value received straight into
the pages of a file mapped as the store maps its cache (allocated ahead,
shared, written through the map), its checksum checked there. It takes the
same stream as the least exchange and spares its second copy and its
transactions.
"""

from __future__ import annotations

import mmap
import os
import queue
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import REPEATS, MiB, back_free_memory, progress, report
from store_bounds import allocated_cache

from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.records import decode_value, encode_value, sample_key
from dataquay.server.node.peers.bulk.frames import END, SAMPLE, chunk_frames, parse_chunk, recv_exactly

SIZES = {"110KiB": 110 * 1024, "1MiB": MiB}
EXCHANGE_BYTES = int(os.environ.get("BENCH_EXCHANGE_MIB", "512")) * MiB
CHUNK_BYTES = int(os.environ.get("BENCH_CHUNK_MIB", "4")) * MiB
#: Received and committed in parts of this many bytes of a chunk (0: whole chunks).
PART_BYTES = int(os.environ.get("BENCH_PART_KIB", "0")) * 1024
#: The raw stream's batches, each asked for with an 8-byte request, as bench/experiments/wire.py's.
BATCH = 64
_REQUEST = struct.Struct("<Q")
RAW = "raw"
LEAST = "least"
IN_PLACE = "in_place"
#: What this process sends the child to start a run of each kind, and to end.
KINDS = {RAW: b"r", LEAST: b"l", IN_PLACE: b"l"}
QUIT = b"q"


def _chunks(count: int, size: int) -> list[range]:
    per = max(1, CHUNK_BYTES // size)
    return [range(first, min(count, first + per)) for first in range(0, count, per)]


def _sender(port: int, home: Path, size: int, count: int) -> None:
    """The child: stages ``count`` values, then sends each run asked for."""
    env = allocated_cache(home, 2 * count * (size + 8192) + (64 << 20))
    db = env.open_db(b"bench")
    payload = os.urandom(size)
    value = encode_value(payload)
    with env.begin(write=True, db=db) as txn:
        for i in range(count):
            txn.put(sample_key(i), value, append=True)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (kind := sock.recv(1)) != QUIT:
        started = time.process_time()
        if kind == KINDS[RAW]:
            batch = memoryview(payload * BATCH)
            for first in range(0, count, BATCH):
                recv_exactly(sock, memoryview(bytearray(_REQUEST.size)))
                sock.sendall(batch[: min(BATCH, count - first) * size])
        else:
            with env.begin(db=db, buffers=True) as txn:
                for chunk in _chunks(count, size):
                    sock.sendmsg(chunk_frames([(i, _stored(txn, i)) for i in chunk]))
            sock.sendall(SAMPLE.pack(END, 0, 0, 0))
        sock.recv(1)
        sock.sendall(f"{time.process_time() - started:.6f}\n".encode())
    env.close()


def _stored(txn: lmdb.Transaction, sample_id: int) -> bytes | memoryview:
    value = txn.get(sample_key(sample_id))
    assert value is not None, f"sample {sample_id} was staged"
    return value


def _line(sock: socket.socket) -> str:
    out = b""
    while not out.endswith(b"\n"):
        out += sock.recv(1)
    return out.decode()


def _raw(sock: socket.socket, count: int, size: int) -> None:
    view = memoryview(bytearray(BATCH * size))
    for first in range(0, count, BATCH):
        sock.sendall(_REQUEST.pack(first))
        recv_exactly(sock, view[: min(BATCH, count - first) * size])


def _least(sock: socket.socket, env: lmdb.Environment, max_value: int) -> int:
    """Receives, checks and commits one run; returns the payload bytes committed."""
    db = env.open_db(b"bench")
    commits: queue.Queue[list[tuple[bytes, bytes | memoryview]] | None] = queue.Queue(4)

    def writer() -> None:
        while (items := commits.get()) is not None:
            with env.begin(write=True, db=db) as txn:
                txn.cursor().putmulti(items)

    thread = threading.Thread(target=writer)
    thread.start()
    header = bytearray(SAMPLE.size)
    committed = 0
    try:
        while True:
            recv_exactly(sock, memoryview(header))
            status, count, body_bytes, _ = SAMPLE.unpack(header)
            if status == END:
                break
            # Every value here is one size: a part of whole frames is `per` frames.
            frame = body_bytes // count
            per = max(1, PART_BYTES // frame) if PART_BYTES else count
            for first in range(0, count, per):
                taken = min(per, count - first)
                body = np.empty(taken * frame, dtype=np.uint8).data
                recv_exactly(sock, body)
                good = [
                    (sample_key(i), v) for i, v in parse_chunk(body, taken, max_value) if decode_value(v) is not None
                ]
                committed += sum(len(v) for _, v in good)
                commits.put(good)
    finally:
        commits.put(None)
        thread.join()
    return committed


def _in_place(sock: socket.socket, home: Path, size: int, max_value: int) -> int:
    """Receives one run's values into a mapped file, each checked where it
    landed; returns the payload bytes received intact."""
    home.mkdir(parents=True)
    with open(home / "values", "w+b") as file:
        os.posix_fallocate(file.fileno(), 0, size)
        pages = mmap.mmap(file.fileno(), size)
    view = memoryview(pages)
    header = memoryview(bytearray(SAMPLE.size))
    at = intact = 0
    try:
        while True:
            recv_exactly(sock, header)
            status, count, _, _ = SAMPLE.unpack(header)
            if status == END:
                break
            for _ in range(count):
                recv_exactly(sock, header)
                _, _, length, _ = SAMPLE.unpack(header)
                assert length <= max_value and at + length <= size, "the mapped file holds every value"
                recv_exactly(sock, view[at : at + length])
                if decode_value(view[at : at + length]) is not None:
                    intact += length
                at += length
    finally:
        view.release()
        pages.close()
    return intact


def bound(base: Path, label: str, size: int) -> dict[str, object]:
    count = EXCHANGE_BYTES // size
    listener = socket.create_server(("127.0.0.1", 0))
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--send",
            str(listener.getsockname()[1]),
            str(base / f"sender-{label}"),
            str(size),
            str(count),
        ]
    )
    rates: dict[str, list[float]] = {RAW: [], LEAST: [], IN_PLACE: []}
    cpu: dict[str, list[float]] = {
        f"{kind}_{side}": [] for kind in (LEAST, IN_PLACE) for side in ("sender", "receiver")
    }
    try:
        sock, _ = listener.accept()
        map_bytes = 2 * count * (size + 8192) + (64 << 20)
        for round_ in range(REPEATS):
            progress(f"exchange bound {label}: round {round_ + 1} of {REPEATS}")
            for name in (RAW, LEAST, IN_PLACE):
                home = base / f"receiver-{label}-{round_}"
                env = allocated_cache(home, map_bytes) if name == LEAST else None
                back_free_memory()
                started, cpu_started = time.perf_counter(), time.process_time()
                sock.sendall(KINDS[name])
                if name == RAW:
                    _raw(sock, count, size)
                elif name == IN_PLACE:
                    assert _in_place(sock, home, map_bytes, size + 64) == count * (size + 8)
                else:
                    assert env is not None and _least(sock, env, size + 64) == count * (size + 8)
                elapsed, receiver_cpu = time.perf_counter() - started, time.process_time() - cpu_started
                sock.sendall(b"d")
                sender_cpu = float(_line(sock))
                rates[name].append(count * size / elapsed / 1e9)
                if name != RAW:
                    cpu[f"{name}_sender"].append(sender_cpu / (count * size / 1e9))
                    cpu[f"{name}_receiver"].append(receiver_cpu / (count * size / 1e9))
                if env is not None:
                    env.close()
                shutil.rmtree(home, ignore_errors=True)
        sock.sendall(QUIT)
    finally:
        child.wait(60)
        listener.close()
    gbps = {name: float(statistics.median(values)) for name, values in rates.items()}
    return {
        "size": label,
        "raw_tcp_GBps": gbps[RAW],
        "least_exchange_GBps": gbps[LEAST],
        "least_exchange_ratio": gbps[LEAST] / gbps[RAW],
        "in_place_GBps": gbps[IN_PLACE],
        "in_place_ratio": gbps[IN_PLACE] / gbps[RAW],
        **{f"{name}_cpu_s_per_GB": float(statistics.median(values)) for name, values in cpu.items()},
        "rounds_GBps": rates,
        "rounds_cpu_s_per_GB": cpu,
        "exchange_bytes": count * size,
    }


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    with tempfile.TemporaryDirectory(prefix="dq-bench-exchange-bound-") as tmp:
        rows = [bound(Path(tmp), label, size) for label, size in SIZES.items() if label in wanted]
    report(
        "exchange_bound",
        rows,
        [
            "size",
            "raw_tcp_GBps",
            "least_exchange_GBps",
            "least_exchange_ratio",
            "in_place_GBps",
            "in_place_ratio",
            "least_receiver_cpu_s_per_GB",
            "in_place_receiver_cpu_s_per_GB",
        ],
    )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--send":
        _sender(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
