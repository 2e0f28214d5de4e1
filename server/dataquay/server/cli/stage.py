"""``dataquay stage NAME --job ID``: staging a job's dataset on every node of
the job at once.

The directory says which nodes the job runs on and where they are; every node
is then asked directly and concurrently, so that one slow or dead node neither
serialises nor stops the others. Before staging starts, each node's share is
set against its cache's capacity, and a node that cannot hold it is named with
the capacity that would (a warning: staging goes on), along with where what
does not fit is read from: caches with room, where they hold it (spill), or the PFS.

With ``--background`` it returns once every node's run has started: the runs
are the daemons', not this command's, and a job may read while they go on
(each sample is read from the PFS once, by the node that keeps it).
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tqdm import tqdm

from dataquay.client.errors import DataquayError
from dataquay.client.jobs import job_plan, job_spec
from dataquay.client.manifest import Manifest
from dataquay.client.placement import drawn_fraction
from dataquay.client.wire.status_codes import UNREACHABLE
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.capacity_advice import job_room
from dataquay.server.cli.common import CliError, directory_stub, node_stub, print_table
from dataquay.server.sizes import format_bytes

#: How often `stage --job` prints a progress line when stderr is not a terminal.
LINE_SECONDS = 10.0
#: A staging bar: bytes cached of the run's, and in the postfix the daemon's
#: own PFS rate. tqdm's rate would count the bytes found cached as if read in
#: the first report's few milliseconds (tens of GB/s for a small dataset).
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
#: Job settings that `stage --job` passes to JoinJob only when given.
JOB_FLAGS = ("mode", "q", "seed", "nodes", "ranks_per_node", "partition", "batch_size", "exchange_coding")


def pfs_rate(progress: pb.StageProgress) -> str:
    """The PFS rate of a staging run as its daemon measured it, e.g. "12.0 MiB/s"."""
    seconds = progress.elapsed_seconds
    return f"{format_bytes(progress.read_bytes / seconds if seconds else 0.0)}/s"


def bar_postfix(progress: pb.StageProgress) -> str:
    """What a staging bar says after its bytes: samples, and the PFS's rate."""
    return f"{progress.done_samples}/{progress.total_samples} samples, {pfs_rate(progress)} from the PFS"


def _rpc_reason(exc: grpc.RpcError) -> str:
    if exc.code() in UNREACHABLE:
        return "unreachable"
    return exc.details() or exc.code().name


def _node_names(args: argparse.Namespace) -> list[str] | None:
    """--nodes as a list of names, None when not given."""
    return None if args.nodes is None else [n.strip() for n in args.nodes.split(",") if n.strip()]


def _job_spec(args: argparse.Namespace) -> jpb.JobSpec:
    """The JobSpec of ``stage --job``: only the settings the user gave are set,
    so that joining an existing job never contradicts it by accident."""
    given = {flag: getattr(args, flag) for flag in JOB_FLAGS}
    given["nodes"] = _node_names(args)
    try:
        return job_spec(args.job, args.name, **given)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _drawn_q(directory: directory_pb2_grpc.DirectoryStub, args: argparse.Namespace) -> float:
    """--q-leaving as the q the job draws, over the job's node count: --nodes,
    else the existing job's nodes, else the live nodes a new job runs on."""
    names = _node_names(args)
    if names is None:
        try:
            names = list(directory.GetJob(jpb.GetJobRequest(job_id=args.job)).spec.nodes)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            listed = directory.ListNodes(dpb.ListNodesRequest()).nodes
            names = [n.info.name for n in listed if n.state == jpb.NODE_UP]
    if not names:
        raise CliError("--q-leaving needs the job's node count, and no node is up: start the daemons or pass --nodes")
    try:
        return drawn_fraction(args.q_leaving, len(names))
    except ValueError as exc:
        raise CliError(f"--q-leaving{str(exc).removeprefix('q_leaving')}") from None


def _capacity_warnings(
    directory: directory_pb2_grpc.DirectoryStub, job: jpb.Job, listed: dict[str, jpb.NodeStatus]
) -> list[str]:
    """Nodes whose cache cannot hold their share of ``job`` (with the exchange's
    headroom), and the capacity that would; a line saying why when that cannot
    be worked out. Nodes not up are left out: their share comes from the PFS."""
    try:
        data = b"".join(c.data for c in directory.GetManifest(pb.GetDatasetRequest(name=job.spec.dataset)))
        manifest = Manifest(data)
        plan = job_plan(job, manifest)
    except grpc.RpcError as exc:
        return [f"cannot check the caches' capacity: {_rpc_reason(exc)}"]
    except (DataquayError, ValueError) as exc:
        return [f"cannot check the caches' capacity: {exc}"]
    up = {name: s.info.cache_capacity for name, s in listed.items() if s.state == jpb.NODE_UP}
    capacities = [up.get(name) for name in job.spec.nodes]
    room = job_room(plan, manifest.sample_length.astype(np.int64), list(job.spec.nodes), capacities, spill=True)
    return room.warnings("--cache-size")


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
        with node_stub(node.address) as stub:
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
            desc=desc,
            total=0,
            position=position,
            leave=leave,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            mininterval=0.5,
            bar_format=BAR_FORMAT,
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
                line = f"{self._desc}: {format_bytes(done)} of {format_bytes(total)}, {counts}"
                print(line, file=sys.stderr, flush=True)
            return
        for bar, now, of in ((self.bars[""], done, total), (self.bars[node.name], *_bytes(node))):
            bar.total = of
            bar.update(now - bar.n)
        if node.last is not None:
            self.bars[node.name].set_postfix_str(bar_postfix(node.last), refresh=False)
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
    text = (
        f"{p.done_samples}/{p.total_samples} samples, "
        f"{format_bytes(p.read_bytes)} from the PFS in {p.elapsed_seconds:.1f} s"
    )
    return f"{text}; failed: {failed}" if failed else text


