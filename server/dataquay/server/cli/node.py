"""Commands of one node: serve its daemon, manage datasets, stage, status, demo."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dataquay.client.job_settings import EXCHANGE_CODINGS
from dataquay.client.placement import MODES
from dataquay.client.wire.tiers import CLIENT_TIERS, SERVED_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.server.cli import cache, cluster_status
from dataquay.server.cli.common import CliError, add_addr, add_directory, add_q, daemon_stub, print_table
from dataquay.server.cli.plain_json import plain
from dataquay.server.cli.stage import BAR_FORMAT, JOB_FLAGS, bar_postfix, pfs_rate, stage_job
from dataquay.server.config import ConfigFile, DaemonConfig
from dataquay.server.proto_maps import FORMAT_FROM_PROTO, FORMAT_TO_PROTO
from dataquay.server.sizes import format_bytes


def cmd_serve(args: argparse.Namespace) -> None:
    from dataquay.client.malloc import tune_malloc
    from dataquay.server.logs import setup_logging
    from dataquay.server.loops import loop_factory, share_gil
    from dataquay.server.node.daemon import serve

    tune_malloc(arenas=1)  # before any thread starts: why one, in dataquay.client.malloc
    config = DaemonConfig.from_sources(vars(args), file=ConfigFile.find(args.config))
    setup_logging(config.log_level, config.log_format)
    share_gil()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(config))


def cmd_dataset_add(args: argparse.Namespace) -> None:
    fmt = FORMAT_TO_PROTO[args.format] if args.format else pb.FORMAT_UNSPECIFIED
    with daemon_stub(args) as stub:
        info = stub.AddDataset(
            pb.AddDatasetRequest(
                name=args.name,
                root=args.root,
                format=fmt,
                replace=args.replace,
                tar_member_samples=args.tar_member_samples,
            )
        )
    print(
        f"registered {info.name!r}: {info.num_samples} samples, {format_bytes(info.total_bytes)}, "
        f"format {FORMAT_FROM_PROTO[info.format]}, root {info.root}"
    )


def cmd_dataset_ls(args: argparse.Namespace) -> None:
    with daemon_stub(args) as stub:
        reply = stub.ListDatasets(pb.ListDatasetsRequest())
    rows = [
        (
            d.name,
            FORMAT_FROM_PROTO[d.format],
            d.num_samples,
            format_bytes(d.total_bytes),
            f"{100 * d.cached_samples / max(d.num_samples, 1):.0f}%",
            d.root,
        )
        for d in reply.datasets
    ]
    print_table(rows, ("NAME", "FORMAT", "SAMPLES", "SIZE", "CACHED", "ROOT"))


def cmd_dataset_show(args: argparse.Namespace) -> None:
    with daemon_stub(args) as stub:
        d = stub.GetDataset(pb.GetDatasetRequest(name=args.name))
    s = d.sample_size
    for key, value in (
        ("name", d.name),
        ("root", d.root),
        ("format", FORMAT_FROM_PROTO[d.format]),
        ("samples", d.num_samples),
        ("bytes", f"{d.total_bytes} ({format_bytes(d.total_bytes)}) on the PFS{_SPAN_NOTE.get(d.format, '')}"),
        ("sample size", f"min {s.min}  median {s.median}  mean {s.mean:.0f}  max {s.max}  on the PFS"),
        ("cached", _cached_text(d)),
        ("manifest", f"{d.manifest_id} ({format_bytes(d.manifest_bytes)})"),
        *([("record", f"dtype {d.record_dtype}  shape {tuple(d.record_shape)}")] if d.record_dtype else []),
    ):
        print(f"{key:<12} {value}")


#: What a sample's bytes on the PFS hold beyond what trainers read, by format.
_SPAN_NOTE = {pb.FORMAT_TAR: ", tar headers included"}


def _cached_text(d: pb.DatasetInfo) -> str:
    """The cached samples and their bytes as the cache holds them and trainers
    read them (``dataquay_client_read_bytes_total``'s unit): for tar, a
    sample's members without their tar headers."""
    text = f"{d.cached_samples} samples, {format_bytes(d.cached_bytes)}"
    if d.cached_samples:
        text += f" ({d.cached_bytes / d.cached_samples:,.0f} B a sample as trainers read it)"
    return text


def cmd_dataset_drop(args: argparse.Namespace) -> None:
    with daemon_stub(args) as stub:
        reply = stub.DropDataset(pb.DropDatasetRequest(name=args.name))
    print(f"dropped {args.name!r}: freed {reply.freed_samples} cached samples")


def _started_in_background(name: str, first: pb.StageProgress | None) -> None:
    """Says that a run started, or raises why it did not."""
    if first is None:
        raise CliError("staging ended without a report")
    if first.error:
        raise CliError(f"staging {name!r} failed: {first.error}")
    _print_admission(name, first)
    print(
        f"staging {name!r} in the background: {first.done_samples}/{first.total_samples} samples cached so far; "
        "reads may start now; `dataquay status` shows its progress"
    )


def cmd_stage(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    if args.job:
        stage_job(args)
        return
    given = [
        f"--{flag.replace('_', '-')}"
        for flag in (*JOB_FLAGS, "q_leaving", "directory")
        if flag != "seed" and getattr(args, flag) is not None
    ]
    if given:
        raise CliError(f"{', '.join(given)}: only with --job JOB (cluster staging)")
    last = None
    with daemon_stub(args) as stub:
        progress = stub.Stage(pb.StageRequest(dataset=args.name, seed=args.seed or 0))
        if args.background:
            _started_in_background(args.name, next(iter(progress), None))
            progress.cancel()  # the run is the daemon's: it goes on without this stream
            return
        bar = None
        for last in progress:
            if bar is None:
                _print_admission(args.name, last)
                bar = tqdm(
                    total=last.total_bytes,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=f"staging {args.name}",
                    disable=args.quiet,
                    file=sys.stderr,
                    mininterval=0.5 if sys.stderr.isatty() else 10,
                    bar_format=BAR_FORMAT,
                )
            bar.set_postfix_str(bar_postfix(last), refresh=False)
            bar.update(last.done_bytes - bar.n)
        if bar is not None:
            bar.close()
    if last is None:
        raise CliError("staging ended without a report")
    if last.error:
        raise CliError(f"staging {args.name!r} failed: {last.error}")
    print(
        f"staged {args.name!r}: {last.done_samples}/{last.total_samples} samples cached "
        f"({last.done_samples - last.skipped_samples} newly, {last.skipped_samples} already were), "
        f"{format_bytes(last.read_bytes)} read from the PFS in {last.elapsed_seconds:.1f} s "
        f"({pfs_rate(last)})" + ("; cache full, the rest will be read from the PFS" if last.cache_full else "")
    )
    if last.failed_samples:
        raise CliError(
            f"{last.failed_samples} samples of {args.name!r} could not be read from the PFS and were "
            f"skipped; the first: {last.first_failure}"
        )


def _print_admission(name: str, first: pb.StageProgress) -> None:
    """What the daemon said up front: what fits, and what it evicted to make room."""
    for line in cache.eviction_lines(list(first.evictions), dry_run=False):
        print(f"staging {name!r}: {line}", file=sys.stderr)
    if first.admission_fit_bytes < first.admission_need_bytes:
        print(
            f"staging {name!r}: {format_bytes(first.admission_fit_bytes)} of {format_bytes(first.admission_need_bytes)}"
            " fit in the cache; the rest will be read from the PFS",
            file=sys.stderr,
        )


def cmd_status(args: argparse.Namespace) -> None:
    cluster = cluster_status.wants_cluster_status(args)
    before: cluster_status.ClusterSnapshot | None = None
    while True:
        if cluster:
            snapshot = cluster_status.cluster_snapshot(args)
            shown: Callable[[], None] = functools.partial(cluster_status.print_cluster, snapshot, before)
            document: Callable[[], object] = functools.partial(cluster_status.cluster_json, snapshot)
            before = snapshot
        else:
            with daemon_stub(args) as stub:
                stats = stub.Stats(pb.StatsRequest())
                info = stub.Info(pb.InfoRequest())
            shown = functools.partial(_print_node_status, stats, info)
            document = functools.partial(plain, stats)
        if args.watch and sys.stdout.isatty():
            print("\x1b[2J\x1b[H", end="")
        if args.json:
            print(json.dumps(document(), indent=None if args.watch else 2), flush=True)
        else:
            shown()
        if not args.watch:
            return
        time.sleep(args.watch)


def _print_node_status(stats: pb.StatsReply, info: pb.InfoReply) -> None:
    reads = {SERVED_TIERS[t.tier]: t for t in stats.reads}
    total = sum(t.samples for t in stats.reads) or 1
    print(
        f"node {stats.node}: cache {format_bytes(stats.cache_used_bytes)} of "
        f"{format_bytes(stats.cache_capacity_bytes)}, {stats.cache_entries} entries"
        + (
            " (full: its file system has no space left)"
            if stats.cache_disk_full
            else " (full)"
            if stats.cache_full
            else ""
        )
    )
    # The ports are the OS's pick by default (one user's daemon beside another's): say which.
    print(f"listening on {info.tcp_address}, metrics http://{info.metrics_address}/metrics")
    print("reads this daemon served (to trainers' misses and to other daemons):")
    print_table(
        [(tier, t.samples, f"{100 * t.samples / total:.1f}%", format_bytes(t.bytes)) for tier, t in reads.items()],
        ("TIER", "SAMPLES", "SHARE", "BYTES"),
    )
    _print_trainer_reads(stats)
    print(
        f"pfs read {format_bytes(stats.pfs_bytes)}, {stats.pfs_errors} errors, "
        f"{stats.corrupt_repaired} corrupt values repaired"
    )
    for run in stats.staging:
        if run.held_for_others:
            print(
                f"staged {run.dataset!r}: {run.done_samples}/{run.total_samples} samples, {run.held_for_others} "
                "of them for nodes whose caches are short"
            )
    cluster_status.print_exchanges([(stats.node, stats)])
    cluster_status.print_healing([(stats.node, stats)])
    cluster_status.print_prep_groups([(stats.node, stats)])
    if stats.cache_holdings:
        print_table(cache.holding_rows(list(stats.cache_holdings), time.time()), cache.HOLDING_HEADER)
    if stats.cache_charges:
        print_table(cache.charge_rows(list(stats.cache_charges)), cache.CHARGE_HEADER)


def _print_trainer_reads(stats: pb.StatsReply) -> None:
    """What the trainers read, as their clients counted it: local hits and
    their own PFS reads never reach the daemon's served reads above, and are
    most of a cached job's reads. The same figures as ``client_reads`` in ``--json``
    and ``dataquay_client_reads_total``."""
    if not stats.client_reads:
        return
    reads = {r.tier: r for r in stats.client_reads}
    total = sum(r.samples for r in stats.client_reads) or 1
    order = [tier for tier in CLIENT_TIERS if tier in reads] + sorted(set(reads) - set(CLIENT_TIERS))
    print(f"trainers' reads ({stats.clients} clients open):")
    print_table(
        [
            (tier, reads[tier].samples, f"{100 * reads[tier].samples / total:.1f}%", format_bytes(reads[tier].bytes))
            for tier in order
        ],
        ("TIER", "SAMPLES", "SHARE", "BYTES"),
    )


def cmd_demo(args: argparse.Namespace) -> None:
    from dataquay.server.tools.demo import run_demo

    run_demo(samples=args.samples, epochs=args.epochs, out=args.out)


def _seed(text: str) -> int:
    """A shuffle seed as the API carries it: a whole number that fits 64 bits unsigned."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 1 << 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed from 0 to 2**64-1")
    return seed


def _interval(text: str) -> float:
    """Seconds between two refreshes of `status --watch`."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return seconds


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="run this node's daemon")
    DaemonConfig.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    dataset = sub.add_parser("dataset", help="register, list, inspect and drop datasets")
    dsub = dataset.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = dsub.add_parser("add", help="register a dataset that lives under ROOT")
    add.add_argument("name", help="the name trainers open it by")
    add.add_argument("root", help="the dataset's top directory on the PFS (inside the daemon's --dataset-roots)")
    add.add_argument("--format", choices=sorted(FORMAT_TO_PROTO), help="default: detected from the files")
    add.add_argument("--replace", action="store_true", help="replace a dataset of the same name")
    add.add_argument(
        "--tar-member-samples", action="store_true", help="tar: one sample per member instead of one per basename group"
    )
    add.set_defaults(func=cmd_dataset_add)
    ls = dsub.add_parser("ls", help="list datasets")
    ls.set_defaults(func=cmd_dataset_ls)
    show = dsub.add_parser("show", help="size, format and sample statistics of a dataset")
    show.add_argument("name", help="a registered dataset")
    show.set_defaults(func=cmd_dataset_show)
    drop = dsub.add_parser("drop", help="unregister a dataset and free its cache")
    drop.add_argument("name", help="a registered dataset")
    drop.set_defaults(func=cmd_dataset_drop)
    for p in (add, ls, show, drop):
        add_addr(p)

    stage = sub.add_parser(
        "stage", help="copy a dataset from the PFS into the cache; with --job, each node of the job its share"
    )
    stage.add_argument("name", help="a registered dataset")
    stage.add_argument("--seed", type=_seed, help="the job's shuffle seed (sets the staging order; default 0)")
    stage.add_argument("--quiet", action="store_true", help="no progress bar")
    stage.add_argument(
        "--background",
        action="store_true",
        help="return once staging has started (on every node of the job); it goes on in the daemons, "
        "and a job may read at once: what is not cached yet is read from the PFS once, by the node that keeps it",
    )
    cluster = stage.add_argument_group("cluster staging: create or join a job, stage on all its nodes")
    cluster.add_argument("--job", help="job id; stages on every node of the job at once")
    cluster.add_argument("--mode", choices=sorted(MODES), help="shuffle mode (default global)")
    add_q(cluster)
    cluster.add_argument("--nodes", help="comma-separated node names in job order (default: all live nodes)")
    cluster.add_argument("--ranks-per-node", type=int, help="ranks per node (default: set by the first rank)")
    cluster.add_argument("--partition", choices=("sample", "shard"), help="initial partition (default sample)")
    cluster.add_argument(
        "--batch-size", type=int, help="ids per rank per step; locality mode needs it to split global batches"
    )
    cluster.add_argument(
        "--exchange-coding",
        choices=EXCHANGE_CODINGS,
        help="the exchange's coded pass: XOR packets multicast to groups where caches overlap (default none; "
        "the daemons need --exchange-multicast)",
    )
    add_directory(stage)
    add_addr(stage)
    stage.set_defaults(func=cmd_stage)

    status = sub.add_parser("status", help="cache fill and reads by tier; with a directory, of every node and job")
    add_addr(status)
    add_directory(status)
    status.add_argument("--json", action="store_true", help="one JSON document (one per line with --watch)")
    status.add_argument(
        "--watch",
        type=_interval,
        nargs="?",
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="show it again every SECONDS (default 2) until interrupted; adds PFS throughput",
    )
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser(
        "demo",
        help="a 4-node cluster on this machine (a directory, 4 daemons, 8 training ranks), a synthetic "
        "dataset, a few epochs of global and partial shuffling, a report",
    )
    demo.add_argument("--samples", type=int, default=4000, help="samples in the synthetic dataset (default 4000)")
    demo.add_argument("--epochs", type=int, default=3, help="epochs to read (default 3)")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("dataquay-demo"),
        help="directory for demo.json and demo.png (default ./dataquay-demo)",
    )
    demo.set_defaults(func=cmd_demo)
