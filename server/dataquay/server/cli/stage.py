"""``dataquay stage NAME --job ID``: staging a job's dataset on every node of
the job at once.

The directory says which nodes the job runs on and where they are; every node
is then asked directly and concurrently, so that one slow or dead node neither
serialises nor stops the others.
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
from tqdm import tqdm

from dataquay.client.jobs import job_spec
from dataquay.client.status_codes import UNREACHABLE
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.common import CliError, directory_stub, node_stub, print_table
from dataquay.server.sizes import format_bytes

#: How often `stage --job` prints a progress line when stderr is not a terminal.
LINE_SECONDS = 10.0
#: Job settings that `stage --job` passes to JoinJob only when given.
JOB_FLAGS = ("mode", "q", "seed", "nodes", "ranks_per_node", "partition", "batch_size")


def _rpc_reason(exc: grpc.RpcError) -> str:
    if exc.code() in UNREACHABLE:
        return "unreachable"
    return exc.details() or exc.code().name


def _job_spec(args: argparse.Namespace) -> jpb.JobSpec:
    """The JobSpec of ``stage --job``: only the settings the user gave are set,
    so that joining an existing job never contradicts it by accident."""
    given = {flag: getattr(args, flag) for flag in JOB_FLAGS}
    if args.nodes is not None:
        given["nodes"] = [n.strip() for n in args.nodes.split(",") if n.strip()]
    try:
        return job_spec(args.job, args.name, **given)
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