def _evicted(progress: pb.StageProgress) -> str:
    """What a node evicted to make room for its share: bytes and the datasets, or "-"."""
    if not progress.evictions:
        return "-"
    names = ",".join(",".join(e.datasets) or e.cache_db for e in progress.evictions)
    return f"{format_bytes(sum(e.bytes for e in progress.evictions))} ({names})"


def stage_job(args: argparse.Namespace) -> None:
    """``dataquay stage NAME --job ID``: join (or create) the job at the
    directory, then stage each node's share on every node of the job at once."""
    with directory_stub(args) as directory:
        if args.q_leaving is not None:
            args.q = _drawn_q(directory, args)
        job = directory.JoinJob(jpb.JoinJobRequest(spec=_job_spec(args)))
        listed = {n.info.name: n for n in directory.ListNodes(dpb.ListNodesRequest()).nodes}
        for line in _capacity_warnings(directory, job, listed):
            print(f"warning: {line}", file=sys.stderr, flush=True)
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
            if args.background and all(n.last is not None or n.ended for n in nodes):
                break  # every run started: they go on in the daemons
    finally:
        bars.close()
        for node in nodes:
            if node.call is not None and not node.ended:
                node.call.cancel()
    wall = time.perf_counter() - started
    if args.background:
        _report_started(args, job, nodes)
    else:
        _report_staging(args, job, nodes, wall)


def _report_started(args: argparse.Namespace, job: jpb.Job, nodes: Sequence[_NodeStaging]) -> None:
    """``--background``: what each node had cached when its run started; raises
    for the nodes whose run did not start or already failed."""
    failed = [n for n in nodes if n.failed and (n.last is None or n.last.finished)]
    started = [n for n in nodes if n not in failed]
    print(
        f"staging {args.name!r} for job {job.spec.job_id!r} ({job.spec.mode}) in the background on "
        f"{len(started)} nodes: {sum(n.last.done_samples for n in started if n.last)}/{job.num_samples} samples "
        "cached so far; the job's ranks may start reading now; `dataquay status` shows the progress"
    )
    if failed:
        raise CliError(
            f"staging {args.name!r} did not start on {len(failed)} of {len(nodes)} nodes: "
            + "; ".join(f"{n.name} ({n.failed})" for n in failed)
        )


def _report_staging(args: argparse.Namespace, job: jpb.Job, nodes: Sequence[_NodeStaging], wall: float) -> None:
    reports = [n.last for n in nodes if n.last is not None]
    rows = [
        (
            n.name,
            f"{n.last.done_samples}/{n.last.total_samples}" if n.last else "-",
            format_bytes(n.last.cached_bytes) if n.last else "-",
            format_bytes(n.last.read_bytes) if n.last else "-",
            f"{n.last.elapsed_seconds:.1f}" if n.last else "-",
            _evicted(n.last) if n.last else "-",
            n.last.held_for_others if n.last else "-",
            f"failed: {n.failed}" if n.failed else ("ok, cache full" if n.last and n.last.cache_full else "ok"),
        )
        for n in nodes
    ]
    print_table(rows, ("NODE", "SAMPLES", "CACHED", "READ FROM PFS", "SECONDS", "EVICTED", "FOR OTHERS", "STATUS"))
    read = sum(r.read_bytes for r in reports)
    print(
        f"staged {args.name!r} for job {job.spec.job_id!r} ({job.spec.mode}) on {len(nodes)} nodes in {wall:.1f} s: "
        f"{sum(r.done_samples for r in reports)}/{job.num_samples} samples cached, "
        f"{format_bytes(sum(r.cached_bytes for r in reports))}; {format_bytes(read)} read from the PFS "
        f"({format_bytes(read / wall if wall else 0.0)}/s over the nodes)"
    )
    spilled = sum(r.held_for_others for r in reports)
    if spilled:
        print(
            f"{spilled} samples of nodes whose caches are short are held by nodes with room (FOR OTHERS): "
            "their owners read them from there, not from the PFS"
        )
    failed = [n for n in nodes if n.failed]
    if failed:
        raise CliError(
            f"staging {args.name!r} failed on {len(failed)} of {len(nodes)} nodes: "
            + "; ".join(f"{n.name} ({n.failed})" for n in failed)
        )
