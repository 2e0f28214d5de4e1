"""The bulk data path against the raw socket: what each path between daemons
moves, next to what a plain TCP stream of the same bytes moves in the same run.

Setup, per sample size (110 KiB, 1 MiB): a directory and four daemons on
loopback. n0 and n1 run as shipped (bulk path on); g0 and g1 run with
``--bulk-listen off``, so their peer hits go over gRPC, the path without the bulk data path.
A files dataset of ``DATASET_BYTES``; one job (global mode) on [n0, n1] and
one on [g0, g1], each staged, so every node caches the half it owns. Each
timed run reads the ids n1 (or g1) owns, in batches of 64, ``PASSES`` times.

Measured in one run, the variants interleaved round by round:

- raw TCP: a child process holding the batches' payloads in memory answers
  an 8-byte request per batch with one blocking ``sendall`` of the batch's
  bytes; this process receives them with ``recv_into`` into a preallocated
  buffer. The ceiling: no framing, no checksum, no cache lookup.
- gRPC hop: this process asks n1 over TCP gRPC with ``peer=True``, as a
  daemon fetched a peer hit before (hop 1 of bench/peers.py); no checksum.
- bulk hop: this process asks n1 over its bulk listener with the daemon's own
  :class:`BulkClient` (handshake once, connection reused, checksums checked).
- peer hit, bulk: a client on n0 (shared memory, as shipped) reads through
  n0, which fetches each batch from n1 over the bulk path and writes each
  payload into the client's segment as it lands.
- peer hit, gRPC: the same through g0, which fetches from g1 over gRPC.
- hop 2 alone: the client's daemon path (shared memory) over batches of ids
  n0 holds itself: the second hop of a peer hit without the first, a bound
  on a peer hit however well the hops overlap.

The exchange, per size, in two more clusters of two daemons, one as shipped
and one with ``--bulk-listen off``: the dataset staged whole on node-0; per
round node-1's cache is wiped (its identity key kept) and it restarts, a fresh
``partial`` job with Q = 1 starts, node-0 is told its trainers entered epoch 0
and ships node-1 what it owns in epoch 1 (checked, committed to LMDB,
acknowledged). The rate is the bytes sent over the daemon's own elapsed time;
the CPU seconds per GB are what each daemon's process used (all threads, 10 ms
ticks) from the report of epoch 0 to the exchange's end, over the payload
bytes moved. The raw TCP stream of the same round moves those bytes in batches
of 64, as above. Rounds of the three take turns; node-1 loads the dataset
before each round's clock starts. Before each timed run (an exchange, the raw
stream, each bound below) the free memory is backed (common.back_free_memory):
the receiver writes every byte it stores through LMDB's map into new pages,
and on this virtual machine a write through a map into memory the host has not
backed runs at about 0.5 GB/s against 5 GB/s into memory just freed
(bench/experiments/first_touch.py), which the raw stream, reusing one buffer,
never meets; a bare-metal node does not either. Its bounds, since the receiver
acknowledges only what its cache committed, are those of
``bench/experiments/store_bounds.py``: the same values committed to LMDB (with
and without ``writemap``), and put into a file's page cache.

``BENCH_PARTS`` (``peer``, ``exchange``; both by default) runs a part alone.
``BENCH_BASELINE_SOURCE=DIR`` adds a third exchange pair whose daemons run
from the source tree DIR (``git archive`` of an earlier commit: its protos,
client and server folders), in the same rounds: a before/after figure.
``BENCH_GROWN=1`` has every exchange round write into the cache file its
pair's round before grew, emptied (see ``exchange_pair.py``), after an
untimed round that grows it: the exchange of a later epoch.
``BENCH_EXCHANGE_MIB`` sets the exchange's dataset when it runs alone (128 by
default, as the peer part's): a quarter of it moves per round.

Rates are payload GB/s (10^9 bytes), each the median of ``REPEATS`` runs; the
ratios are against the raw TCP stream of the same run. The load
average before and after is recorded with the results (the machine is shared).
``BENCH_SIZES=110KiB`` runs one size; ``BENCH_PARTS=peer`` the peer hits
without the exchange (which needs them: they make the dataset);
``BENCH_PASSES`` sets ``PASSES`` (a longer timed run is less at the mercy of
a shared machine's other work).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import REPEATS, MiB, back_free_memory, load_average, progress, report
from exchange_pair import exchange_round, started_pair
from store_bounds import lmdb_commit, page_cache, stored_values

from dataquay.client import connect
from dataquay.client.malloc import tune_malloc
from dataquay.client.manifest import Manifest
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.node.peers.bulk.client import BulkClient
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

BATCH = 64
DATASET_BYTES = 128 * MiB
#: The exchange part's dataset when it runs alone (see the docstring).
EXCHANGE_DATASET_BYTES = int(os.environ.get("BENCH_EXCHANGE_MIB", "128")) * MiB
PASSES = int(os.environ.get("BENCH_PASSES", "2"))
SIZES = {"110KiB": 110 * 1024, "1MiB": MiB}
TARGET = 0.5
#: A source tree the exchange's "before" pair runs from (see the docstring).
BASELINE_SOURCE = os.environ.get("BENCH_BASELINE_SOURCE", "")
#: Rounds into a grown cache file (see the docstring).
GROWN = os.environ.get("BENCH_GROWN", "") == "1"
_INDEX = struct.Struct("<Q")


# ------------------------------------------------------------------ raw TCP


def _raw_server(paths_file: Path, port_file: Path) -> None:
    """Serves each batch's bytes, joined, for its index: the ceiling's sender."""
    batches = [b"".join(Path(p).read_bytes() for p in line.split("\t")) for line in paths_file.read_text().splitlines()]
    listener = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    request = bytearray(_INDEX.size)
    with conn:
        while conn.recv_into(request, _INDEX.size, socket.MSG_WAITALL) == _INDEX.size:
            conn.sendall(batches[_INDEX.unpack(request)[0]])


class RawStream:
    """This side of the raw TCP stream: one request per batch, recv_into a reused buffer."""

    def __init__(self, home: Path, batch_paths: list[list[str]], batch_bytes: int) -> None:
        home.mkdir(parents=True, exist_ok=True)
        paths_file, port_file = home / "batches.txt", home / "port"
        paths_file.write_text("\n".join("\t".join(b) for b in batch_paths))
        self.process = subprocess.Popen([sys.executable, __file__, "--raw-server", str(paths_file), str(port_file)])
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the raw TCP server did not start")
            time.sleep(0.05)
        self.sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = memoryview(bytearray(batch_bytes))

    def batch(self, index: int, nbytes: int = 0) -> None:
        """Batch ``index`` (of ``nbytes``; the whole buffer when 0)."""
        self.sock.sendall(_INDEX.pack(index))
        view = self.buffer[: nbytes or len(self.buffer)]
        while view:
            got = self.sock.recv_into(view)
            if not got:
                raise RuntimeError("the raw TCP server closed")
            view = view[got:]

    def close(self) -> None:
        self.sock.close()
        self.process.wait(30)


# ------------------------------------------------------------------ cluster


def _stub(address: str) -> tuple[grpc.Channel, cache_pb2_grpc.CacheStub]:
    channel = grpc.insecure_channel(grpc_target(address), options=channel_options())
    return channel, cache_pb2_grpc.CacheStub(channel)


def _staged(daemons: list[DaemonProcess], label: str, root: Path | None, job_id: str) -> pb.InfoReply:
    """Registers the dataset (unless ``root`` is None: it is), starts the job on
    the two daemons and stages it; the second's Info."""
    channels, stubs = zip(*(_stub(d.address) for d in daemons))
    try:
        if root is not None:
            stubs[0].AddDataset(pb.AddDatasetRequest(name=label, root=str(root)))
        nodes = [s.Info(pb.InfoRequest()).node for s in stubs]
        stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job_id, dataset=label, nodes=nodes)))
        for stub in stubs:
            *_, last = stub.Stage(pb.StageRequest(dataset=label, job=job_id))
            if last.error or last.done_samples != last.total_samples:
                raise RuntimeError(f"staging {label} on {last.node} failed: {last.error}")
        return stubs[1].Info(pb.InfoRequest())
    finally:
        for channel in channels:
            channel.close()


