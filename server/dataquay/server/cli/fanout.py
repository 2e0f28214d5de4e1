"""Commands that talk to every node of a cluster at once: staging a job's
dataset on all its nodes, and the cluster's status.

The directory says which nodes exist and where; every node is then asked
directly and concurrently, so that one slow or dead node neither serialises
nor stops the others.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from dataquay.client.jobs import job_spec
from dataquay.client.status_codes import UNREACHABLE
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.common import CliError, directory_address, directory_stub, open_channel, print_table
from dataquay.server.sizes import format_bytes

#: Deadline of one node's Stats in `status`: a node slower than this shows as unreachable.
STATS_TIMEOUT_SECONDS = 3.0
#: How often `stage --job` prints a progress line when stderr is not a terminal.
LINE_SECONDS = 10.0
#: Job settings that `stage --job` passes to JoinJob only when given.
JOB_FLAGS = ("mode", "q", "seed", "nodes", "ranks_per_node", "partition", "batch_size")


@contextmanager
def _node_stub(address: str) -> Iterator[cache_pb2_grpc.CacheStub]:
    channel = open_channel(address)
    try:
        yield cache_pb2_grpc.CacheStub(channel)
    finally:
        channel.close()


def _rpc_reason(exc: grpc.RpcError) -> str:
    if exc.code() in UNREACHABLE:
        return "unreachable"
    return exc.details() or exc.code().name


# ------------------------------------------------------------------ stage


def _job_spec(args: argparse.Namespace) -> jpb.JobSpec:
    """The JobSpec of ``stage --job``: only the settings the user gave are set,
    so that joining an existing job never contradicts it by accident."""
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()] if args.nodes is not None else None
    try:
        return job_spec(
            args.job, args.name, mode=args.mode, q=args.q, seed=args.seed, nodes=nodes,
            ranks_per_node=args.ranks_per_node, partition=args.partition, batch_size=args.batch_size,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


@dataclass
class _NodeStaging:
    """One node's part of a cluster-wide staging run."""

    name: str
    address: str = ""
    last: pb.StageProgress | None = None
    error: str = ""
    ended: bool = False
    call: grpc.Call | None = field(default=None, repr=False)

    @property
    def failed(self) -> str:
        """Why this node failed, or empty."""
        if self.error:
            return self.error
        if self.last is None:
            return "ended without a report"
        if self.last.error:
            return self.last.error
        if self.last.failed_samples:
            return f"{self.last.failed_samples} samples unreadable, the first: {self.last.first_failure}"
        return ""


def _stage_on(node: _NodeStaging, request: pb.StageRequest, events: queue.Queue[tuple[_NodeStaging, bool]]) -> None:
    """Streams one node's progress into ``events`` until its staging ends; the
    last event is ``(node, True)``."""
    try:
        with _node_stub(node.address) as stub:
            stream = stub.Stage(request)
            node.call = stream
            for progress in stream:
                node.last = progress
                events.put((node, False))
    except grpc.RpcError as exc:
        node.error = node.error or _rpc_reason(exc)
    finally:
        node.ended = True
        events.put((node, True))


