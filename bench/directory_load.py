"""The directory's CPU with 1,024 or 4,096 nodes heartbeating, against a bare server.

A real directory process (``dataquay directory``, heartbeat 2 s, lease 10 s)
and ``GENERATORS`` load-generator processes (this file with ``--generate``),
never the same process. Each simulated node does what a daemon's
DirectoryLink does: its own gRPC channel to the directory (one TCP
connection, the daemons' channel options, keepalive pings included) and its
own UDP socket; RegisterNode at a random moment of a ``RAMP_SECONDS`` boot
ramp; then a beat every heartbeat_seconds (the registration reply's value,
+-10% jitter) sent as a datagram by the daemons' own HeartbeatSender, and
repeated through the Heartbeat RPC when no answer comes within
DATAGRAM_WAIT_SECONDS; and ListNodes / ListJobs / ListDatasets whenever an
answer's versions moved, so the boot ramp has the daemons' refetches and
steady state has none. ListNodes names the node-set version the simulated
node holds, as daemons do, and the directory answers with the changes since
(or the whole list, to a node that holds none). ``BENCH_HEARTBEAT=unary``
sends every beat through the RPC (the protocol before datagrams).

Measured: the server process's CPU (utime + stime from /proc/PID/stat, all
threads) over ``REPEATS`` consecutive windows of ``WINDOW_SECONDS``, once
all nodes registered, at least ``WARMUP_SECONDS`` passed and no node
refetched or failed a call for ``SETTLED_SECONDS``, divided by wall time:
% of one core, median of the windows. Heartbeats/s: answered beats in the
windows as the generators saw them, and beats the directory counted (its
/metrics); beat latency: send to answer, p50 and p99 over the windows. At
the end ListNodes must show every simulated node UP, the node-set version
must not have moved during the windows (no node went down and came back),
and no call may have failed in them. The target: under 10% of one
core.

Baseline, same run, same load: a bare server in a process of its own (this
file with ``--bare-server``): grpc.aio with the directory's server options
and the directory's datagram endpoint on the same port, on uvloop, answering
everything with constants, i.e. what the transports alone cost. Reported
also: CPU by thread (Python vs gRPC's event-engine threads), and the boot:
seconds until all nodes had registered and until the refetches settled, the
server's CPU seconds from the first registration to the windows (the
refetch storm), and the calls that failed during it.

Knobs for the analysis in docs/results.md (results then go to
``directory_load-<variant>.json``): BENCH_NODES, BENCH_HEARTBEAT_SECONDS
(the lease is five heartbeats, at least 10 s), BENCH_HEARTBEAT=unary,
BENCH_CONNECTIONS=generator (one gRPC connection per generator process),
BENCH_KEEPALIVE=0, and BENCH_DIRECTORY_SOURCE=DIR: the directory runs from
the source tree DIR (e.g. ``git archive`` of an earlier commit; its protos,
client and server folders) under the same load, for a before/after figure.
BENCH_STORE=etcd runs the directory on the etcd store, a local one-member
etcd (the etcd-server package) started for the run; reported beside the
directory's CPU: etcd's CPU and its write rate (revisions a second; lease
renewals are not writes) over the windows.
A directory that answers ListNodes without versions (before node-set
versions) sends the whole list every time, as it did to daemons then. A
boot that does not settle within BENCH_MAX_WARMUP_SECONDS (300) is
reported as such (settled_s null) and the windows measured anyway.

Every simulated node is a real client of its own (a gRPC connection and a
UDP socket), GENERATORS processes of them on one event loop each: 4,096
nodes are 4,096 connections and sockets in two processes, beating 819 times
a second at a 5 s heartbeat, which two cores carry.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from common import REPEATS, progress, report

from dataquay.client.wire.channels import channel_options, server_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc, etcd_rpc_pb2, etcd_rpc_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.beats import HeartbeatSender, open_heartbeats
from dataquay.server.node.cluster.directory_link import DATAGRAM_WAIT_SECONDS
from dataquay.server.tools.etcd_cluster import EtcdCluster
from dataquay.server.tools.processes import DirectoryProcess

NODES = int(os.environ.get("BENCH_NODES", "1024"))
HEARTBEAT_SECONDS = float(os.environ.get("BENCH_HEARTBEAT_SECONDS", "2"))
LEASE_SECONDS = max(10.0, 5 * HEARTBEAT_SECONDS)
#: "udp": datagrams with the RPC as fallback, as daemons do; "unary": the RPC only.
HEARTBEAT = os.environ.get("BENCH_HEARTBEAT", "udp")
#: "node": a connection per simulated node, as daemons have; "generator": all
#: nodes of a generator process share one.
CONNECTIONS = os.environ.get("BENCH_CONNECTIONS", "node")
#: "0" drops the daemons' keepalive pings.
KEEPALIVE = os.environ.get("BENCH_KEEPALIVE", "1") != "0"
GENERATORS = 2
RAMP_SECONDS = 5.0
WARMUP_SECONDS = 10.0
#: The windows start once no node refetched or failed for this long (longer
#: than the heartbeat, so that a version published within it is seen) ...
SETTLED_SECONDS = max(5.0, 2 * HEARTBEAT_SECONDS)
#: ... which must happen within this.
MAX_WARMUP_SECONDS = float(os.environ.get("BENCH_MAX_WARMUP_SECONDS", "300"))
#: A source tree to run the directory from (the before of a comparison).
DIRECTORY_SOURCE = os.environ.get("BENCH_DIRECTORY_SOURCE", "")
#: "embedded" (the state file) or "etcd" (a local etcd started for the run).
STORE = os.environ.get("BENCH_STORE", "embedded")
WINDOW_SECONDS = 10.0
TARGET_PERCENT = 10.0
CALL_TIMEOUT_SECONDS = 10.0
_TICKS = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------- generator


class _Node:
    """One simulated daemon's directory traffic."""

    def __init__(self, index: int, channel: grpc.aio.Channel, address: str, log: dict[str, Any]) -> None:
        self.name = f"sim-{index:05d}"
        self.info = jpb.NodeInfo(
            name=self.name,
            tcp_address=f"127.0.0.1:{20000 + index}",
            metrics_address=f"127.0.0.1:{40000 + index}",
            cache_capacity=1 << 40,
            pid=os.getpid(),
            version="bench",
        )
        self.beat = dpb.HeartbeatRequest(name=self.name, cache_used_bytes=1 << 30, cache_entries=10_000)
        self.stub = directory_pb2_grpc.DirectoryStub(channel)
        self.address = address
        self.versions = dpb.Versions()
        self.nodes_version = 0
        self.log = log
        self.period = HEARTBEAT_SECONDS

    async def run(self, registered: asyncio.Queue[None]) -> None:
        await asyncio.sleep(random.uniform(0, RAMP_SECONDS))
        sender = await HeartbeatSender.connect(self.address) if HEARTBEAT == "udp" else None
        await self.register()
        registered.put_nowait(None)
        while True:
            try:
                await asyncio.sleep(self.period * random.uniform(0.9, 1.1))
                started = time.perf_counter()
                reply = await sender.beat(self.beat, DATAGRAM_WAIT_SECONDS) if sender is not None else None
                by_rpc = reply is None
                if reply is None:
                    reply = await self.stub.Heartbeat(self.beat, timeout=CALL_TIMEOUT_SECONDS)
                self.log["beats"].append([time.time(), time.perf_counter() - started, by_rpc])
                if not reply.known:
                    self.log["reregistered"].append(time.time())
                    await self.register()
                    continue
                await self.sync(reply.versions)
            except grpc.aio.AioRpcError as exc:
                self.log["errors"].append([time.time(), "Heartbeat or a refetch", exc.code().name])

    async def register(self) -> None:
        while True:
            try:
                reply = await self.stub.RegisterNode(
                    dpb.RegisterNodeRequest(node=self.info, identity_key=hashlib.sha256(self.name.encode()).digest()),
                    timeout=CALL_TIMEOUT_SECONDS,
                )
                self.beat.session = reply.session
                self.period = reply.heartbeat_seconds or self.period
                await self.sync(reply.versions, force=True)
                return
            except grpc.aio.AioRpcError as exc:
                self.log["errors"].append([time.time(), "RegisterNode", exc.code().name])
                await asyncio.sleep(0.5)

    async def sync(self, versions: dpb.Versions, force: bool = False) -> None:
        if force or versions.nodes != self.nodes_version:
            reply = await self.stub.ListNodes(
                dpb.ListNodesRequest(since_version=self.nodes_version), timeout=CALL_TIMEOUT_SECONDS
            )
            self.nodes_version = reply.versions.nodes
            self.log["list_nodes"].append([time.time(), reply.delta, len(reply.nodes)])
        if force or versions.jobs != self.versions.jobs:
            await self.stub.ListJobs(jpb.ListJobsRequest(), timeout=CALL_TIMEOUT_SECONDS)
        if force or versions.datasets != self.versions.datasets:
            await self.stub.ListDatasets(pb.ListDatasetsRequest(), timeout=CALL_TIMEOUT_SECONDS)
        self.versions = versions