def bench_size(bulk: list[DaemonProcess], plain: list[DaemonProcess], base: Path, label: str, size: int) -> dict:
    count = DATASET_BYTES // size
    progress(f"{label}: {count} samples, staged on two pairs of nodes")
    root = make_files_dataset(base / "pfs" / label, count, sizes=(size,))
    paths = sorted(str(p) for p in root.rglob("*.bin"))
    n1 = _staged(bulk, label, root, f"bulk-{label}")
    _staged(plain, label, None, f"grpc-{label}")
    assert n1.bulk_address, "n1 advertises no bulk address"

    bulk_client, grpc_client = connect(bulk[0].address), connect(plain[0].address)
    bulk_ds, grpc_ds = bulk_client.dataset(label), grpc_client.dataset(label)
    owner = bulk_ds.sampler(job=f"bulk-{label}", rank=0, world_size=2).owners(0)
    grpc_owner = grpc_ds.sampler(job=f"grpc-{label}", rank=0, world_size=2).owners(0)
    # The pairs' nodes have other names, so their jobs place samples apart:
    # each pair reads as many ids, those its own second node owns.
    remote = np.random.default_rng(0).permutation(np.flatnonzero(owner == 1))
    grpc_remote = np.random.default_rng(0).permutation(np.flatnonzero(grpc_owner == 1))
    whole = min(len(remote), len(grpc_remote)) // BATCH * BATCH
    batches = [remote[i : i + BATCH] for i in range(0, whole, BATCH)]
    grpc_timed = [grpc_remote[i : i + BATCH] for i in range(0, whole, BATCH)] * PASSES
    local = np.random.default_rng(1).permutation(np.flatnonzero(owner == 0))
    local_batches = [local[i : i + BATCH] for i in range(0, len(local) - BATCH + 1, BATCH)]
    timed = batches * PASSES
    total = len(timed) * BATCH
    for want in batches[0][:4].tolist():
        assert bulk_ds[want] == grpc_ds[want] == sample_bytes(0, want, size), f"sample {want} arrived wrong"

    raw = RawStream(base / f"raw-{label}", [[paths[i] for i in b.tolist()] for b in batches], BATCH * size)
    channel, n1_stub = _stub(n1.tcp_address)
    manifest_id = bulk_ds.manifest.manifest_id
    lengths = bulk_ds.manifest.sample_length
    loop = asyncio.new_event_loop()
    hop_client = BulkClient("", None)

    def raw_tcp() -> int:
        for _ in range(PASSES):
            for k in range(len(batches)):
                raw.batch(k)
        return total

    def grpc_hop() -> int:
        for b in timed:
            request = pb.ReadRequest(dataset=label, ids=b.tolist(), manifest_id=manifest_id, peer=True)
            assert sum(len(s.data) for chunk in n1_stub.Read(request) for s in chunk.samples) == BATCH * size
        return total

    def bulk_hop() -> int:
        for b in timed:
            got = loop.run_until_complete(hop_client.read(n1.bulk_address, label, manifest_id, b, lengths, 60.0))
            assert len(got.samples) == BATCH and not got.bad_checksums
        return total

    def peer_bulk() -> int:
        for b in timed:
            bulk_ds.get_batch(b)
        return total

    def peer_grpc() -> int:
        for b in grpc_timed:
            grpc_ds.get_batch(b)
        return total

    def hop2() -> int:
        for _ in range(PASSES):
            for b in local_batches:
                bulk_client.remote._read_daemon(bulk_ds, b, None)
        return PASSES * len(local_batches) * BATCH

    runs: dict[str, Callable[[], int]] = {
        "raw_tcp": raw_tcp,
        "grpc_hop": grpc_hop,
        "bulk_hop": bulk_hop,
        "peer_bulk": peer_bulk,
        "peer_grpc": peer_grpc,
        "hop2": hop2,
    }
    for run in runs.values():
        run()  # warm: page cache, connections, segments
    peers_before = (bulk_client.stats().samples["peer"], grpc_client.stats().samples["peer"])
    load_before = load_average()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(REPEATS):
        progress(f"{label}: round {round_ + 1} of {REPEATS}")
        for name, run in runs.items():
            started = time.perf_counter()
            samples = run()
            rates[name].append(samples * size / (time.perf_counter() - started) / 1e9)
    load_after = load_average()
    got = (bulk_client.stats().samples["peer"] - peers_before[0], grpc_client.stats().samples["peer"] - peers_before[1])
    assert got == (REPEATS * total, REPEATS * total), f"not every read was a peer hit: {got}"
    with _stub(bulk[0].address)[0] as ch0:
        counts = cache_pb2_grpc.CacheStub(ch0).Stats(pb.StatsRequest()).bulk
    assert counts.fetched_samples >= REPEATS * total and not counts.fallbacks, "n0 did not read over bulk"
    raw.close()
    channel.close()
    hop_client.close()
    loop.close()
    bulk_client.close()
    grpc_client.close()

    gbps = {name: float(statistics.median(values)) for name, values in rates.items()}
    row: dict[str, object] = {"size": label, **{f"{name}_GBps": value for name, value in gbps.items()}}
    for name in ("grpc_hop", "bulk_hop", "peer_bulk", "peer_grpc", "hop2"):
        row[f"{name}_ratio"] = gbps[name] / gbps["raw_tcp"]
    row["peer_bulk_over_grpc"] = gbps["peer_bulk"] / gbps["peer_grpc"]
    row["rounds_GBps"] = rates
    row["forwarded_samples"] = counts.forwarded_samples
    row["in_place_samples"] = counts.in_place_samples
    row["segment_reads"] = counts.segment_reads
    row["load_before"], row["load_after"] = load_before, load_after
    row["target"] = TARGET
    return row


