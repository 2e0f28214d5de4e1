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
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from common import REPEATS, progress, report
from dataquay.client.channels import channel_options, server_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.launch import DirectoryProcess

NODES = int(os.environ.get("BENCH_NODES", "1024"))
#: "node": a connection per simulated node, as daemons have; "generator": all
#: nodes of a generator share one (for the analysis in BENCHMARKS.md).
CONNECTIONS = os.environ.get("BENCH_CONNECTIONS", "node")
#: "0" drops the daemons' keepalive pings (for the analysis).
KEEPALIVE = os.environ.get("BENCH_KEEPALIVE", "1") != "0"
GENERATORS = 2
RAMP_SECONDS = 5.0
WARMUP_SECONDS = 20.0
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
    return _stat_seconds(Path(f"/proc/{pid}/stat"))


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, summed by thread name."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + _stat_seconds(task / "stat")
        except OSError:
            continue  # the thread ended
    return out


def _stat_seconds(path: Path) -> float:
    fields = path.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _list_nodes(address: str) -> dpb.ListNodesReply:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        return directory_pb2_grpc.DirectoryStub(channel).ListNodes(dpb.ListNodesRequest(), timeout=30)


# ----------------------------------------------------------------- baseline


class _BareServicer(directory_pb2_grpc.DirectoryServicer):
    """The directory's node calls answered with constants: gRPC's own cost."""

    def __init__(self) -> None:
        self.registered = dpb.RegisterNodeReply(lease_seconds=10.0, heartbeat_seconds=2.0)
        self.beat = dpb.HeartbeatReply(known=True)

    async def RegisterNode(self, request, context):  # type: ignore[no-untyped-def]
        return self.registered

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        return self.beat

    async def ListNodes(self, request, context):  # type: ignore[no-untyped-def]
        return dpb.ListNodesReply()

    async def ListJobs(self, request, context):  # type: ignore[no-untyped-def]
        return jpb.ListJobsReply()

    async def ListDatasets(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ListDatasetsReply()


async def _serve_bare(ready_file: Path) -> None:
    server = grpc.aio.server(options=server_options())
    directory_pb2_grpc.add_DirectoryServicer_to_server(_BareServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready_file.with_suffix(".tmp").write_text(json.dumps({"port": port}))
    os.replace(ready_file.with_suffix(".tmp"), ready_file)
    await stop.wait()
    await server.stop(1)


# ---------------------------------------------------------------- the bench


def load(pid: int, address: str, base: Path, tag: str) -> dict[str, object]:
    """Runs the simulated nodes against the server ``pid`` at ``address``; its CPU and their view."""
    progress(f"{tag}: registering {NODES} nodes from {GENERATORS} generator processes")
    per = NODES // GENERATORS
    generators: list[subprocess.Popen[str]] = []
    try:
        boot_cpu, boot_wall = cpu_seconds(pid), time.monotonic()
        for g in range(GENERATORS):
            generators.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--generate", str(g * per), str(per), address,
                 str(base / f"{tag}-generator-{g}.json")],
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

        before = _list_nodes(address)
        progress(f"{tag}: {REPEATS} windows of {WINDOW_SECONDS:.0f} s")

        def mark() -> tuple[float, float, float, dict[str, float], float]:
            return (time.time(), time.monotonic(), cpu_seconds(pid), thread_seconds(pid),
                    sum(cpu_seconds(g.pid) for g in generators))

        marks = [mark()]
        for _ in range(REPEATS):
            time.sleep(WINDOW_SECONDS)
            marks.append(mark())
        after = _list_nodes(address)
        for generator in generators:
            assert generator.stdin is not None
            generator.stdin.close()
        for generator in generators:
            generator.wait(60)
        logs = [json.loads((base / f"{tag}-generator-{g}.json").read_text()) for g in range(GENERATORS)]
    finally:
        for generator in generators:
            if generator.poll() is None:
                generator.kill()
                generator.wait()

    start, end = marks[0][0], marks[-1][0]
    span = marks[-1][1] - marks[0][1]
    beats = [b for log in logs for b in log["beats"] if start <= b[0] < end]
    latencies = np.array([b[1] for b in beats]) * 1e3
    windows = [100 * (b[2] - a[2]) / (b[1] - a[1]) for a, b in itertools.pairwise(marks)]
    threads = {name: 100 * (marks[-1][3].get(name, 0.0) - marks[0][3].get(name, 0.0)) / span
               for name in marks[-1][3]}
    listed = {n.info.name: n.state for n in after.nodes}
    return {
        "cpu_pct": statistics.median(windows),
        "cpu_pct_windows": [round(w, 2) for w in windows],
        "cpu_pct_by_thread": {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v},
        "heartbeats_per_s": len(beats) / (end - start),
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "max_ms": float(latencies.max()),
        "nodes_up_end": sum(1 for i in range(NODES) if listed.get(f"sim-{i:05d}") == jpb.NODE_UP),
        "node_changes": after.versions.nodes - before.versions.nodes,
        "errors": sum(len(log["errors"]) for log in logs),
        "reregistered": sum(len(log["reregistered"]) for log in logs),
        "list_nodes_in_windows": sum(1 for log in logs for t in log["list_nodes"] if start <= t < end),
        "generators_cpu_pct": 100 * (marks[-1][4] - marks[0][4]) / span,
        "boot_s": registered_s,
        "boot_cpu_s": boot_cpu,
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dq-bench-directory-") as tmp:
        base = Path(tmp)
        directory = DirectoryProcess(base / "directory").start()
        try:
            pid = directory.process.pid  # type: ignore[union-attr]
            progress(f"idle directory, {WINDOW_SECONDS:.0f} s")
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            time.sleep(WINDOW_SECONDS)
            idle_pct = 100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)
            loaded = load(pid, directory.address, base, "directory")
        finally:
            directory.stop()

        ready = base / "bare-ready.json"
        bare = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--bare-server", str(ready)],
                                stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if bare.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the bare gRPC server did not start")
                time.sleep(0.05)
            floor = load(bare.pid, f"127.0.0.1:{json.loads(ready.read_text())['port']}", base, "bare")
        finally:
            bare.terminate()
            bare.wait(30)

    rows: list[dict[str, object]] = []
    for server, result in (("directory", loaded), ("bare grpc.aio", floor)):
        rows.append({
            "server": server,
            "nodes": NODES,
            "connections": CONNECTIONS,
            "keepalive": KEEPALIVE,
            "windows_s": f"{REPEATS} x {WINDOW_SECONDS:.0f}",
            "idle_cpu_pct": idle_pct if server == "directory" else None,
            **result,
            "vs_bare": result["cpu_pct"] / floor["cpu_pct"],  # type: ignore[operator]
            "target_pct": TARGET_PERCENT,
            "expected_per_s": NODES / 2.0,
        })
    report(
        "directory_load",
        rows,
        ["server", "nodes", "idle_cpu_pct", "cpu_pct", "vs_bare", "target_pct", "heartbeats_per_s", "expected_per_s",
         "p50_ms", "p99_ms", "max_ms", "nodes_up_end", "node_changes", "errors", "list_nodes_in_windows",
         "generators_cpu_pct", "boot_s", "boot_cpu_s"],
    )
    assert loaded["nodes_up_end"] == NODES, f"only {loaded['nodes_up_end']} of {NODES} nodes are UP at the end"
    assert not loaded["node_changes"], "nodes went down or came back during the windows"


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--generate":
        from dataquay.server.loops import loop_factory

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_generate(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])))
    elif len(sys.argv) == 3 and sys.argv[1] == "--bare-server":
        from dataquay.server.loops import loop_factory

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_serve_bare(Path(sys.argv[2])))
    else:
        main()
