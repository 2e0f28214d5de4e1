"""Peer hits (two hops) against a plain one-hop gRPC stream moving the same bytes.

Setup, per sample size (110 KiB, 1 MiB): a directory and two daemons, n0 and
n1, on loopback; a files dataset of ``DATASET_BYTES``; a job (global mode) on
the nodes [n0, n1], staged on both, so each node caches the half it owns. A
client connected to n0 (its unix socket) binds the dataset to the job as rank
0 of 2 and reads batches of 64 ids that n1 owns in epoch 0, so every sample
takes two hops: n0 asks n1 for the batch over TCP gRPC (one server-streaming
Read, ``peer=True``), then hands it to the client. Every timed run reads each
n1-owned id ``PASSES`` times, batch by batch, one batch after another.

Measured in one run, on the same ids and batches:

- peer, shm: ``ds.get_batch`` through the client as shipped: the local hop
  puts the payloads into the client's shared-memory segment.
- peer, inline: the same with the client's segment pool switched off
  (``DATAQUAY_SHM_BYTES=0`` when the client is created), so the payloads
  come inline in the unix-socket stream.
- baseline: a plain grpc.aio server in a process of its own (this file with
  ``--baseline-server``; uvloop and glibc tuning as in the daemon), holding
  the same payloads in memory, streams each batch as ReadChunk messages of
  about READ_CHUNK_BYTES (what the daemon sends) to a synchronous client in
  this process over TCP loopback: one stream per batch, no checksum checked.
- hop 1 alone: this process asks n1 directly over TCP for the same batches
  with ``peer=True`` (what n0 does), no checksum checked: the first hop with
  the daemon's own serving, without the second.
- hop 2 alone: the client's own daemon path (``RemoteReader._read_daemon``, shared
  memory) over batches of ids that n0 holds: the second hop without a peer.
- direct: this process reading the same files with ``open().read()`` (page
  cache), for context.

Rates are samples/s and payload GB/s (10^9 bytes); each is the median of REPEATS timed
runs, the variants interleaved round by round. The ratios put the two peer
variants against the baseline; the target is >= 0.5. The daemons'
own Read latency (their /metrics histograms) over the peer-shm runs splits a
batch's time between n1 (serving hop 1) and n0 (the whole batch, hop 1
included); see docs/results.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
from common import REPEATS, MiB, progress, report

from dataquay.client import connect
from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.channels import READ_CHUNK_BYTES, channel_options, grpc_target, server_options
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

BATCH = 64
DATASET_BYTES = 256 * MiB
#: Reads of each n1-owned id per timed run.
PASSES = 4
SIZES = {"110KiB": 110 * 1024, "1MiB": MiB}
NODES = ("n0", "n1")
TARGET = 0.5


# ------------------------------------------------------------------ baseline


def chunked(samples: list[pb.Sample], limit: int = READ_CHUNK_BYTES) -> Iterator[list[pb.Sample]]:
    """Messages of about ``limit`` bytes of payload (at least one sample each)."""
    chunk: list[pb.Sample] = []
    size = 0
    for sample in samples:
        n = len(sample.data)
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(sample)
        size += n
    if chunk:
        yield chunk


class _BaselineServicer(cache_pb2_grpc.CacheServicer):
    """Read only, from payloads held in memory, chunked to about READ_CHUNK_BYTES as the daemon chunks."""

    def __init__(self, payloads: dict[int, tuple[bytes, int]]) -> None:
        self.payloads = payloads

    async def Read(self, request: pb.ReadRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        samples = []
        for sample_id in request.ids:
            data, digest = self.payloads[sample_id]
            samples.append(pb.Sample(id=sample_id, tier=pb.TIER_CACHE, data=data, checksum=digest))
        for chunk in chunked(samples):
            yield pb.ReadChunk(samples=chunk)


async def _serve_baseline(paths_file: Path, ready_file: Path) -> None:
    tune_malloc()  # as the daemon does: without it every 110 KiB buffer page-faults
    listing = json.loads(paths_file.read_text())
    payloads = {}
    for sample_id, path in listing:
        data = Path(path).read_bytes()
        payloads[int(sample_id)] = (data, checksum(data))
    server = grpc.aio.server(options=server_options())
    cache_pb2_grpc.add_CacheServicer_to_server(_BaselineServicer(payloads), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tmp = ready_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    os.replace(tmp, ready_file)
    await stop.wait()
    await server.stop(1)


@contextmanager
def baseline_server(home: Path, listing: list[tuple[int, str]]) -> Iterator[str]:
    """The baseline server in a child process; yields its HOST:PORT."""
    home.mkdir(parents=True, exist_ok=True)
    paths_file, ready_file = home / "paths.json", home / "ready.json"
    paths_file.write_text(json.dumps(listing))
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--baseline-server", str(paths_file), str(ready_file)],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the baseline server did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{json.loads(ready_file.read_text())['port']}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ------------------------------------------------------------------- cluster


def _stub(address: str) -> tuple[grpc.Channel, cache_pb2_grpc.CacheStub]:
    channel = grpc.insecure_channel(grpc_target(address), options=channel_options())
    return channel, cache_pb2_grpc.CacheStub(channel)


def _read_seconds(daemon: DaemonProcess) -> tuple[float, float]:
    """(sum of seconds, count) of the daemon's Read latency histogram."""
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    found = {}
    for kind in ("sum", "count"):
        match = re.search(rf'^dataquay_request_seconds_{kind}\{{method="Read"\}} (\S+)$', text, re.MULTILINE)
        found[kind] = float(match.group(1)) if match else 0.0
    return found["sum"], found["count"]


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def bench_size(
    daemons: list[DaemonProcess], base: Path, label: str, size: int
) -> tuple[dict[str, object], dict[str, object]]:
    count = DATASET_BYTES // size
    progress(f"{label}: {count} samples, staged over {len(daemons)} nodes")
    root = make_files_dataset(base / "pfs" / label, count, sizes=(size,))
    paths = sorted(str(p) for p in root.rglob("*.bin"))
    job_id = f"peers-{label}"
    channels, stubs = zip(*(_stub(d.address) for d in daemons))
    try:
        stubs[0].AddDataset(pb.AddDatasetRequest(name=label, root=str(root)))
        stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job_id, dataset=label, nodes=NODES)))
        for stub in stubs:
            *_, last = stub.Stage(pb.StageRequest(dataset=label, job=job_id))
            if last.error or last.done_samples != last.total_samples:
                raise RuntimeError(f"staging {label} on {last.node} failed: {last.error}")
        n1_tcp = stubs[1].Info(pb.InfoRequest()).tcp_address
    finally:
        for channel in channels:
            channel.close()

    shm_client = connect(daemons[0].address)
    before = os.environ.get("DATAQUAY_SHM_BYTES")
    os.environ["DATAQUAY_SHM_BYTES"] = "0"
    try:
        inline_client = connect(daemons[0].address)
    finally:
        if before is None:
            del os.environ["DATAQUAY_SHM_BYTES"]
        else:
            os.environ["DATAQUAY_SHM_BYTES"] = before
    shm_ds, inline_ds = shm_client.dataset(label), inline_client.dataset(label)
    sampler = shm_ds.sampler(job=job_id, rank=0, world_size=len(NODES))
    inline_ds.sampler(job=job_id, rank=0, world_size=len(NODES))
    owner = sampler.owners(0)
    rng = np.random.default_rng(0)
    remote, local = rng.permutation(np.flatnonzero(owner == 1)), rng.permutation(np.flatnonzero(owner == 0))
    batches = [remote[i : i + BATCH] for i in range(0, len(remote) - BATCH + 1, BATCH)] * PASSES
    local_batches = [local[i : i + BATCH] for i in range(0, len(local) - BATCH + 1, BATCH)] * PASSES
    total = len(batches) * BATCH

    for want in batches[0][:4].tolist():
        assert shm_ds[want] == sample_bytes(0, want, size), f"sample {want} arrived wrong"
        assert inline_ds[want] == sample_bytes(0, want, size), f"sample {want} arrived wrong (inline)"

    peer_channel, peer_stub = _stub(n1_tcp)
    manifest_id = shm_ds.manifest.manifest_id

    def hop1() -> int:
        for b in batches:
            request = pb.ReadRequest(dataset=label, ids=b.tolist(), manifest_id=manifest_id, peer=True)
            got = [s.data for chunk in peer_stub.Read(request) for s in chunk.samples]
            assert len(got) == BATCH
        return total

    def hop2() -> int:
        for b in local_batches:
            shm_client.remote._read_daemon(shm_ds, b, None)
        return len(local_batches) * BATCH

    def direct() -> int:
        for b in batches:
            for i in b.tolist():
                with open(paths[i], "rb") as f:
                    f.read()
        return total

    listing = [(i, paths[i]) for i in remote.tolist()]
    with baseline_server(base / f"baseline-{label}", listing) as address:
        base_channel, base_stub = _stub(address)

        def baseline() -> int:
            for b in batches:
                got = [s.data for chunk in base_stub.Read(pb.ReadRequest(ids=b.tolist())) for s in chunk.samples]
                assert len(got) == BATCH
            return total

        first = [s.data for c in base_stub.Read(pb.ReadRequest(ids=batches[0][:4].tolist())) for s in c.samples]
        assert first == [sample_bytes(0, i, size) for i in batches[0][:4].tolist()], "baseline sent wrong bytes"

        def peer_shm() -> int:
            for b in batches:
                shm_ds.get_batch(b)
            return total

        def peer_inline() -> int:
            for b in batches:
                inline_ds.get_batch(b)
            return total

        runs: dict[str, Callable[[], int]] = {
            "direct": direct,
            "baseline": baseline,
            "hop1": hop1,
            "hop2": hop2,
            "peer_shm": peer_shm,
            "peer_inline": peer_inline,
        }
        for run in runs.values():
            run()  # warm: page cache, connections, segments
        peers_before = (shm_client.stats().samples["peer"], inline_client.stats().samples["peer"])
        rates: dict[str, list[float]] = {name: [] for name in runs}
        server_time = {"n0": [0.0, 0.0], "n1": [0.0, 0.0]}
        for round_ in range(REPEATS):
            progress(f"{label}: round {round_ + 1} of {REPEATS}")
            for name, run in runs.items():
                if name == "peer_shm":
                    marks = [_read_seconds(d) for d in daemons]
                started = time.perf_counter()
                samples = run()
                rates[name].append(samples / (time.perf_counter() - started))
                if name == "peer_shm":
                    for node, daemon, (s0, c0) in zip(NODES, daemons, marks):
                        s1, c1 = _read_seconds(daemon)
                        server_time[node][0] += s1 - s0
                        server_time[node][1] += c1 - c0
        base_channel.close()
    peer_channel.close()

    got = (
        shm_client.stats().samples["peer"] - peers_before[0],
        inline_client.stats().samples["peer"] - peers_before[1],
    )
    assert got == (REPEATS * total, REPEATS * total), f"not every read was a peer hit: {got}"
    assert shm_client.stats().samples["pfs"] == inline_client.stats().samples["pfs"] == 0
    shm_client.close()
    inline_client.close()

    rate = {name: _median(values) for name, values in rates.items()}
    gbps = {name: value * size / 1e9 for name, value in rate.items()}
    main_row: dict[str, object] = {
        "size": label,
        "baseline_per_s": rate["baseline"],
        "baseline_GBps": gbps["baseline"],
        "peer_shm_per_s": rate["peer_shm"],
        "peer_shm_GBps": gbps["peer_shm"],
        "shm_ratio": rate["peer_shm"] / rate["baseline"],
        "peer_inline_per_s": rate["peer_inline"],
        "peer_inline_GBps": gbps["peer_inline"],
        "inline_ratio": rate["peer_inline"] / rate["baseline"],
        "direct_per_s": rate["direct"],
        "direct_GBps": gbps["direct"],
        "target": TARGET,
    }
    ms_per_batch = {name: 1e3 * BATCH / value for name, value in rate.items()}
    hops_row: dict[str, object] = {
        "size": label,
        "baseline_ms": ms_per_batch["baseline"],
        "hop1_ms": ms_per_batch["hop1"],
        "hop2_shm_ms": ms_per_batch["hop2"],
        "peer_shm_ms": ms_per_batch["peer_shm"],
        "peer_inline_ms": ms_per_batch["peer_inline"],
        "n1_read_ms": 1e3 * server_time["n1"][0] / max(server_time["n1"][1], 1),
        "n0_read_ms": 1e3 * server_time["n0"][0] / max(server_time["n0"][1], 1),
        "hop1_GBps": gbps["hop1"],
        "hop2_shm_GBps": gbps["hop2"],
        "chunk_bytes": READ_CHUNK_BYTES,
    }
    return main_row, hops_row


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    rows, hops = [], []
    with tempfile.TemporaryDirectory(prefix="dq-bench-peers-") as tmp:
        base = Path(tmp)
        directory = DirectoryProcess(base / "directory", dataset_roots=(base,)).start()
        daemons: list[DaemonProcess] = []
        try:
            for name in NODES:
                daemons.append(
                    DaemonProcess(
                        base / name, ("--directory", directory.address, "--node-name", name), dataset_roots=(base,)
                    ).start()
                )
            for label, size in SIZES.items():
                if label in wanted:
                    row, hop = bench_size(daemons, base, label, size)
                    rows.append(row)
                    hops.append(hop)
        finally:
            for process in [*daemons, directory]:
                process.kill()
    report(
        "peer_hits",
        rows,
        [
            "size",
            "baseline_per_s",
            "baseline_GBps",
            "peer_shm_per_s",
            "peer_shm_GBps",
            "shm_ratio",
            "peer_inline_per_s",
            "peer_inline_GBps",
            "inline_ratio",
            "direct_per_s",
            "direct_GBps",
            "target",
        ],
    )
    report(
        "peer_hops",
        hops,
        [
            "size",
            "baseline_ms",
            "hop1_ms",
            "hop2_shm_ms",
            "peer_shm_ms",
            "peer_inline_ms",
            "n1_read_ms",
            "n0_read_ms",
            "hop1_GBps",
            "hop2_shm_GBps",
        ],
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--baseline-server":
        from dataquay.server.loops import loop_factory

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_serve_baseline(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        main()