async def _generate(first: int, count: int, address: str, out: Path) -> None:
    log: dict[str, Any] = {"beats": [], "errors": [], "reregistered": [], "list_nodes": []}
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    if not KEEPALIVE:
        options = [(k, v) for k, v in options if not k.startswith("grpc.keepalive")]
    channels = [
        grpc.aio.insecure_channel(address, options=options) for _ in range(count if CONNECTIONS == "node" else 1)
    ]
    nodes = [_Node(i, channels[(i - first) % len(channels)], address, log) for i in range(first, first + count)]
    registered: asyncio.Queue[None] = asyncio.Queue()
    # Held here: the loop keeps only weak references to tasks.
    running = {asyncio.create_task(node.run(registered)) for node in nodes}

    async def report() -> None:
        for _ in nodes:
            await registered.get()
        print(f"registered {count}", flush=True)
        while True:
            print(f"refetches {len(log['list_nodes'])} {len(log['errors'])}", flush=True)
            await asyncio.sleep(1.0)

    running.add(asyncio.create_task(report()))
    # Until the parent closes stdin, whether every node registered or not.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    out.write_text(json.dumps(log))
    # Cancelling thousands of calls and closing their channels takes minutes
    # on a loaded machine, and nothing of it is measured.
    os._exit(0)


