"""``dataquay slurm run -- CMD``: dataquay inside the user's own Slurm
allocation, with no root and no slurm.conf change.

The launcher runs in the batch step: it starts the job's directory on its own
node, one daemon per node through ``srun --ntasks-per-node=1 --overlap`` (as
the user), waits until every daemon has registered, runs CMD with the
variables the ranks need, and stops the servers when CMD ends, whatever its
exit. Server settings pass through as ``DATAQUAY_*`` variables, as for
``dataquay serve`` itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli.common import CliError, open_channel
from dataquay.server.tools.slurm_job import SlurmJobPlan, plan_job

#: Seconds a server may take to stop on SIGTERM before it is killed.
STOP_TIMEOUT = 30.0
#: Plan fields the node step reads from its environment.
PLAN_ENV = ("DATAQUAY_SLURM_RUN_DIR", "DATAQUAY_SLURM_DIRECTORY")


def _dataquay(*argv: str) -> list[str]:
    return [sys.executable, "-m", "dataquay.server.cli", *argv]


def _start_directory(plan: SlurmJobPlan) -> tuple[subprocess.Popen[bytes], str]:
    """The job's directory on this node, and the address the other nodes reach it at."""
    ready = plan.run_dir / "directory.ready.json"
    ready.unlink(missing_ok=True)
    with (plan.run_dir / "directory.log").open("ab") as log:
        process = subprocess.Popen(
            _dataquay(
                "directory",
                "--listen",
                f"{plan.bind_host}:0",
                "--state-dir",
                str(plan.run_dir / "directory"),
                "--ready-file",
                str(ready),
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    port = _ready_field(process, ready, "tcp", plan.run_dir / "directory.log").rpartition(":")[2]
    host = "127.0.0.1" if plan.bind_host == "127.0.0.1" else plan.host
    return process, f"{host}:{port}"


def _ready_field(process: subprocess.Popen[bytes], ready: Path, key: str, log: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise CliError(f"the job's directory did not start: {tail or 'no log'}")
        time.sleep(0.05)
    return str(json.loads(ready.read_text())[key])


def _start_daemons(plan: SlurmJobPlan, directory: str) -> subprocess.Popen[bytes]:
    """One ``dataquay slurm node`` per node, as one job step that shares the allocation's CPUs."""
    env = {
        **os.environ,
        "DATAQUAY_SLURM_RUN_DIR": str(plan.run_dir),
        "DATAQUAY_SLURM_DIRECTORY": directory,
        "DATAQUAY_SLURM_CACHE_DIR": str(plan.cache_dir),
        "DATAQUAY_SLURM_BIND_HOST": plan.bind_host,
    }
    with (plan.run_dir / "daemons.log").open("ab") as log:
        return subprocess.Popen(
            [
                "srun",
                "--overlap",
                f"--nodes={plan.nodes}",
                f"--ntasks={plan.nodes}",
                "--ntasks-per-node=1",
                "--kill-on-bad-exit=1",
                *_dataquay("slurm", "node"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _wait_for_nodes(plan: SlurmJobPlan, directory: str, step: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with open_channel(directory) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        while True:
            if step.poll() is not None:
                raise CliError(f"the daemons' step ended (exit {step.returncode}); see {plan.run_dir}/daemons.log")
            up = [n for n in stub.ListNodes(dpb.ListNodesRequest(), timeout=10).nodes if n.state == jpb.NODE_UP]
            if len(up) >= plan.nodes:
                return
            if time.monotonic() > deadline:
                raise CliError(
                    f"{len(up)} of {plan.nodes} daemons registered after {timeout:.0f} s; "
                    f"see {plan.run_dir}/daemons.log"
                )
            time.sleep(0.2)


def _stop_daemons(plan: SlurmJobPlan, step: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to the daemons themselves, through scancel: srun, signalled,
    kills its tasks, and a killed daemon leaves its socket behind."""
    step_file = plan.run_dir / "daemons.step"
    if step is not None and step.poll() is None and step_file.exists():
        subprocess.run(
            ["scancel", "--signal=TERM", f"{plan.job_id}.{step_file.read_text().strip()}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        try:
            step.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
    _stop(step)


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cmd_run(args: argparse.Namespace) -> None:
    command = [word for word in args.cmd if word != "--"] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise CliError("no command to run: dataquay slurm run [OPTIONS] -- CMD [ARGS...]")
    plan = plan_job(os.environ, scratch=args.scratch, cache_dir=args.cache_dir, bind_host=args.bind_host)
    plan.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory_process = daemons = None
    try:
        directory_process, directory = _start_directory(plan)
        daemons = _start_daemons(plan, directory)
        _wait_for_nodes(plan, directory, daemons, args.start_timeout)
        env = {
            **os.environ,
            "DATAQUAY_DIRECTORY": directory,
            "DATAQUAY_ADDR": str(plan.socket),
            "DATAQUAY_JOB": args.job or plan.job,
        }
        print(
            f"dataquay: {plan.nodes} daemon(s) up, directory {directory}, socket {plan.socket}",
            file=sys.stderr,
            flush=True,
        )
        code = subprocess.run(command, env=env).returncode
    finally:
        _stop_daemons(plan, daemons)
        _stop(directory_process)
    if code:
        raise SystemExit(code)


def cmd_node(args: argparse.Namespace) -> None:
    """One node's daemon, run by the launcher's srun step: makes the node-local folders, then is the daemon."""
    missing = [name for name in PLAN_ENV if not os.environ.get(name)]
    if missing:
        raise CliError(f"`dataquay slurm node` is started by `dataquay slurm run` (no {', '.join(missing)})")
    run_dir = Path(os.environ["DATAQUAY_SLURM_RUN_DIR"])
    cache_dir = Path(os.environ.get("DATAQUAY_SLURM_CACHE_DIR") or run_dir / "cache")
    for folder in (run_dir, cache_dir):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    # The launcher's node holds one task of the step: the launcher reads the step id there to stop it.
    (run_dir / "daemons.step").write_text(os.environ.get("SLURM_STEP_ID", ""))
    argv = _dataquay(
        "serve",
        "--socket",
        str(run_dir / "dataquay.sock"),
        "--cache-dir",
        str(cache_dir),
        "--state-dir",
        str(run_dir / "state"),
        "--directory",
        os.environ["DATAQUAY_SLURM_DIRECTORY"],
        "--listen",
        f"{os.environ.get('DATAQUAY_SLURM_BIND_HOST', '0.0.0.0')}:0",
        "--ready-file",
        str(run_dir / "daemon.ready.json"),
    )
    os.execv(argv[0], argv)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    slurm = sub.add_parser("slurm", help="run dataquay inside your own Slurm allocation (no root needed)")
    ssub = slurm.add_subparsers(dest="slurm_command", required=True, metavar="COMMAND")
    run = ssub.add_parser(
        "run",
        help="start a directory and a daemon per node, run CMD with DATAQUAY_ADDR/DATAQUAY_DIRECTORY set, "
        "stop them after",
    )
    run.add_argument("--scratch", help="node-local folder for sockets, state and cache [default $TMPDIR, else /tmp]")
    run.add_argument(
        "--cache-dir", help="the daemons' cache (node-local) [default SCRATCH/dataquay-UID/slurm-JOB/cache]"
    )
    run.add_argument("--bind-host", help="address the servers listen on [default 127.0.0.1 on one node, else 0.0.0.0]")
    run.add_argument("--job", help="dataquay job name handed to the ranks as DATAQUAY_JOB [default slurm-JOBID]")
    run.add_argument("--start-timeout", type=float, default=120.0, help="seconds for every daemon to register")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the training command, after --")
    run.set_defaults(func=cmd_run)
    node = ssub.add_parser("node", help="one node's daemon (started by `slurm run` through srun)")
    node.set_defaults(func=cmd_node)
