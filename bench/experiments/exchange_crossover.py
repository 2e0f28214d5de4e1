"""Which end of the daemon's exchange stream costs it its speed.

``bench/experiments/exchange_bound.py`` shows what the least exchange reaches here;
``bench/experiments/exchange_rounds.py`` what the daemons reach. This crosses the two:
each round runs the exchange of ``bench/experiments/exchange_pair.py`` (node-0 ships
node-1 what it owns in epoch 1 of a fresh ``partial`` job, Q = 1) four
ways, the order turned each round:

- ``daemon>daemon``: the daemons' own stream;
- ``daemon>least``: node-0's daemon sends to a least receiver (a child
  process listening on node-1's bulk port while node-1 is down, as yet
  unnoticed by the directory): it takes
  each chunk's body into one buffer, checks the checksums as the daemon
  does (``values_intact``), commits each chunk with ``putmulti`` in a
  writer thread and acknowledges it once committed;
- ``least>daemon``: a least sender (a child process that opens node-0's
  cache file read-only) offers node-1 the same ids and sends their values
  straight out of the map with ``sendmsg`` from one read transaction, a
  window of WINDOW chunks awaiting acknowledgement, as the daemon does;
- ``least>least``: the two least ends.

Each rate is the payload over the sender's own time from its connection to
the last acknowledgement (the daemon's: its run's elapsed time); each end's
CPU seconds per GB are its process's, all threads (the sending daemon's
include starting the run: its placements and its books), and the sending
daemon's event loop thread's on their own. Whichever daemon end takes the
rate down when it replaces a least one is the end to rework.

``BENCH_SIZES`` (110KiB or 1MiB), ``BENCH_ROUNDS`` (5),
``BENCH_EXCHANGE_MIB`` (2048), ``BENCH_CHUNK_MIB`` (the least sender's
chunks, the daemon's largest by default), ``BENCH_WAYS`` (some of the four, comma
separated).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import MiB, back_free_memory, progress, report, stub
from exchange_pair import cpu_seconds, staged_sender, started_pair
from store_bounds import allocated_cache
from wire import SIZES

from dataquay.client.jobs import job_plan
from dataquay.client.malloc import tune_malloc
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.record_loops import values_intact
from dataquay.client.wire.records import sample_key
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.protos.cache_pb2_grpc import CacheStub
from dataquay.server.node.cache.file import MAX_DBS
from dataquay.server.node.exchange import streams
from dataquay.server.node.peers.bulk.client import BulkClient
from dataquay.server.node.peers.bulk.frames import (
    CHUNK,
    END,
    EXCHANGE,
    HELLO,
    HELLO_MAGIC,
    MAC_BYTES,
    NONCE_BYTES,
    REPLY,
    REQUEST,
    REQUEST_MAGIC,
    SAMPLE,
    chunk_frames,
    parse_chunk,
    recv_bytes,
    recv_exactly,
    server_proof,
)
from dataquay.server.registry import cache_db_name
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
DATASET_BYTES = int(os.environ.get("BENCH_EXCHANGE_MIB", "2048")) * MiB
CHUNK_BYTES = int(os.environ.get("BENCH_CHUNK_MIB", str(streams.CHUNK_BYTES // MiB))) * MiB
#: Chunks sent and not yet acknowledged, as the daemon's streams.WINDOW.
WINDOW = 4
#: Chunks received and not yet committed, as the daemon's bulk EXCHANGE_QUEUE.
QUEUE = 4
DAEMON, LEAST = "daemon", "least"
WAYS = [
    (s, r)
    for s in (DAEMON, LEAST)
    for r in (DAEMON, LEAST)
    if f"{s}>{r}" in os.environ.get("BENCH_WAYS", f"{s}>{r}").split(",")
]


def _reply(sock: socket.socket, reply: pb.ExchangeReply) -> None:
    data = reply.SerializeToString()
    sock.sendall(SAMPLE.pack(REPLY, 0, len(data), 0) + data)


def _read_reply(sock: socket.socket) -> pb.ExchangeReply | None:
    status, _, length, _ = SAMPLE.unpack(recv_bytes(sock, SAMPLE.size))
    if status == END:
        return None
    assert status == REPLY, f"frame status {status}"
    return pb.ExchangeReply.FromString(recv_bytes(sock, length))


def least_receiver(listener: socket.socket, home: Path, map_bytes: int, max_value: int) -> dict[str, float]:
    """Answers one exchange stream on ``listener`` (the child's work)."""
    env = allocated_cache(home, map_bytes)
    db = env.open_db(b"bench")
    print("ready", flush=True)
    conn, _ = listener.accept()
    started, cpu = time.perf_counter(), time.process_time()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(HELLO.pack(HELLO_MAGIC, b"\0" * NONCE_BYTES))
    answer = recv_bytes(conn, NONCE_BYTES + MAC_BYTES)
    conn.sendall(server_proof("", b"\0" * NONCE_BYTES, answer[:NONCE_BYTES]))
    _, kind, length = REQUEST.unpack(recv_bytes(conn, REQUEST.size))
    assert kind == EXCHANGE
    pb.ExchangeMessage.FromString(recv_bytes(conn, length))
    _reply(conn, pb.ExchangeReply())
    commits: queue.Queue[list[tuple[int, bytes | memoryview]] | None] = queue.Queue(QUEUE)
    committed = 0

    def writer() -> None:
        nonlocal committed
        while (samples := commits.get()) is not None:
            with env.begin(write=True, db=db) as txn:
                txn.cursor().putmulti([(sample_key(i), v) for i, v in samples])
            committed += sum(len(v) for _, v in samples)
            _reply(conn, pb.ExchangeReply(held=[i for i, _ in samples]))

    thread = threading.Thread(target=writer)
    thread.start()
    header = bytearray(SAMPLE.size)
    try:
        while True:
            recv_exactly(conn, memoryview(header))
            status, count, body_bytes, _ = SAMPLE.unpack(header)
            if status == END:
                break
            assert status == CHUNK
            body = np.empty(body_bytes, dtype=np.uint8).data
            recv_exactly(conn, body)
            samples = parse_chunk(body, count, max_value)
            intact = values_intact([v for _, v in samples])
            commits.put([s for s, ok in zip(samples, intact) if ok])
    finally:
        commits.put(None)
        thread.join()
    conn.sendall(SAMPLE.pack(END, 0, 0, 0))
    conn.close()
    env.close()
    return {"elapsed": time.perf_counter() - started, "cpu": time.process_time() - cpu, "bytes": committed}


def least_sender(address: str, cache: Path, db_name: str, offer: pb.ExchangeOffer) -> dict[str, float]:
    """Ships ``offer``'s ids out of the cache at ``cache`` to ``address`` (the child's work)."""
    env = lmdb.open(str(cache), readonly=True, max_dbs=MAX_DBS)
    db = env.open_db(db_name.encode(), create=False)
    started, cpu = time.perf_counter(), time.process_time()
    sock = BulkClient("", None).connect(address)
    sock.settimeout(None)
    body = pb.ExchangeMessage(offer=offer).SerializeToString()
    sock.sendall(REQUEST.pack(REQUEST_MAGIC, EXCHANGE, len(body)) + body)
    first = _read_reply(sock)
    assert first is not None and not first.held
    window = threading.Semaphore(WINDOW)
    held = 0

    def acks() -> None:
        nonlocal held
        while (reply := _read_reply(sock)) is not None:
            held += len(reply.held)
            window.release()

    thread = threading.Thread(target=acks)
    thread.start()
    ids = list(offer.ids)
    sent = 0
    with env.begin(db=db, buffers=True) as txn:
        at = 0
        while at < len(ids):
            chunk, size = [], 0
            while at < len(ids) and size < CHUNK_BYTES:
                value = txn.get(sample_key(ids[at]))
                assert value is not None
                chunk.append((ids[at], value))
                size += len(value)
                at += 1
            window.acquire()
            sock.sendmsg(chunk_frames(chunk))
            sent += size
    sock.sendall(SAMPLE.pack(END, 0, 0, 0))
    thread.join()
    assert held == len(ids), (held, len(ids))
    elapsed = time.perf_counter() - started
    sock.close()
    env.close()
    return {"elapsed": elapsed, "cpu": time.process_time() - cpu, "bytes": sent}


def _child(*args: str, keep: tuple[int, ...] = ()) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, pass_fds=keep)