class _Progress:
    """On a terminal, one aggregate bar and a bar per node; elsewhere (batch
    job logs), an aggregate line every :data:`LINE_SECONDS` and a line per
    node as it finishes, never carriage returns."""

    def __init__(self, nodes: Sequence[_NodeStaging], desc: str, quiet: bool) -> None:
        self._desc = desc
        self._quiet = quiet
        self._tty = sys.stderr.isatty() and not quiet
        self._last_line = time.monotonic()
        self.bars: dict[str, tqdm[Any]] = {}
        if self._tty:
            self.bars[""] = self._bar(desc, 0, leave=True)
            for i, n in enumerate(nodes):
                self.bars[n.name] = self._bar(f"  {n.name}", i + 1, leave=False)

    @staticmethod
    def _bar(desc: str, position: int, leave: bool) -> tqdm[Any]:
        return tqdm(
            desc=desc, total=0, position=position, leave=leave, unit="B", unit_scale=True, unit_divisor=1024,
            file=sys.stderr, mininterval=0.5,
        )

    def update(self, node: _NodeStaging, everyone: Sequence[_NodeStaging], ended: bool) -> None:
        if self._quiet:
            return
        reports = [n.last for n in everyone if n.last is not None]
        done, total = sum(r.done_bytes for r in reports), sum(r.total_bytes for r in reports)
        counts = (
            f"{sum(r.done_samples for r in reports)}/{sum(r.total_samples for r in reports)} samples, "
            f"{sum(n.ended for n in everyone)}/{len(everyone)} nodes done"
        )
        if not self._tty:
            if ended:
                print(f"  {node.name}: {_node_summary(node)}", file=sys.stderr, flush=True)
            elif time.monotonic() - self._last_line >= LINE_SECONDS:
                self._last_line = time.monotonic()
                print(f"{self._desc}: {format_bytes(done)} of {format_bytes(total)}, {counts}", file=sys.stderr, flush=True)
            return
        for bar, now, of in ((self.bars[""], done, total), (self.bars[node.name], *_bytes(node))):
            bar.total = of
            bar.update(now - bar.n)
        self.bars[""].set_postfix_str(counts)

    def close(self) -> None:
        for bar in reversed(self.bars.values()):
            bar.close()


def _bytes(node: _NodeStaging) -> tuple[int, int]:
    return (node.last.done_bytes, node.last.total_bytes) if node.last is not None else (0, 0)


def _node_summary(node: _NodeStaging) -> str:
    failed = node.failed
    if node.last is None:
        return f"failed: {failed}"
    p = node.last
    text = f"{p.done_samples}/{p.total_samples} samples, {format_bytes(p.read_bytes)} from the PFS in {p.elapsed_seconds:.1f} s"
    return f"{text}; failed: {failed}" if failed else text


def stage_job(args: argparse.Namespace) -> None:
    """``dataquay stage NAME --job ID``: join (or create) the job at the
    directory, then stage each node's share on every node of the job at once."""
    with directory_stub(args) as directory:
        job = directory.JoinJob(jpb.JoinJobRequest(spec=_job_spec(args)))
        listed = {n.info.name: n for n in directory.ListNodes(dpb.ListNodesRequest()).nodes}
    nodes = [_NodeStaging(name) for name in job.spec.nodes]
    if not nodes:
        raise CliError(f"job {args.job!r} has no nodes")
    for node in nodes:
        status = listed.get(node.name)
        if status is None:
            node.error = "not registered at the directory"
        elif status.state != jpb.NODE_UP:
            node.error = "down"
        else:
            node.address = status.info.tcp_address
    request = pb.StageRequest(dataset=args.name, job=args.job)
    events: queue.Queue[tuple[_NodeStaging, bool]] = queue.Queue()
    started = time.perf_counter()
    bars = _Progress(nodes, f"staging {args.name} on {len(nodes)} nodes", args.quiet)
    try:
        for node in nodes:
            if node.error:
                node.ended = True
                events.put((node, True))
            else:
                threading.Thread(target=_stage_on, args=(node, request, events), daemon=True).start()
        running = len(nodes)
        while running:
            node, ended = events.get()
            bars.update(node, nodes, ended)
            running -= ended
    finally:
        bars.close()
        for node in nodes:
            if node.call is not None and not node.ended:
                node.call.cancel()
    wall = time.perf_counter() - started
    _report_staging(args, job, nodes, wall)


