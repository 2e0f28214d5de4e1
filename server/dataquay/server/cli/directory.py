"""Commands of the cluster: serve the directory, list, inspect, drop and prune jobs."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterable

import grpc

from dataquay.client.placement import MODES, leaving_fraction
from dataquay.client.wire.status_codes import error_from_rpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.common import CliError, add_directory, directory_stub, print_table
from dataquay.server.config import ConfigFile, DirectoryConfig
from dataquay.server.errors import JobActiveError, UnknownJobError
from dataquay.server.sizes import QuantityError, format_duration, parse_duration


def cmd_directory(args: argparse.Namespace) -> None:
    from dataquay.server.directory.server import serve_directory
    from dataquay.server.logs import setup_logging
    from dataquay.server.loops import loop_factory

    config = DirectoryConfig.from_sources(vars(args), file=ConfigFile.find(args.config))
    setup_logging(config.log_level, config.log_format)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve_directory(config))


def cmd_job_ls(args: argparse.Namespace) -> None:
    with directory_stub(args) as stub:
        reply = stub.ListJobs(jpb.ListJobsRequest())
    now = time.time()
    rows = [
        (
            j.spec.job_id,
            j.spec.dataset,
            j.spec.mode,
            f"{j.spec.q:g}",
            j.spec.seed,
            len(j.spec.nodes),
            j.spec.ranks_per_node or "-",
            j.epoch,
            format_duration(now - j.last_active_unix),
        )
        for j in reply.jobs
    ]
    print_table(rows, ("JOB", "DATASET", "MODE", "Q", "SEED", "NODES", "RANKS/NODE", "EPOCH", "IDLE"))


def cmd_job_show(args: argparse.Namespace) -> None:
    with directory_stub(args) as stub:
        job = stub.GetJob(jpb.GetJobRequest(job_id=args.job_id))
    s = job.spec
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.created_unix))
    active = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.last_active_unix))
    idle = format_duration(time.time() - job.last_active_unix)
    for key, value in (
        ("job", s.job_id),
        ("dataset", s.dataset),
        ("manifest", job.manifest_id),
        ("samples", job.num_samples),
        ("mode", s.mode),
        ("q", _q_text(s)),
        ("seed", s.seed),
        ("drop last", "yes" if s.drop_last else "no (pad by repeating)"),
        ("partition", s.partition),
        ("coding", s.exchange_coding or "none"),
        ("ranks/node", s.ranks_per_node or "not known yet (set by the first join)"),
        ("epoch", job.epoch),
        ("created", created),
        ("last active", f"{active} (idle {idle}; joined or an epoch reported)"),
        ("nodes", f"{len(s.nodes)}, in node-rank order:"),
    ):
        print(f"{key:<12} {value}")
    absences = {a.node: a for a in job.absences}  # by from_epoch: a node's latest absence
    for index, node in enumerate(s.nodes):
        print(f"  {index:>5}  {node}{_absence_text(absences.get(node))}")


def _absence_text(absence: jpb.NodeAbsence | None) -> str:
    """When the node's share is held by the others, in a job whose owners move."""
    if absence is None:
        return ""
    if absence.until_epoch:
        last = absence.until_epoch - 1
        return f"  (absent epochs {absence.from_epoch}-{last}; holds its share again from {absence.until_epoch})"
    return f"  (absent from epoch {absence.from_epoch}: the others hold its share)"


def _q_text(spec: jpb.JobSpec) -> str:
    """q in both its readings when the mode uses it: drawn into the pool, and leaving each node."""
    if not MODES[spec.mode].owners_move:
        return f"{spec.q:g} (not used by mode {spec.mode})" if spec.q else "0"
    leaving = leaving_fraction(spec.q, max(1, len(spec.nodes)))
    return f"{spec.q:g} drawn ({leaving:.4g} leave each node, Nguyen et al.'s Q)"


def cmd_job_drop(args: argparse.Namespace) -> None:
    with directory_stub(args) as stub:
        stub.DropJob(jpb.DropJobRequest(job_id=args.job_id))
    print(f"dropped job {args.job_id!r}")


def idle_jobs(jobs: Iterable[jpb.Job], idle: float, now: float) -> list[tuple[jpb.Job, float]]:
    """The jobs idle for ``idle`` seconds or more at ``now``, each with its idle seconds."""
    return [(job, now - job.last_active_unix) for job in jobs if now - job.last_active_unix >= idle]


def cmd_job_prune(args: argparse.Namespace) -> None:
    """Drops (or with --dry-run lists) the jobs idle longer than --idle.

    Jobs are picked from a listing by this host's clock; each drop then asks
    the directory to drop the job only if it is still idle that long by its
    own clock, so a job that a rank joined since the listing is kept.
    """
    try:
        idle = parse_duration(args.idle)
    except QuantityError as exc:
        raise CliError(f"--idle: {exc}") from None
    if not idle > 0:
        raise CliError(f"--idle: {args.idle!r} would take every job; give a duration above 0, like 12h or 7d")
    dropped = 0
    with directory_stub(args) as stub:
        picked = idle_jobs(stub.ListJobs(jpb.ListJobsRequest()).jobs, idle, time.time())
        for job, seconds in picked:
            job_id = job.spec.job_id
            if args.dry_run:
                print(f"would drop job {job_id!r} (idle {format_duration(seconds)})")
                continue
            try:
                stub.DropJob(jpb.DropJobRequest(job_id=job_id, min_idle_seconds=idle))
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if not isinstance(error, JobActiveError | UnknownJobError):
                    raise
                print(f"kept: {error}" if isinstance(error, JobActiveError) else f"job {job_id!r} is gone already")
                continue
            dropped += 1
            print(f"dropped job {job_id!r} (idle {format_duration(seconds)})")
    if args.dry_run:
        print(f"{len(picked)} job(s) idle for {args.idle} or longer; none dropped (--dry-run)")
    else:
        print(f"dropped {dropped} job(s) idle for {args.idle} or longer")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    directory = sub.add_parser("directory", help="run the cluster's directory service")
    DirectoryConfig.add_arguments(directory)
    directory.set_defaults(func=cmd_directory)

    job = sub.add_parser("job", help="list, inspect, drop and prune the directory's job records")
    jsub = job.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = jsub.add_parser("ls", help="list jobs")
    ls.set_defaults(func=cmd_job_ls)
    show = jsub.add_parser("show", help="every setting of a job and its node list in rank order")
    show.add_argument("job_id", metavar="ID", help="a job id, as `job ls` lists them")
    show.set_defaults(func=cmd_job_show)
    drop = jsub.add_parser("drop", help="forget a job record (its daemons keep their caches)")
    drop.add_argument("job_id", metavar="ID", help="a job id, as `job ls` lists them")
    drop.set_defaults(func=cmd_job_drop)
    prune = jsub.add_parser("prune", help="drop the jobs idle (no join, no epoch reported) for DURATION or longer")
    prune.add_argument("--idle", required=True, metavar="DURATION", help="idle time, e.g. 12h, 7d, 90m")
    prune.add_argument("--dry-run", action="store_true", help="list the jobs that would be dropped, drop none")
    prune.set_defaults(func=cmd_job_prune)
    for p in (ls, show, drop, prune):
        add_directory(p)
