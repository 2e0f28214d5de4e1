"""The directory's CPU with 1,024 nodes heartbeating, against its own idle CPU.

A real directory process (``dataquay directory``, default lease 10 s and
heartbeat 2 s) and ``GENERATORS`` load-generator processes (this file with
``--generate``), never the same process. Each simulated node does what a
daemon's DirectoryLink does: its own TCP connection (gRPC channel with the
daemon's options, keepalive pings included), RegisterNode at a random moment
of a ``RAMP_SECONDS`` boot ramp, then a Heartbeat every heartbeat_seconds
(the reply's value) with +-10% jitter, and ListNodes / ListJobs /
ListDatasets whenever a reply's versions say they changed (so the boot ramp
has the daemons' refetch storm; steady state has none).

Measured: the directory process's CPU (utime + stime from /proc/PID/stat)
over ``REPEATS`` consecutive windows of ``WINDOW_SECONDS``, after all nodes
registered and ``WARMUP_SECONDS`` passed, divided by wall time: % of one
core, median of the windows (and the whole span). Against: the same
directory's CPU over one window with no node registered, measured first. The
generators count heartbeat replies by wall-clock time and time each call, so
the heartbeats/s and the p50/p99 latency are of the same windows; at the end
ListNodes must show every simulated node UP, and the node-set version must
not have moved during the windows (no node went down and came back).
The issue's target: under 10% of one core.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from common import REPEATS, progress, report
from dataquay.client.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.launch import DirectoryProcess

NODES = int(os.environ.get("BENCH_NODES", 1024))
#: "node": a connection per simulated node, as daemons have; "generator": all
#: nodes of a generator share one (for the analysis in BENCHMARKS.md).
CONNECTIONS = os.environ.get("BENCH_CONNECTIONS", "node")
#: "0" drops the daemons' keepalive pings (for the analysis).
KEEPALIVE = os.environ.get("BENCH_KEEPALIVE", "1") != "0"
GENERATORS = 2
RAMP_SECONDS = 5.0
WARMUP_SECONDS = 10.0
WINDOW_SECONDS = 10.0
TARGET_PERCENT = 10.0
CALL_TIMEOUT_SECONDS = 10.0
_TICKS = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------- generator


class _Node:
    """One simulated daemon's directory traffic."""

    def __init__(self, index: int, channel: grpc.aio.Channel, log: dict[str, list]) -> None:  # type: ignore[type-arg]
        self.name = f"sim-{index:05d}"
        self.info = jpb.NodeInfo(
            name=self.name, tcp_address=f"127.0.0.1:{20000 + index}", metrics_address=f"127.0.0.1:{40000 + index}",
            cache_capacity=1 << 40, pid=os.getpid(), version="bench",
        )
        self.stub = directory_pb2_grpc.DirectoryStub(channel)
        self.versions = dpb.Versions()
        self.log = log
        self.period = 2.0

    async def register(self) -> None:
        reply = await self.stub.RegisterNode(dpb.RegisterNodeRequest(node=self.info), timeout=CALL_TIMEOUT_SECONDS)
        self.period = reply.heartbeat_seconds or self.period
        await self.sync(reply.versions, force=True)

    async def sync(self, versions: dpb.Versions, force: bool = False) -> None:
        if force or versions.nodes != self.versions.nodes:
            await self.stub.ListNodes(dpb.ListNodesRequest(), timeout=CALL_TIMEOUT_SECONDS)
            self.log["list_nodes"].append(time.time())
        if force or versions.jobs != self.versions.jobs:
            await self.stub.ListJobs(jpb.ListJobsRequest(), timeout=CALL_TIMEOUT_SECONDS)
        if force or versions.datasets != self.versions.datasets:
            await self.stub.ListDatasets(pb.ListDatasetsRequest(), timeout=CALL_TIMEOUT_SECONDS)
        self.versions = versions

    async def run(self, registered: asyncio.Queue[None]) -> None:
        await asyncio.sleep(random.uniform(0, RAMP_SECONDS))
        while True:
            try:
                await self.register()
                break
            except grpc.aio.AioRpcError as exc:
                self.log["errors"].append([time.time(), "RegisterNode", exc.code().name])
                await asyncio.sleep(0.5)
        registered.put_nowait(None)
        request = dpb.HeartbeatRequest(name=self.name, cache_used_bytes=1 << 30, cache_entries=10_000)
        while True:
            await asyncio.sleep(self.period * random.uniform(0.9, 1.1))
            started = time.perf_counter()
            try:
                reply = await self.stub.Heartbeat(request, timeout=CALL_TIMEOUT_SECONDS)
                self.log["beats"].append([time.time(), time.perf_counter() - started, reply.versions.nodes])
                if not reply.known:
                    self.log["reregistered"].append(time.time())
                    await self.register()
                    continue
                await self.sync(reply.versions)
            except grpc.aio.AioRpcError as exc:
                self.log["errors"].append([time.time(), "Heartbeat", exc.code().name])