# ------------------------------------------------------------------ baseline


class _BareServicer(directory_pb2_grpc.DirectoryServicer):
    """The directory's node calls answered with constants: the transport's own cost."""

    def __init__(self) -> None:
        self.registered = dpb.RegisterNodeReply(lease_seconds=LEASE_SECONDS, heartbeat_seconds=HEARTBEAT_SECONDS)
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
    servicer = _BareServicer()
    server = grpc.aio.server(options=server_options())
    directory_pb2_grpc.add_DirectoryServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    beats = await open_heartbeats(
        f"127.0.0.1:{port}", lambda request, sequence: servicer.beat, "", 2 * LEASE_SECONDS, Counter()
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready_file.with_suffix(".tmp").write_text(json.dumps({"port": port}))
    os.replace(ready_file.with_suffix(".tmp"), ready_file)
    await stop.wait()
    beats.close()
    await server.stop(1)


# ----------------------------------------------------------------- the bench


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


def _list_nodes(address: str) -> dpb.ListNodesReply | None:
    """The whole node list, or None from a directory too busy to answer within 30 s."""
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        try:
            return directory_pb2_grpc.DirectoryStub(channel).ListNodes(dpb.ListNodesRequest(), timeout=30)
        except grpc.RpcError:
            return None


def _heartbeats_counted(directory: DirectoryProcess) -> Callable[[], float]:
    def counted() -> float:
        text = urllib.request.urlopen(directory.http_url + "/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("dataquay_directory_heartbeats_total "):
                return float(line.split()[1])
        raise RuntimeError("the directory exports no heartbeat counter")

    return counted


def _settle(generators: list[subprocess.Popen[str]]) -> float | None:
    """Waits until the generators' nodes made no ListNodes call and met no
    error for SETTLED_SECONDS (and WARMUP_SECONDS passed); returns when the
    last one happened (monotonic clock), or None if that never came within
    MAX_WARMUP_SECONDS."""
    counts: dict[int, str] = {}
    changed = [time.monotonic()]

    def follow(index: int, stream: Any) -> None:
        for line in stream:
            if line != counts.get(index):
                counts[index] = line
                changed[0] = time.monotonic()

    for index, generator in enumerate(generators):
        threading.Thread(target=follow, args=(index, generator.stdout), daemon=True).start()
    started = time.monotonic()
    while time.monotonic() - started < WARMUP_SECONDS or time.monotonic() - changed[0] < SETTLED_SECONDS:
        if time.monotonic() - started > MAX_WARMUP_SECONDS:
            progress(f"the nodes' refetches did not settle within {MAX_WARMUP_SECONDS:.0f} s")
            return None
        time.sleep(0.5)
    return changed[0]


def _line_by(generator: subprocess.Popen[str], deadline: float) -> str | None:
    """The generator's next line, or None if none came by ``deadline`` (monotonic clock)."""
    assert generator.stdout is not None
    ready, _, _ = select.select([generator.stdout], [], [], max(0.0, deadline - time.monotonic()))
    return generator.stdout.readline() if ready else None


def load(
    pid: int,
    address: str,
    base: Path,
    tag: str,
    counted: Callable[[], float] | None,
    probe: Callable[[], dict[str, float]] | None = None,
) -> dict[str, object]:
    """Runs the simulated nodes against the server ``pid`` at ``address``: its CPU and their view;
    ``probe``'s counters become rates a second over the windows."""
    progress(f"{tag}: registering {NODES} nodes from {GENERATORS} generator processes")
    per = NODES // GENERATORS
    generators: list[subprocess.Popen[str]] = []
    try:
        boot_cpu, boot_wall = cpu_seconds(pid), time.monotonic()
        for g in range(GENERATORS):
            generators.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--generate",
                        str(g * per),
                        str(per),
                        address,
                        str(base / f"{tag}-generator-{g}.json"),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = boot_wall + MAX_WARMUP_SECONDS
        lines = [_line_by(generator, deadline) for generator in generators]
        for line in lines:
            if line is not None and not line.startswith("registered"):
                raise RuntimeError(f"a generator failed to register its nodes: {line!r}")
        registered_s = settled_s = None
        if all(lines):
            registered_s = time.monotonic() - boot_wall
            settled = _settle(generators)
            settled_s = None if settled is None else settled - boot_wall
        else:
            progress(f"{tag}: the nodes did not all register within {MAX_WARMUP_SECONDS:.0f} s")
        boot_cpu = cpu_seconds(pid) - boot_cpu

        progress(f"{tag}: {REPEATS} windows of {WINDOW_SECONDS:.0f} s")
        before = _list_nodes(address)
        marks: list[dict[str, Any]] = []
        for window in range(REPEATS + 1):
            if window:
                time.sleep(WINDOW_SECONDS)
            marks.append(
                {
                    "time": time.time(),
                    "clock": time.monotonic(),
                    "cpu": cpu_seconds(pid),
                    "threads": thread_seconds(pid),
                    "generators": sum(cpu_seconds(g.pid) for g in generators),
                    "counted": counted() if counted else 0.0,
                    "probe": probe() if probe else {},
                }
            )
        after = _list_nodes(address)
        for generator in generators:
            assert generator.stdin is not None
            generator.stdin.close()
        for generator in generators:
            generator.wait(120)
        logs = [json.loads((base / f"{tag}-generator-{g}.json").read_text()) for g in range(GENERATORS)]
    finally:
        for generator in generators:
            if generator.poll() is None:
                generator.kill()
                generator.wait()

    first, last = marks[0], marks[-1]
    span = last["clock"] - first["clock"]
    beats = [b for log in logs for b in log["beats"] if first["time"] <= b[0] < last["time"]]
    latencies = np.array([b[1] for b in beats]) * 1e3
    windows = [100 * (b["cpu"] - a["cpu"]) / (b["clock"] - a["clock"]) for a, b in itertools.pairwise(marks)]
    threads = {
        name: 100 * (last["threads"].get(name, 0.0) - first["threads"].get(name, 0.0)) / span
        for name in last["threads"]
    }
    listed = {n.info.name: n.state for n in after.nodes} if after else {}
    return {
        **{f"{key}_per_s": (last["probe"][key] - first["probe"][key]) / span for key in last["probe"]},
        "cpu_pct": statistics.median(windows),
        "cpu_pct_windows": [round(w, 2) for w in windows],
        "cpu_pct_by_thread": {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v},
        "cpu_ms_per_beat": 1e3 * (last["cpu"] - first["cpu"]) / max(len(beats), 1),
        "heartbeats_per_s": len(beats) / (last["time"] - first["time"]),
        "beats_by_rpc": sum(1 for b in beats if b[2]),
        "directory_counted_per_s": (last["counted"] - first["counted"]) / span if counted else None,
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "max_ms": float(latencies.max()),
        "nodes_up_end": sum(1 for i in range(NODES) if listed.get(f"sim-{i:05d}") == jpb.NODE_UP),
        "node_changes": after.versions.nodes - before.versions.nodes if after and before else None,
        "errors": sum(1 for log in logs for t, *_ in log["errors"] if first["time"] <= t < last["time"]),
        "boot_errors": dict(
            Counter(f"{call} {code}" for log in logs for t, call, code in log["errors"] if t < first["time"])
        ),
        "reregistered": sum(len(log["reregistered"]) for log in logs),
        "boot_list_nodes": sum(1 for log in logs for t, *_ in log["list_nodes"] if t < first["time"]),
        "boot_full_lists": sum(
            1 for log in logs for t, delta, _ in log["list_nodes"] if t < first["time"] and not delta
        ),
        "boot_list_entries": sum(n for log in logs for t, _, n in log["list_nodes"] if t < first["time"]),
        "list_nodes_in_windows": sum(
            1 for log in logs for t, *_ in log["list_nodes"] if first["time"] <= t < last["time"]
        ),
        "generators_cpu_pct": 100 * (last["generators"] - first["generators"]) / span,
        "boot_s": registered_s,
        "settled_s": settled_s,
        "boot_cpu_s": boot_cpu,
    }


def _etcd_probe(etcd: EtcdCluster) -> Callable[[], dict[str, float]]:
    """etcd's revision (one a write) and CPU seconds, to become rates."""
    pid = etcd.pids()[0][0]

    def probe() -> dict[str, float]:
        with grpc.insecure_channel(etcd.nodes[0].endpoint) as channel:
            status = etcd_rpc_pb2_grpc.MaintenanceStub(channel).Status(etcd_rpc_pb2.StatusRequest(), timeout=10)
        return {"etcd_writes": float(status.header.revision), "etcd_cpu_pct": 100 * cpu_seconds(pid)}

    return probe


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dq-bench-directory-") as tmp:
        base = Path(tmp)
        flags: tuple[str, ...] = ("--heartbeat-seconds", str(HEARTBEAT_SECONDS), "--lease-seconds", str(LEASE_SECONDS))
        source = Path(DIRECTORY_SOURCE).resolve()
        prefix = ("env", "PYTHONPATH=" + os.pathsep.join(str(source / d) for d in ("protos", "client", "server")))
        etcd = EtcdCluster(base / "etcd", members=1).start() if STORE == "etcd" else None
        if etcd is not None:
            flags = (*flags, "--store", etcd.store_url)
        directory = DirectoryProcess(
            base / "directory", flags, dataset_roots=(base,), prefix=prefix if DIRECTORY_SOURCE else ()
        ).start()
        try:
            pid = directory.process.pid  # type: ignore[union-attr]
            progress(f"idle directory, {WINDOW_SECONDS:.0f} s")
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            time.sleep(WINDOW_SECONDS)
            idle_pct = 100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)
            loaded = load(
                pid,
                directory.address,
                base,
                "directory",
                _heartbeats_counted(directory),
                _etcd_probe(etcd) if etcd else None,
            )
        finally:
            directory.stop()
            if etcd is not None:
                etcd.stop()

        ready = base / "bare-ready.json"
        bare = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--bare-server", str(ready)], stdin=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if bare.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the bare gRPC server did not start")
                time.sleep(0.05)
            floor = load(bare.pid, f"127.0.0.1:{json.loads(ready.read_text())['port']}", base, "bare", None)
        finally:
            bare.terminate()
            bare.wait(30)

    rows: list[dict[str, object]] = []
    for server, result in (("directory", loaded), ("bare grpc.aio", floor)):
        rows.append(
            {
                "server": server,
                "nodes": NODES,
                "heartbeat": HEARTBEAT,
                "heartbeat_s": HEARTBEAT_SECONDS,
                "lease_s": LEASE_SECONDS,
                "connections": CONNECTIONS,
                "keepalive": KEEPALIVE,
                "windows_s": f"{REPEATS} x {WINDOW_SECONDS:.0f}",
                "directory_source": DIRECTORY_SOURCE or None,
                "load_average": os.getloadavg(),
                "idle_cpu_pct": idle_pct if server == "directory" else None,
                **result,
                "vs_bare": result["cpu_pct"] / floor["cpu_pct"],  # type: ignore[operator]
                "target_pct": TARGET_PERCENT,
                "expected_per_s": NODES / HEARTBEAT_SECONDS,
            }
        )
    variant = "".join(
        f"-{key}{value}"
        for key, value, default in (
            ("nodes", NODES, 1024),
            ("hb", f"{HEARTBEAT_SECONDS:g}", "2"),
            ("", HEARTBEAT, "udp"),
            ("conn-", CONNECTIONS, "node"),
            ("keepalive", int(KEEPALIVE), 1),
            ("", "source" if DIRECTORY_SOURCE else "", ""),
            ("", STORE, "embedded"),
        )
        if value != default
    )
    report(
        f"directory_load{variant}",
        rows,
        [
            "server",
            "nodes",
            "heartbeat",
            "heartbeat_s",
            "idle_cpu_pct",
            "cpu_pct",
            "vs_bare",
            "target_pct",
            "cpu_ms_per_beat",
            "heartbeats_per_s",
            "directory_counted_per_s",
            "expected_per_s",
            "beats_by_rpc",
            "p50_ms",
            "p99_ms",
            "max_ms",
            "nodes_up_end",
            "node_changes",
            "errors",
            "generators_cpu_pct",
            "boot_s",
            "settled_s",
            "boot_cpu_s",
            "boot_list_nodes",
            "boot_full_lists",
            "boot_list_entries",
            *(["etcd_writes_per_s", "etcd_cpu_pct_per_s"] if STORE == "etcd" else []),
        ],
    )
    assert loaded["settled_s"] is not None, f"the boot did not settle within {MAX_WARMUP_SECONDS:.0f} s"
    assert loaded["nodes_up_end"] == NODES, f"only {loaded['nodes_up_end']} of {NODES} nodes are UP at the end"
    assert not loaded["node_changes"], "nodes went down or came back during the windows"
    assert not loaded["errors"], f"{loaded['errors']} calls to the directory failed during the windows"


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