def _report_staging(args: argparse.Namespace, job: jpb.Job, nodes: Sequence[_NodeStaging], wall: float) -> None:
    reports = [n.last for n in nodes if n.last is not None]
    rows = [
        (
            n.name,
            f"{n.last.done_samples}/{n.last.total_samples}" if n.last else "-",
            format_bytes(n.last.done_bytes) if n.last else "-",
            format_bytes(n.last.read_bytes) if n.last else "-",
            f"{n.last.elapsed_seconds:.1f}" if n.last else "-",
            f"failed: {n.failed}" if n.failed else ("ok, cache full" if n.last and n.last.cache_full else "ok"),
        )
        for n in nodes
    ]
    print_table(rows, ("NODE", "SAMPLES", "CACHED", "READ FROM PFS", "SECONDS", "STATUS"))
    read = sum(r.read_bytes for r in reports)
    print(
        f"staged {args.name!r} for job {job.spec.job_id!r} ({job.spec.mode}) on {len(nodes)} nodes in {wall:.1f} s: "
        f"{sum(r.done_samples for r in reports)}/{job.num_samples} samples cached, "
        f"{format_bytes(sum(r.done_bytes for r in reports))}; {format_bytes(read)} read from the PFS "
        f"({format_bytes(read / wall if wall else 0.0)}/s)"
    )
    failed = [n for n in nodes if n.failed]
    if failed:
        raise CliError(
            f"staging {args.name!r} failed on {len(failed)} of {len(nodes)} nodes: "
            + "; ".join(f"{n.name} ({n.failed})" for n in failed)
        )


# ----------------------------------------------------------------- status


def wants_cluster_status(args: argparse.Namespace) -> bool:
    """Cluster view with --directory, or with DATAQUAY_DIRECTORY unless --addr names one node."""
    if args.directory:
        return True
    return not args.addr and directory_address(args) is not None


def _stats(node: jpb.NodeStatus) -> pb.StatsReply | None:
    if node.state != jpb.NODE_UP:
        return None
    try:
        with _node_stub(node.info.tcp_address) as stub:
            reply: pb.StatsReply = stub.Stats(pb.StatsRequest(), timeout=STATS_TIMEOUT_SECONDS)
            return reply
    except grpc.RpcError:
        return None


@dataclass
class ClusterSnapshot:
    """What ``dataquay status`` shows of a cluster at one moment."""

    directory: str
    nodes: list[jpb.NodeStatus]
    jobs: list[jpb.Job]
    stats: dict[str, pb.StatsReply | None]
    taken: float = field(default_factory=time.monotonic)


def cluster_snapshot(args: argparse.Namespace) -> ClusterSnapshot:
    """The directory's nodes and jobs, and every live node's Stats, fetched in parallel."""
    with directory_stub(args) as directory:
        nodes = list(directory.ListNodes(dpb.ListNodesRequest()).nodes)
        jobs = list(directory.ListJobs(jpb.ListJobsRequest()).jobs)
    with ThreadPoolExecutor(max(len(nodes), 1)) as pool:
        stats = dict(zip((n.info.name for n in nodes), pool.map(_stats, nodes)))
    return ClusterSnapshot(directory_address(args) or "", nodes, jobs, stats)


def cluster_json(snapshot: ClusterSnapshot) -> dict[str, Any]:
    """The snapshot as one JSON document (``status --json``)."""
    def as_dict(message: Any) -> dict[str, Any]:
        return MessageToDict(message, preserving_proto_field_name=True)

    return {
        "directory": snapshot.directory,
        "nodes": [
            {**as_dict(n), "stats": as_dict(s) if (s := snapshot.stats[n.info.name]) is not None else None}
            for n in snapshot.nodes
        ],
        "jobs": [as_dict(j) for j in snapshot.jobs],
    }


def print_cluster(snapshot: ClusterSnapshot, before: ClusterSnapshot | None = None) -> None:
    """``dataquay status`` with a directory: nodes, jobs and exchanges; with the
    snapshot ``before`` (``--watch``), PFS throughput since then too."""
    up = sum(n.state == jpb.NODE_UP for n in snapshot.nodes)
    print(f"directory {snapshot.directory}: {len(snapshot.nodes)} nodes, {up} up; {len(snapshot.jobs)} jobs\n")
    columns = ["NODE", "STATE", "CACHE", "ENTRIES", "LOCAL", "PEER", "PFS", "HIT %", "PFS BYTES", "DATA WAIT"]
    rows = [list(_node_row(n, snapshot.stats[n.info.name])) for n in snapshot.nodes]
    if before is not None:
        columns.append("PFS MB/s")
        seconds = max(snapshot.taken - before.taken, 1e-9)
        for row, node in zip(rows, snapshot.nodes):
            now, then = snapshot.stats[node.info.name], before.stats.get(node.info.name)
            row.append(f"{(now.pfs_bytes - then.pfs_bytes) / seconds / 1e6:.1f}" if now and then else "-")
    print_table([tuple(r) for r in rows], tuple(columns))
    if snapshot.jobs:
        print()
        print_table([_job_row(j, snapshot.stats) for j in snapshot.jobs],
                    ("JOB", "DATASET", "MODE", "EPOCH", "NODES", "STAGED"))
    print_exchanges([(name, reply) for name, reply in snapshot.stats.items() if reply is not None])