async def _generate(first: int, count: int, address: str, out: Path) -> None:
    log: dict[str, list] = {"beats": [], "errors": [], "reregistered": [], "list_nodes": []}  # type: ignore[type-arg]
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    if not KEEPALIVE:
        options = [(k, v) for k, v in options if not k.startswith("grpc.keepalive")]
    channels = [grpc.aio.insecure_channel(address, options=options)
                for _ in range(count if CONNECTIONS == "node" else 1)]
    nodes = [_Node(i, channels[(i - first) % len(channels)], log) for i in range(first, first + count)]
    registered: asyncio.Queue[None] = asyncio.Queue()
    tasks = [asyncio.create_task(node.run(registered)) for node in nodes]
    for _ in nodes:
        await registered.get()
    print(f"registered {count}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    out.write_text(json.dumps(log))


# ---------------------------------------------------------------- the bench


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _heartbeats_counter(directory: DirectoryProcess) -> float:
    text = urllib.request.urlopen(directory.http_url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("dataquay_directory_heartbeats_total "):
            return float(line.split()[1])
    raise RuntimeError("the directory exports no heartbeat counter")


def _list_nodes(address: str) -> dpb.ListNodesReply:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        return directory_pb2_grpc.DirectoryStub(channel).ListNodes(dpb.ListNodesRequest(), timeout=30)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dq-bench-directory-") as tmp:
        base = Path(tmp)
        directory = DirectoryProcess(base / "directory").start()
        pid = directory.process.pid  # type: ignore[union-attr]
        generators: list[subprocess.Popen[str]] = []
        try:
            progress(f"idle directory, {WINDOW_SECONDS:.0f} s")
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            time.sleep(WINDOW_SECONDS)
            idle_pct = 100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)

            progress(f"registering {NODES} nodes from {GENERATORS} generator processes")
            per = NODES // GENERATORS
            boot_cpu, boot_wall = cpu_seconds(pid), time.monotonic()
            for g in range(GENERATORS):
                generators.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--generate", str(g * per), str(per),
                     directory.address, str(base / f"generator-{g}.json")],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                ))
            for generator in generators:
                assert generator.stdout is not None
                line = generator.stdout.readline()
                if not line.startswith("registered"):
                    raise RuntimeError(f"a generator failed to register its nodes: {line!r}")
            registered_s = time.monotonic() - boot_wall
            time.sleep(WARMUP_SECONDS)
            boot_cpu = cpu_seconds(pid) - boot_cpu

            before = _list_nodes(directory.address)
            progress(f"{REPEATS} windows of {WINDOW_SECONDS:.0f} s")
            marks = [(time.time(), time.monotonic(), cpu_seconds(pid), _heartbeats_counter(directory),
                      [cpu_seconds(g.pid) for g in generators])]
            for _ in range(REPEATS):
                time.sleep(WINDOW_SECONDS)
                marks.append((time.time(), time.monotonic(), cpu_seconds(pid), _heartbeats_counter(directory),
                              [cpu_seconds(g.pid) for g in generators]))
            after = _list_nodes(directory.address)

            for generator in generators:
                assert generator.stdin is not None
                generator.stdin.close()
            for generator in generators:
                generator.wait(60)
            logs = [json.loads((base / f"generator-{g}.json").read_text()) for g in range(GENERATORS)]
        finally:
            for generator in generators:
                if generator.poll() is None:
                    generator.kill()
                    generator.wait()
            directory.stop()

    names = {f"sim-{i:05d}" for i in range(NODES)}
    listed = {n.info.name: n.state for n in after.nodes}
    up = sum(1 for name in names if listed.get(name) == jpb.NODE_UP)
    assert up == NODES, f"only {up} of {NODES} nodes are UP at the end"
    assert after.versions.nodes == before.versions.nodes, "a node went down or came back during the windows"

    start, end = marks[0][0], marks[-1][0]
    beats = [b for log in logs for b in log["beats"] if start <= b[0] < end]
    latencies = np.array([b[1] for b in beats]) * 1e3
    errors = [e for log in logs for e in log["errors"]]
    reregistered = sum(len(log["reregistered"]) for log in logs)
    list_nodes_in_windows = sum(1 for log in logs for t in log["list_nodes"] if start <= t < end)
    windows = [
        (100 * (b[2] - a[2]) / (b[1] - a[1]), (b[3] - a[3]) / (b[1] - a[1]),
         100 * (sum(b[4]) - sum(a[4])) / (b[1] - a[1]))
        for a, b in zip(marks, marks[1:])
    ]
    span = marks[-1][1] - marks[0][1]
    row: dict[str, object] = {
        "nodes": NODES,
        "connections": CONNECTIONS,
        "keepalive": KEEPALIVE,
        "heartbeat_s": 2.0,
        "windows_s": f"{REPEATS} x {WINDOW_SECONDS:.0f}",
        "idle_cpu_pct": idle_pct,
        "cpu_pct": statistics.median(w[0] for w in windows),
        "cpu_pct_span": 100 * (marks[-1][2] - marks[0][2]) / span,
        "cpu_pct_windows": [round(w[0], 2) for w in windows],
        "target_pct": TARGET_PERCENT,
        "heartbeats_per_s": len(beats) / (end - start),
        "directory_counted_per_s": statistics.median(w[1] for w in windows),
        "expected_per_s": NODES / 2.0,
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "max_ms": float(latencies.max()),
        "nodes_up_end": up,
        "errors": len(errors),
        "reregistered": reregistered,
        "list_nodes_in_windows": list_nodes_in_windows,
        "generators_cpu_pct": statistics.median(w[2] for w in windows),
        "boot_s": registered_s,
        "boot_cpu_s": boot_cpu,
    }
    report(
        "directory_load",
        [row],
        ["nodes", "windows_s", "idle_cpu_pct", "cpu_pct", "cpu_pct_span", "target_pct", "heartbeats_per_s",
         "directory_counted_per_s", "expected_per_s", "p50_ms", "p99_ms", "max_ms", "nodes_up_end", "errors",
         "generators_cpu_pct", "boot_s", "boot_cpu_s"],
    )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--generate":
        from dataquay.server.loops import loop_factory

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_generate(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])))
    else:
        main()
