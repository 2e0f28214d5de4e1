"""``dataquay cluster up|down``: a whole cluster on this machine, over loopback."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from dataquay.server.cli.common import CliError, print_table

DEFAULT_BASE_DIR = Path("dataquay-cluster")


def cmd_up(args: argparse.Namespace) -> None:
    from dataquay.server.auth import new_token_file
    from dataquay.server.tools.etcd_cluster import etcd_binary
    from dataquay.server.tools.local_cluster import LocalCluster, node_name

    base = Path(args.base_dir).absolute()
    existing = LocalCluster.load(base)
    if existing is not None:
        if existing.running():
            raise CliError(
                f"a cluster is already running in {base} (directory {existing.directory_address}); "
                f"stop it with `dataquay cluster down --base-dir {base}` or pick another --base-dir"
            )
        existing.down()
    daemon_args: list[str] = []
    for flag in ("cache_size", "pfs_bandwidth", "pfs_threads"):
        value = getattr(args, flag)
        if value is not None:
            daemon_args += ["--" + flag.replace("_", "-"), value]
    directory_args: list[str] = []
    for flag in ("lease_seconds", "heartbeat_seconds"):
        value = getattr(args, flag)
        if value is not None:
            directory_args += ["--" + flag.replace("_", "-"), value]
    if args.directories > 1 and args.store != "etcd":
        raise CliError(f"--directories {args.directories} needs --store etcd: replicas share their state there")
    if args.store == "etcd" and etcd_binary() is None:
        raise CliError("--store etcd needs the etcd binary (the etcd-server package); none on PATH")
    what = f"{args.directories} directories on a local etcd" if args.store == "etcd" else "a directory"
    print(f"starting {what} and {args.nodes} daemons in {base} ...", file=sys.stderr, flush=True)
    # A cluster of its own tokens: other users' processes on this machine cannot
    # talk to it, and its trainers (cluster.env names only the cluster token)
    # cannot write into its caches or register nodes.
    token = new_token_file(base / "token", force=True)
    node_token = new_token_file(base / "node-token", force=True)
    roots = tuple(Path(root).absolute() for root in args.dataset_roots.split(os.pathsep) if root)
    cluster = LocalCluster(
        base,
        args.nodes,
        tuple(daemon_args),
        tuple(directory_args),
        detached=True,
        token_file=token,
        node_token_file=node_token,
        dataset_roots=roots,
        directories=args.directories,
        store=args.store,
    )
    cluster.start(timeout=args.timeout)
    assert cluster.directory is not None and cluster.directory.ready is not None
    rows: list[tuple[object, ...]] = [
        (
            "directory" if i == 0 else f"directory-{i}",
            r.ready["pid"] if r.ready else "",
            r.address,
            f"{r.http_url}/sd",
            r.home,
        )
        for i, r in enumerate(cluster.replicas)
    ]
    if cluster.etcd is not None:
        rows += [
            (f"etcd {m.name}", pid, m.endpoint, "", m.home)
            for m, (pid, _, _) in zip(cluster.etcd.nodes, cluster.etcd.pids(), strict=True)
        ]
    for i, daemon in enumerate(cluster.daemons):
        assert daemon.ready is not None
        rows.append((node_name(i), daemon.ready["pid"], daemon.ready["tcp"], daemon.metrics_url, daemon.home))
    print(f"cluster of {args.nodes} nodes up in {base}\n")
    print_table(rows, ("PROCESS", "PID", "ADDRESS", "HTTP", "HOME (log, cache, state)"))
    quoted = shlex.quote(str(base))
    print(
        f"\nuse node 0 from a shell (set -a exports what the files set):\n"
        f"  set -a; source {shlex.quote(str(cluster.env_path()))}; "
        f"source {shlex.quote(str(cluster.env_path(0)))}; set +a\n"
        f"  dataquay dataset add NAME ROOT && dataquay stage NAME --job JOB && dataquay status\n"
        f"  (ROOT under {os.pathsep.join(map(str, roots))}: pass --dataset-roots to allow others)\n"
        f"stop it:\n"
        f"  dataquay cluster down --base-dir {quoted}"
    )


def cmd_down(args: argparse.Namespace) -> None:
    from dataquay.server.tools.local_cluster import LocalCluster

    base = Path(args.base_dir).absolute()
    cluster = LocalCluster.load(base)
    if cluster is None:
        raise CliError(f"no cluster in {base} (no cluster.json there); pass the --base-dir of `cluster up`")
    running = cluster.running()
    cluster.down(timeout=args.timeout)
    if running:
        print(f"stopped the cluster in {base}: {len(running)} processes; caches and logs stay in {base}")
    else:
        print(f"the cluster in {base} was not running any more; removed its cluster.json and env files")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser("cluster", help="a directory and N daemons on this machine, over loopback")
    csub = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")

    up = csub.add_parser("up", help="start a local cluster; its processes outlive this command")
    up.add_argument("--nodes", type=int, default=4, help="daemons to start (default 4)")
    up.add_argument(
        "--directories",
        type=int,
        default=1,
        help="directory replicas to start (default 1; more than one needs --store etcd)",
    )
    up.add_argument(
        "--store",
        choices=("embedded", "etcd"),
        default="embedded",
        help="the directories' store: each its state file, or a local etcd they share (default embedded)",
    )
    up.add_argument("--cache-size", help="cache capacity of each daemon (e.g. 2G)")
    up.add_argument("--pfs-bandwidth", help="cap on each daemon's PFS reads (e.g. 200M)")
    up.add_argument("--pfs-threads", help="PFS reader threads of each daemon")
    up.add_argument("--lease-seconds", help="seconds without a heartbeat before the directory marks a node down")
    up.add_argument("--heartbeat-seconds", help="how often daemons renew their lease")
    up.add_argument(
        "--dataset-roots",
        default=".",
        help="directories, separated by ':', that datasets may be registered from (default: the current directory)",
    )
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every node to come up")
    up.set_defaults(func=cmd_up)

    down = csub.add_parser("down", help="stop a local cluster (SIGTERM, then SIGKILL)")
    down.add_argument("--timeout", type=float, default=30.0, help="seconds to wait before SIGKILL")
    down.set_defaults(func=cmd_down)

    for p in (up, down):
        p.add_argument(
            "--base-dir",
            default=str(DEFAULT_BASE_DIR),
            help=f"the cluster's directory: node homes, env files, cluster.json (default ./{DEFAULT_BASE_DIR})",
        )