def bench_exchange(base: Path, label: str, size: int) -> dict:
    root = base / "pfs" / label
    paths = sorted(str(p) for p in root.rglob("*.bin"))
    pairs: dict[str, tuple[tuple[str, ...], str]] = {"bulk": ((), ""), "grpc": (("--bulk-listen", "off"), "")}
    if BASELINE_SOURCE:
        pairs["before"] = ((), BASELINE_SOURCE)
    rates: dict[str, list[float]] = {
        name: []
        for name in (
            "raw_tcp",
            *(f"exchange_{p}" for p in pairs),
            "lmdb_commit",
            "lmdb_commit_writemap",
            "page_cache_mmap",
            "page_cache_pwrite",
        )
    }
    #: CPU seconds per GB moved, of the sender and the receiver daemon of each pair.
    cpu: dict[str, list[float]] = {f"{p}_{side}": [] for p in pairs for side in ("sender", "receiver")}
    clusters: dict[str, LocalCluster] = {}
    try:
        for name, (args, source) in pairs.items():
            clusters[name] = started_pair(base / f"x-{name}-{label}", args, source)
        stubs = {}
        for name, local in clusters.items():
            _channel, stub = _stub(str(local.daemons[0].ready["tcp"]))
            stubs[name] = stub
            stub.AddDataset(pb.AddDatasetRequest(name=label, root=str(root)))
            progress(f"exchange {label}: staging on node-0 of the {name} pair")
            *_, staged = stub.Stage(pb.StageRequest(dataset=label))
            assert staged.done_samples == staged.total_samples, staged
        manifests = {
            name: Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name=label))))
            for name, stub in stubs.items()
        }
        if GROWN:
            progress(f"exchange {label}: a round to grow each pair's receiving cache")
            for name, local in clusters.items():
                exchange_round(local, stubs[name], label, manifests[name], REPEATS, name)
        load_before = load_average()
        for round_ in range(REPEATS):
            progress(f"exchange {label}: round {round_ + 1} of {REPEATS}")
            # The pairs take turns at going first: the first follows the GBs the
            # last round's baselines wrote, and the writeback runs beside it.
            order = list(clusters.items())
            for name, local in order[round_ % len(order) :] + order[: round_ % len(order)]:
                done = exchange_round(local, stubs[name], label, manifests[name], round_, name, GROWN)
                given = done.given
                rates[f"exchange_{name}"].append(done.rate / 1e9)
                for side, seconds in (("sender", done.sender_cpu), ("receiver", done.receiver_cpu)):
                    cpu[f"{name}_{side}"].append(seconds / (len(given) * size / 1e9))
            batches = [given[i : i + BATCH] for i in range(0, len(given), BATCH)]
            raw = RawStream(
                base / f"raw-x-{label}-{round_}", [[paths[i] for i in b.tolist()] for b in batches], BATCH * size
            )
            back_free_memory()
            started = time.perf_counter()
            for k in range(len(batches)):
                raw.batch(k, len(batches[k]) * size)
            rates["raw_tcp"].append(len(given) * size / (time.perf_counter() - started) / 1e9)
            raw.close()
            values = stored_values(batches, paths)
            back_free_memory()
            rates["lmdb_commit"].append(lmdb_commit(base / f"lmdb-{label}-{round_}", values) / 1e9)
            back_free_memory()
            rates["lmdb_commit_writemap"].append(
                lmdb_commit(base / f"lmdb-wm-{label}-{round_}", values, writemap=True) / 1e9
            )
            back_free_memory()
            mapped, written = page_cache(base / f"page-cache-{label}-{round_}", values)
            rates["page_cache_mmap"].append(mapped / 1e9)
            rates["page_cache_pwrite"].append(written / 1e9)
            del values
        load_after = load_average()
        bulk_stats = [s.Stats(pb.StatsRequest()).bulk for s in (stubs["bulk"],)]
        assert not bulk_stats[0].fallbacks, "the bulk pair fell back to gRPC"
    finally:
        for local in clusters.values():
            local.down()
        for name in clusters:  # their caches' files hold GBs, allocated ahead: not left to the next size's pairs
            shutil.rmtree(base / f"x-{name}-{label}", ignore_errors=True)
    gbps = {name: float(statistics.median(values)) for name, values in rates.items()}
    row: dict[str, object] = {"size": label, **{f"{name}_GBps": value for name, value in gbps.items()}}
    for name in rates:
        if name != "raw_tcp":
            row[f"{name}_ratio"] = gbps[name] / gbps["raw_tcp"]
    row["bulk_over_grpc"] = gbps["exchange_bulk"] / gbps["exchange_grpc"]
    if BASELINE_SOURCE:
        row["bulk_over_before"] = gbps["exchange_bulk"] / gbps["exchange_before"]
        row["baseline_source"] = BASELINE_SOURCE
    for name, per_gb in cpu.items():
        row[f"{name}_cpu_s_per_GB"] = float(statistics.median(per_gb))
    row.update(
        rounds_GBps=rates,
        rounds_cpu_s_per_GB=cpu,
        load_before=load_before,
        load_after=load_after,
        grown=GROWN,
        target=TARGET,
    )
    return row


