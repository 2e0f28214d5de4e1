"""The asking end of a daemon's peer read alone: a reply's frames received
into a segment's places and checked there, by the compiled loop and by its
Python twin (an install without a C compiler, or a TLS socket), against a
raw receiver that takes the same bytes into the same places with two
``recv_into`` calls a sample and checks nothing.

A sender process answers each one-byte request with a batch of BATCH frames
over loopback TCP; the receiving thread's own CPU (user and system, from
``RUSAGE_THREAD``) is counted per GB, so the sender's share of the two cores
is not. Then THREADS receivers at once, each on its own connection, as a
daemon reads a batch from several owners: their summed CPU per GB and the
wall time, where a loop that holds the GIL per sample makes the others wait.

    .venv/bin/python bench/reply_loop.py [--mib 600] [--size-kib 110]     # about 40 s
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import resource
import socket
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
from common import REPEATS, MiB, progress, report

from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.records import checksum
from dataquay.server.node.peers.bulk import replies
from dataquay.server.node.peers.bulk.frames import END, OK, SAMPLE, kernel_timeouts
from dataquay.server.node.peers.bulk.replies import Got, Outcome, receive_reply

BATCH = 64
THREADS = 4


def _serve(listener: socket.socket, size: int, batches: int) -> None:
    """Answers each request byte on each connection with a batch of frames."""
    payload = np.random.default_rng(0).bytes(size)
    frames = b"".join(SAMPLE.pack(OK, i, size, checksum(payload)) + payload for i in range(BATCH))
    frames += SAMPLE.pack(END, BATCH, 0, 0)

    def answer(conn: socket.socket) -> None:
        with conn:
            for _ in range(batches):
                if not conn.recv(1):  # a connection this run does not use
                    return
                conn.sendall(frames)

    served = [threading.Thread(target=answer, args=(listener.accept()[0],)) for _ in range(THREADS)]
    for thread in served:
        thread.start()
    for thread in served:
        thread.join()


def _receive(conn: socket.socket, way: str, size: int, batches: int) -> float:
    """Receives ``batches`` replies on ``conn``; this thread's CPU seconds."""
    segment = mmap.mmap(-1, BATCH * size)
    places = [memoryview(segment)[k * size : (k + 1) * size] for k in range(BATCH)]
    ids = np.arange(BATCH)
    header = bytearray(SAMPLE.size)
    kernel_timeouts(conn, receive=30)
    started = resource.getrusage(resource.RUSAGE_THREAD)
    for _ in range(batches):
        conn.sendall(b"?")
        conn.recv_into(header, SAMPLE.size, socket.MSG_WAITALL)
        if way == "raw":
            for place in places:
                conn.recv_into(place, size, socket.MSG_WAITALL)
                conn.recv_into(header, SAMPLE.size, socket.MSG_WAITALL)
            continue
        reply = receive_reply(conn, header, ids, places, time.monotonic() + 30)
        assert reply.outcome == Outcome.ENDED and bool(np.all(reply.got == Got.INTACT)), reply
    ended = resource.getrusage(resource.RUSAGE_THREAD)
    return (ended.ru_utime - started.ru_utime) + (ended.ru_stime - started.ru_stime)


def measure(way: str, size: int, batches: int, threads: int) -> tuple[float, float]:
    """(CPU seconds per GB of the receiving threads, wall seconds) for ``threads`` connections at once."""
    replies.COMPILED = way == "compiled"
    listener = socket.create_server(("127.0.0.1", 0))
    server = multiprocessing.Process(target=_serve, args=(listener, size, batches))
    server.start()
    conns = [socket.create_connection(listener.getsockname()) for _ in range(THREADS)]
    spent = [0.0] * threads
    started = time.perf_counter()

    def run(k: int) -> Callable[[], None]:
        def receive() -> None:
            spent[k] = _receive(conns[k], way, size, batches)

        return receive

    receivers = [threading.Thread(target=run(k)) for k in range(threads)]
    for thread in receivers:
        thread.start()
    for thread in receivers:
        thread.join()
    wall = time.perf_counter() - started
    for conn in conns:
        conn.close()
    server.join()
    listener.close()
    return sum(spent) / (threads * batches * BATCH * size / 1e9), wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=600, help="MiB received per thread")
    parser.add_argument("--size-kib", type=int, default=110, help="bytes of every sample, in KiB")
    args = parser.parse_args(argv)
    tune_malloc()
    size = args.size_kib * 1024
    batches = max(1, args.mib * MiB // (BATCH * size))
    compiled = replies.COMPILED
    ways = ["raw", "compiled", "python"] if compiled else ["raw", "python"]
    rows: list[dict[str, object]] = []
    for threads in (1, THREADS):
        for way in ways:
            progress(f"{way}, {threads} thread(s)")
            runs = [measure(way, size, batches, threads) for _ in range(REPEATS)]
            rows.append(
                {
                    "loop": way,
                    "threads": threads,
                    "MB": threads * batches * BATCH * size / 1e6,
                    "cpu_s_per_GB": statistics.median(cpu for cpu, _ in runs),
                    "wall_s": statistics.median(wall for _, wall in runs),
                }
            )
    replies.COMPILED = compiled
    for row in rows:
        raw = next(r for r in rows if r["loop"] == "raw" and r["threads"] == row["threads"])
        row["vs_raw_cpu"] = float(row["cpu_s_per_GB"]) / float(raw["cpu_s_per_GB"])  # type: ignore[arg-type]
    report("reply_loop", rows, ["loop", "threads", "MB", "cpu_s_per_GB", "vs_raw_cpu", "wall_s"])


if __name__ == "__main__":
    main()
