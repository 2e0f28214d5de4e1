"""``dataquay status`` of a cluster: the directory's nodes and jobs, and every
live node's Stats, asked of all nodes at once so that one slow or dead node
shows as unreachable without holding up the others.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from dataquay.client.wire.tiers import CACHE, LOCAL, PEER, PFS, SERVED_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.common import directory_address, directory_stub, node_stub, print_table
from dataquay.server.cli.plain_json import plain
from dataquay.server.sizes import format_bytes

#: Deadline of one node's Stats in `status`: a node slower than this shows as unreachable.
STATS_TIMEOUT_SECONDS = 3.0


def wants_cluster_status(args: argparse.Namespace) -> bool:
    """Cluster view with --directory, or with DATAQUAY_DIRECTORY unless --addr names one node."""
    if args.directory:
        return True
    return not args.addr and directory_address(args) is not None


def _stats(node: jpb.NodeStatus) -> pb.StatsReply | None:
    if node.state != jpb.NODE_UP:
        return None
    try:
        with node_stub(node.info.tcp_address) as stub:
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
    """The snapshot as one plain JSON document (``status --json``; its
    schema: docs/reference/status-json.md). A node that did not answer has
    ``"stats": null``."""
    return {
        "directory": snapshot.directory,
        "nodes": [
            {**plain(n), "stats": plain(s) if (s := snapshot.stats[n.info.name]) is not None else None}
            for n in snapshot.nodes
        ],
        "jobs": [plain(j) for j in snapshot.jobs],
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
        print_table(
            [_job_row(j, snapshot.stats) for j in snapshot.jobs], ("JOB", "DATASET", "MODE", "EPOCH", "NODES", "STAGED")
        )
    live = [(name, reply) for name, reply in snapshot.stats.items() if reply is not None]
    print_exchanges(live)
    print_prefetch(live)
    print_healing(live)
    print_prep_groups(live)


def print_exchanges(stats: list[tuple[str, pb.StatsReply]]) -> None:
    """One row per node and job whose owners move: the sending side of its latest exchange."""
    rows = [exchange_row(name, x) for name, reply in stats for x in reply.exchanges]
    if rows:
        print()
        print_table(rows, ("NODE", "JOB", "INTO EPOCH", "SAMPLES", "BYTES", "RATE", "ETA", "STATE"))
    received = sum(reply.exchange_received_bytes for _, reply in stats)
    previous = sum(reply.previous_owner_samples for _, reply in stats)
    if rows or received or previous:
        print(
            f"exchange received {format_bytes(received)}; "
            f"{previous} samples read from their owner in another epoch (exchange not done yet, or a spare copy)"
        )


def print_prefetch(stats: list[tuple[str, pb.StatsReply]]) -> None:
    """What the nodes read from the PFS ahead of their ranks, and how much of
    it they threw away unread: PFS bandwidth spent for nothing, 0 in a cache
    that holds its share."""
    read = sum(reply.prefetch.overflow_read_bytes for _, reply in stats)
    if read:
        wasted = sum(reply.prefetch.overflow_wasted_bytes for _, reply in stats)
        print(f"prefetched from the PFS {format_bytes(read)}; thrown away unread {format_bytes(wasted)}")


def print_healing(stats: list[tuple[str, pb.StatsReply]]) -> None:
    """One row per node that healed anything: the share of lost nodes it
    fetched, by source, what it has yet to fetch, and what it dropped once
    their node was back."""
    rows = [
        (
            name,
            h.lost_nodes,
            h.pending_samples,
            h.peer_samples,
            format_bytes(h.peer_bytes),
            h.pfs_samples,
            format_bytes(h.pfs_bytes),
            h.dropped_samples,
        )
        for name, reply in stats
        if (h := reply.healing).lost_nodes or h.pending_samples or h.peer_samples or h.pfs_samples or h.dropped_samples
    ]
    if rows:
        print()
        print_table(
            rows, ("NODE", "LOST NODES", "TO FETCH", "FROM PEERS", "PEER BYTES", "FROM PFS", "PFS BYTES", "DROPPED")
        )


def print_prep_groups(stats: list[tuple[str, pb.StatsReply]]) -> None:
    """One row per coordinated prep group: members, batches prepped this epoch,
    how far the slowest member lags the fastest, and the shared memory held."""
    rows = [
        (
            g.group,
            g.dataset,
            g.epoch,
            g.members,
            f"{g.batches_prepped}/{g.num_batches}",
            g.fastest_consumed - g.slowest_consumed,
            f"{format_bytes(g.staged_bytes)}/{format_bytes(g.memory_bytes)}",
            g.dropped_total,
            g.redealt_total,
            name,
        )
        for name, reply in stats
        for g in reply.prep_groups
    ]
    if rows:
        print()
        print_table(
            rows, ("GROUP", "DATASET", "EPOCH", "MEMBERS", "PREPPED", "LAG", "STAGED", "DROPPED", "REDEALT", "NODE")
        )


def exchange_row(node: str, x: pb.ExchangeProgress) -> tuple[object, ...]:
    rate = x.sent_bytes / x.elapsed_seconds if x.elapsed_seconds > 0 else 0.0
    left = x.total_bytes - x.delivered_bytes
    if x.failed:
        eta, state = "-", x.error
    elif x.finished:
        eta, state = "-", "done" if not x.error else f"done; {x.error}"
    else:
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        state = "running" if not x.error else f"retrying; {x.error}"
    if x.coded_note:
        state += f"; coded pass: {x.coded_note}"
    unsent = x.unavailable_samples + x.refused_samples
    samples = f"{x.delivered_samples}/{x.total_samples}" + (f" ({unsent} not sent)" if unsent else "")
    return (
        node,
        x.job,
        x.epoch,
        samples,
        f"{format_bytes(x.delivered_bytes)}/{format_bytes(x.total_bytes)}",
        f"{format_bytes(rate)}/s",
        eta,
        state,
    )


def _node_row(node: jpb.NodeStatus, stats: pb.StatsReply | None) -> tuple[object, ...]:
    name = node.info.name
    if stats is None:
        state = "down" if node.state != jpb.NODE_UP else "unreachable"
        return (name, state, "-", "-", "-", "-", "-", "-", "-", "-")
    reads = {SERVED_TIERS[t.tier]: t.samples for t in stats.reads if t.tier in SERVED_TIERS}
    # Trainers serve their local hits in-process and report them to the daemon.
    in_process = {r.tier: r.samples for r in stats.client_reads}.get(LOCAL, 0)
    local, peer, pfs = reads.get(CACHE, 0) + in_process, reads.get(PEER, 0), reads.get(PFS, 0)
    hit = f"{100 * local / (local + peer + pfs):.1f}" if local + peer + pfs else "-"
    cache = f"{format_bytes(stats.cache_used_bytes)} / {format_bytes(stats.cache_capacity_bytes)}"
    return (
        name,
        "up",
        cache + (" (full)" if stats.cache_full else ""),
        stats.cache_entries,
        local,
        peer,
        pfs,
        hit,
        format_bytes(stats.pfs_bytes),
        f"{stats.client_data_wait_seconds:.1f}s",
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