def _bench_peers(base: Path, sizes: list[tuple[str, int]]) -> list[dict]:
    """The peer-hit part: four daemons, each size in turn."""
    rows = []
    directory = DirectoryProcess(base / "directory", dataset_roots=(base,)).start()
    processes: list[DaemonProcess] = []
    try:
        for name, extra in (("n0", ()), ("n1", ()), ("g0", ("--bulk-listen", "off")), ("g1", ("--bulk-listen", "off"))):
            processes.append(
                DaemonProcess(
                    base / name, ("--directory", directory.address, "--node-name", name, *extra), dataset_roots=(base,)
                ).start()
            )
        for label, size in sizes:
            rows.append(bench_size(processes[:2], processes[2:], base, label, size))
    finally:
        for process in [*processes, directory]:
            process.kill()
    return rows


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    parts = os.environ.get("BENCH_PARTS", "peer,exchange").split(",")
    rows = []
    exchanges = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-wire-") as tmp:
        base = Path(tmp)
        if "peer" in parts:
            rows = _bench_peers(base, [(label, size) for label, size in SIZES.items() if label in wanted])
        if "exchange" in parts:
            for label, size in SIZES.items():
                if label in wanted:
                    if not (base / "pfs" / label).exists():
                        make_files_dataset(base / "pfs" / label, EXCHANGE_DATASET_BYTES // size, sizes=(size,))
                    exchanges.append(bench_exchange(base, label, size))
    report(
        "wire_exchange",
        exchanges,
        [
            "size",
            "raw_tcp_GBps",
            "exchange_grpc_GBps",
            "exchange_grpc_ratio",
            "exchange_bulk_GBps",
            "exchange_bulk_ratio",
            "bulk_over_grpc",
            "exchange_before_GBps",
            "exchange_before_ratio",
            "bulk_over_before",
            "lmdb_commit_GBps",
            "lmdb_commit_ratio",
            "lmdb_commit_writemap_GBps",
            "lmdb_commit_writemap_ratio",
            "page_cache_mmap_GBps",
            "page_cache_mmap_ratio",
            "page_cache_pwrite_GBps",
            "page_cache_pwrite_ratio",
            "bulk_sender_cpu_s_per_GB",
            "bulk_receiver_cpu_s_per_GB",
            "before_sender_cpu_s_per_GB",
            "before_receiver_cpu_s_per_GB",
        ],
    )
    report(
        "wire",
        rows,
        [
            "size",
            "raw_tcp_GBps",
            "grpc_hop_GBps",
            "grpc_hop_ratio",
            "bulk_hop_GBps",
            "bulk_hop_ratio",
            "peer_grpc_GBps",
            "peer_grpc_ratio",
            "peer_bulk_GBps",
            "peer_bulk_ratio",
            "peer_bulk_over_grpc",
            "hop2_GBps",
            "hop2_ratio",
        ],
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--raw-server":
        _raw_server(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