def print_exchanges(stats: list[tuple[str, pb.StatsReply]]) -> None:
    """One row per node and job whose owners move: the sending side of its latest exchange."""
    rows = [exchange_row(name, x) for name, reply in stats for x in reply.exchanges]
    if rows:
        print()
        print_table(rows, ("NODE", "JOB", "INTO EPOCH", "SAMPLES", "BYTES", "RATE", "ETA", "STATE"))
    received = sum(reply.exchange_received_bytes for _, reply in stats)
    previous = sum(reply.previous_owner_samples for _, reply in stats)
    if rows or received or previous:
        print(f"exchange received {format_bytes(received)}; "
              f"{previous} samples read from their previous owner (exchange not done yet)")


def exchange_row(node: str, x: pb.ExchangeProgress) -> tuple[object, ...]:
    rate = x.sent_bytes / x.elapsed_seconds if x.elapsed_seconds > 0 else 0.0
    left = x.total_bytes - x.delivered_bytes
    if x.finished:
        eta, state = "-", "done" if not x.error else f"done; {x.error}"
    else:
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        state = "running" if not x.error else f"retrying; {x.error}"
    unsent = x.unavailable_samples + x.refused_samples
    samples = f"{x.delivered_samples}/{x.total_samples}" + (f" ({unsent} not sent)" if unsent else "")
    return (
        node, x.job, x.epoch, samples,
        f"{format_bytes(x.delivered_bytes)}/{format_bytes(x.total_bytes)}", f"{format_bytes(rate)}/s", eta, state,
    )


def _node_row(node: jpb.NodeStatus, stats: pb.StatsReply | None) -> tuple[object, ...]:
    name = node.info.name
    if stats is None:
        state = "down" if node.state != jpb.NODE_UP else "unreachable"
        return (name, state, "-", "-", "-", "-", "-", "-", "-", "-")
    reads = {t.tier: t.samples for t in stats.reads}
    # Trainers serve their local hits in-process and report them to the daemon.
    in_process = {r.tier: r.samples for r in stats.client_reads}.get("local", 0)
    local, peer, pfs = reads.get(pb.TIER_LOCAL, 0) + in_process, reads.get(pb.TIER_PEER, 0), reads.get(pb.TIER_PFS, 0)
    hit = f"{100 * local / (local + peer + pfs):.1f}" if local + peer + pfs else "-"
    cache = f"{format_bytes(stats.cache_used_bytes)} / {format_bytes(stats.cache_capacity_bytes)}"
    return (
        name, "up", cache + (" (full)" if stats.cache_full else ""), stats.cache_entries, local, peer, pfs, hit,
        format_bytes(stats.pfs_bytes), f"{stats.client_data_wait_seconds:.1f}s",
    )


def _job_row(job: jpb.Job, stats: dict[str, pb.StatsReply | None]) -> tuple[object, ...]:
    spec = job.spec
    mode = f"{spec.mode} q={spec.q:g}" if spec.mode == "partial" else spec.mode
    done = 0
    reported = False
    missing = [name for name in spec.nodes if stats.get(name) is None]
    for name in spec.nodes:
        reply = stats.get(name)
        for progress in reply.staging if reply is not None else ():
            if progress.dataset == spec.dataset:
                done += progress.done_samples
                reported = True
    staged = f"{min(100.0, 100 * done / max(job.num_samples, 1)):.0f}%" if reported else "-"
    if missing:
        staged += f" ({len(missing)} nodes unreachable)"
    return (spec.job_id, spec.dataset, mode, job.epoch, len(spec.nodes), staged)