def _result(child: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0, f"a least end failed ({child.returncode})"
    return json.loads(out.splitlines()[-1])


@dataclass(frozen=True)
class Pair:
    """The cluster the rounds run on, and what every round needs of it."""

    local: LocalCluster
    #: node-0, which holds the dataset.
    sender: CacheStub
    label: str
    size: int
    manifest: Manifest
    base: Path


def one_way(pair: Pair, round_: int, sender: str, receiver: str) -> dict[str, float]:
    """One exchange ``sender`` > ``receiver`` on a wiped node-1: its rate, and
    each end's CPU seconds per GB (the sending daemon's event loop's too)."""
    local, n0 = pair.local, pair.sender
    local.kill_node(1)
    shutil.rmtree(local.daemons[1].cache_dir, ignore_errors=True)
    # Restarted either way: the directory lists node-1 as up only while it
    # heartbeats, and node-0 sends only to a node listed up.
    local.restart_node(1)
    if receiver == DAEMON:
        # The restarted receiver loads the dataset before the clock starts, not during the exchange.
        list(
            stub(local.daemons[1]).Read(
                pb.ReadRequest(dataset=pair.label, ids=[0], manifest_id=pair.manifest.manifest_id, peer=True)
            )
        )
    job_id = f"crossover-{pair.label}-{round_}-{sender}-{receiver}"
    spec = jpb.JobSpec(
        job_id=job_id,
        dataset=pair.label,
        mode="partial",
        q=1.0,
        seed=round_,
        nodes=["node-0", "node-1"],
        ranks_per_node=1,
    )
    plan = job_plan(n0.JoinJob(jpb.JoinJobRequest(spec=spec)), pair.manifest)
    before = owners(plan, 0)
    given = np.flatnonzero((before == 0) & (owners(plan, 1, before) == 1))
    listener = taking = None
    home = pair.base / f"least-{job_id}"
    assert local.daemons[1].ready is not None
    address = str(local.daemons[1].ready["bulk"])
    back_free_memory()
    if receiver == LEAST:
        # Killed last thing before the run: the directory lists node-1 as down
        # once its lease lapses, and node-0 sends to no node listed down.
        local.kill_node(1)
        bulk_port = int(address.rpartition(":")[2])
        listener = socket.create_server(("127.0.0.1", bulk_port if sender == DAEMON else 0))
        taking = _child(
            "--receive",
            str(listener.fileno()),
            str(home),
            str(2 * DATASET_BYTES),
            str(pair.size + 64),
            keep=(listener.fileno(),),
        )
        assert taking.stdout is not None and taking.stdout.readline() == "ready\n"
        address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        n0_daemon = local.daemons[0]
        sender_cpu, loop_cpu = cpu_seconds(n0_daemon), cpu_seconds(n0_daemon, main_thread=True)
        receiver_cpu = cpu_seconds(local.daemons[1]) if receiver == DAEMON else 0.0
        if sender == DAEMON:
            n0.ReportEpoch(jpb.ReportEpochRequest(job_id=job_id, epoch=0))
            run = _finished(n0, job_id)
            assert run.delivered_samples == len(given), run
            elapsed = run.elapsed_seconds
            sender_cpu = cpu_seconds(n0_daemon) - sender_cpu
            loop_cpu = cpu_seconds(n0_daemon, main_thread=True) - loop_cpu
        else:
            offer = pb.ExchangeOffer(
                job=job_id,
                dataset=pair.label,
                manifest_id=pair.manifest.manifest_id,
                epoch=1,
                sender="node-0",
                ids=given.tolist(),
            )
            db = cache_db_name(pair.label, pair.manifest.manifest_id)
            sent = _result(
                _child("--send", address, str(local.daemons[0].cache_dir), db, offer.SerializeToString().hex())
            )
            elapsed, sender_cpu = sent["elapsed"], sent["cpu"]
        if taking is not None:
            taken = _result(taking)
            assert taken["bytes"] == len(given) * (pair.size + 8), taken
            receiver_cpu = taken["cpu"]
        else:
            receiver_cpu = cpu_seconds(local.daemons[1]) - receiver_cpu
    finally:
        if listener is not None:
            listener.close()
        shutil.rmtree(home, ignore_errors=True)
    gigabytes = len(given) * pair.size / 1e9
    got = {"GBps": gigabytes / elapsed, "sender_cpu": sender_cpu / gigabytes, "receiver_cpu": receiver_cpu / gigabytes}
    if sender == DAEMON:
        got["sender_loop_cpu"] = loop_cpu / gigabytes
    return got


def crossover(base: Path, label: str, size: int) -> dict[str, object]:
    root = base / "pfs" / label
    make_files_dataset(root, DATASET_BYTES // size, sizes=(size,))
    local = started_pair(base / "pair", ())
    rounds: dict[str, dict[str, list[float]]] = {f"{s}>{r}": {} for s, r in WAYS}
    try:
        n0, manifest = staged_sender(local, label, root, "exchange crossover")
        pair = Pair(local, n0, label, size, manifest, base)
        for round_ in range(ROUNDS):
            for sender, receiver in WAYS[round_ % len(WAYS) :] + WAYS[: round_ % len(WAYS)]:
                way = f"{sender}>{receiver}"
                got = one_way(pair, round_, sender, receiver)
                for key, value in got.items():
                    rounds[way].setdefault(key, []).append(value)
                loop = f" (its event loop {got['sender_loop_cpu']:.2f})" if "sender_loop_cpu" in got else ""
                progress(
                    f"round {round_ + 1} of {ROUNDS}, {way}: {got['GBps']:.2f} GB/s, sender "
                    f"{got['sender_cpu']:.2f}{loop} and receiver {got['receiver_cpu']:.2f} CPU s/GB"
                )
    finally:
        local.down()
    medians = {f"{way}_{key}": statistics.median(values) for way, row in rounds.items() for key, values in row.items()}
    return {"size": label, **medians, "rounds": rounds, "dataset_bytes": DATASET_BYTES}


def _finished(n0, job_id: str) -> pb.ExchangeProgress:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run = next(
            (r for r in n0.Stats(pb.StatsRequest()).exchanges if r.job == job_id and r.epoch == 1 and r.finished), None
        )
        if run is not None:
            return run
        time.sleep(0.1)
    raise RuntimeError(f"exchange of {job_id} did not finish")


def main() -> None:
    tune_malloc()
    label = os.environ.get("BENCH_SIZES", "110KiB")
    with tempfile.TemporaryDirectory(prefix="dq-bench-exchange-crossover-") as tmp:
        row = crossover(Path(tmp), label, SIZES[label])
    report("exchange_crossover", [row], ["size", *(f"{s}>{r}_GBps" for s, r in WAYS)])
    columns = [f"{s}>{r}_{end}_cpu" for s, r in WAYS for end in ("sender", "receiver")]
    print("CPU s/GB " + "  ".join(f"{c[:-4]} {row[c]:.2f}" for c in columns))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receive"]:
        listening = socket.socket(fileno=int(sys.argv[2]))
        print(json.dumps(least_receiver(listening, Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    elif sys.argv[1:2] == ["--send"]:
        print(
            json.dumps(
                least_sender(
                    sys.argv[2], Path(sys.argv[3]), sys.argv[4], pb.ExchangeOffer.FromString(bytes.fromhex(sys.argv[5]))
                )
            )
        )
    else:
        main()
