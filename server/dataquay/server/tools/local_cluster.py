"""A whole dataquay cluster on one machine: a directory and N daemons on loopback.

With ``store="etcd"`` it also runs a local etcd (:mod:`.etcd_cluster`) and
``directories`` directory replicas on it; daemons and clients are given
every replica's address.

The demo, the tests and the benchmarks need several nodes without a batch
system; ``dataquay cluster up`` gives a user the same to try jobs by hand.
Every process binds ports the OS picks, and each node keeps its cache, state,
socket, ready file and log under ``base_dir/node-<i>/``, so that clusters in
different directories never collide.

What a process of the cluster needs to know is written as environment files a
shell can source (``cluster.env``, ``node-<i>.env``); where the processes are
is written to ``cluster.json``, so that ``dataquay cluster down`` in a later
shell, or :meth:`LocalCluster.load` in another process, can stop them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import grpc

from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.security import Credentials
from dataquay.client.wire.status_codes import UNREACHABLE
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import new_token_file
from dataquay.server.errors import DataquayError
from dataquay.server.tools.env_files import write_env_file
from dataquay.server.tools.etcd_cluster import EtcdCluster
from dataquay.server.tools.pids import POLL_SECONDS, ClusterPid, terminate
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess, ServerProcess

CLUSTER_FILE = "cluster.json"
CLUSTER_ENV = "cluster.env"
#: Longest unix socket path we place under base_dir (the limit is 107 bytes).
_MAX_SOCKET_PATH = 100


class ClusterError(DataquayError):
    """A local cluster that cannot be started, found or stopped as asked."""


def node_name(index: int) -> str:
    """The name of node ``index`` in a local cluster."""
    return f"node-{index}"


class NodeHost(NamedTuple):
    """Where a daemon of a local cluster runs when not on the cluster's own
    address: in a network namespace, say, so that a test can cut its link."""

    #: The address it listens on and the other processes reach it by.
    address: str
    #: What its command line runs under (``ip netns exec NAME``); the ranks
    #: of the node run under it too.
    prefix: tuple[str, ...] = ()


class TlsFiles(NamedTuple):
    """PEM files of a cluster's mutual TLS: the CA, and a certificate and key it signed."""

    ca: Path
    cert: Path
    key: Path


@dataclass
class LocalCluster:
    """A directory and ``nodes`` daemons on one address (127.0.0.1 unless
    told otherwise), rooted at ``base_dir``.

    As a context manager it starts the cluster and stops every process on
    exit (tests, the demo, benchmarks). ``detached=True`` starts the
    processes in sessions of their own, so that they outlive the process
    that started them (``dataquay cluster up``); :meth:`load` finds them
    again and :meth:`down` stops them.

    Args:
        base_dir: where every node's files, the env files and cluster.json go.
        nodes: how many daemons.
        daemon_args: extra ``dataquay serve`` flags for every daemon
            (``--cache-size 1G``, ``--pfs-bandwidth 200M``).
        directory_args: extra ``dataquay directory`` flags
            (``--lease-seconds 2``).
        detached: let the processes outlive this one.
        token_file: the cluster token every process requires and presents
            (cluster.env names it for clients); None runs without one.
        node_token_file: the node token the daemons and the directory hold
            and no env file names; None with a token_file makes one,
            ``base_dir/node-token``.
        tls: CA, certificate and key (PEM files) for mutual TLS between every
            process of the cluster and its clients; None runs plaintext.
        host: the address every server listens on and is reached by.
        node_hosts: nodes (by index) that run elsewhere than ``host``.
        dataset_roots: the directories every server may register datasets
            from (--dataset-roots); empty leaves it to the environment.
        directories: how many directory processes (replicas; more than one
            needs ``store="etcd"``).
        store: "embedded" (each directory's state file) or "etcd" (a local
            etcd of ``etcd_members`` members, started first).
    """

    base_dir: Path
    nodes: int = 4
    daemon_args: tuple[str, ...] = ()
    directory_args: tuple[str, ...] = ()
    detached: bool = False
    token_file: Path | None = None
    node_token_file: Path | None = None
    tls: TlsFiles | None = None
    host: str = "127.0.0.1"
    node_hosts: Mapping[int, NodeHost] = field(default_factory=dict)
    dataset_roots: tuple[Path, ...] = ()
    directories: int = 1
    store: str = "embedded"
    etcd_members: int = 1
    directory: DirectoryProcess | None = field(default=None, init=False)
    #: Every directory replica; the first is :attr:`directory`.
    replicas: list[DirectoryProcess] = field(default_factory=list, init=False)
    etcd: EtcdCluster | None = field(default=None, init=False)
    daemons: list[DaemonProcess] = field(default_factory=list, init=False)
    #: Short directory for the sockets when base_dir is too deep for one.
    socket_dir: Path | None = field(default=None, init=False)
    _adopted: list[ClusterPid] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir).absolute()
        if self.nodes < 1:
            raise ClusterError(f"a cluster needs at least 1 node, not {self.nodes}")
        if self.store not in ("embedded", "etcd"):
            raise ClusterError(f"store {self.store!r}: expected embedded or etcd")
        if self.directories < 1 or (self.directories > 1 and self.store != "etcd"):
            raise ClusterError(f"{self.directories} directories: one, or several with the etcd store")

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Starts the directory, then every daemon, and waits until the
        directory lists all of them as up.

        Raises:
            StartupError: a process did not start.
            ClusterError: a node never came up at the directory.

        Either way, everything started so far is stopped again.
        """
        if self.directory is not None:
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self.token_file is not None and self.node_token_file is None:
            self.node_token_file = new_token_file(self.base_dir / "node-token", force=True)
        try:
            self._start_directories(timeout)
            self.daemons = [self._daemon(i) for i in range(self.nodes)]
            with ThreadPoolExecutor(self.nodes) as pool:
                failures = [f.exception() for f in [pool.submit(d.start, timeout) for d in self.daemons]]
            self._save()
            for exc in failures:
                if exc is not None:
                    raise exc
            self.wait_for_nodes(up=[node_name(i) for i in range(self.nodes)], timeout=timeout)
            self._write_env_files()
        except BaseException:
            self.down()
            raise
        return self

    def _start_directories(self, timeout: float) -> None:
        store: tuple[str, ...] = ()
        if self.store == "etcd":
            self.etcd = EtcdCluster(self.base_dir / "etcd", self.etcd_members, start_new_session=self.detached).start(
                timeout
            )
            store = ("--store", self.etcd.store_url)
        self.replicas = [
            DirectoryProcess(
                self.base_dir / ("directory" if i == 0 else f"directory-{i}"),
                (*self.directory_args, *store, *self._security_args),
                start_new_session=self.detached,
                host=self.host,
                dataset_roots=self.dataset_roots,
            )
            for i in range(self.directories)
        ]
        self.directory = self.replicas[0]
        with ThreadPoolExecutor(self.directories) as pool:
            for future in [pool.submit(r.start, timeout) for r in self.replicas]:
                future.result()

    def down(self, timeout: float = 30.0) -> None:
        """Stops every process of the cluster (SIGTERM, then SIGKILL after
        ``timeout``) and removes the files that point at them.

        Works on a cluster whose processes are partly or wholly gone already.
        Caches, state and logs stay, so a cluster started again in the same
        directory finds its caches full.
        """
        terminate(self._pids(), timeout)
        for daemon in self.daemons:
            if daemon.process is not None:
                daemon.process.wait()
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.wait()
        if self.etcd is not None:
            self.etcd.stop()
        for name in (CLUSTER_FILE, CLUSTER_ENV, *(f"{node_name(i)}.env" for i in range(self.nodes))):
            (self.base_dir / name).unlink(missing_ok=True)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.down()

    @classmethod
    def load(cls, base_dir: Path) -> LocalCluster | None:
        """The cluster that ``cluster.json`` under ``base_dir`` describes, or
        None when there is none. Its processes may be running or long gone:
        see :meth:`running`.

        Raises:
            ClusterError: cluster.json exists but cannot be read.
        """
        path = Path(base_dir).absolute() / CLUSTER_FILE
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ClusterError(f"cannot read {path}: {exc}") from None
        try:
            cluster = cls(
                Path(base_dir),
                len(record["daemons"]),
                tuple(record["daemon_args"]),
                tuple(record["directory_args"]),
                detached=True,
                token_file=Path(record["token_file"]) if record.get("token_file") else None,
                node_token_file=Path(record["node_token_file"]) if record.get("node_token_file") else None,
                tls=TlsFiles(*map(Path, record["tls"])) if record.get("tls") else None,
                host=record.get("host", "127.0.0.1"),
                node_hosts={int(i): NodeHost(a, tuple(p)) for i, (a, p) in record.get("node_hosts", {}).items()},
                dataset_roots=tuple(map(Path, record.get("dataset_roots", []))),
                directories=len(record.get("replicas", [record["directory"]])),
                store=record.get("store", "embedded"),
            )
            cluster.socket_dir = Path(record["socket_dir"]) if record["socket_dir"] else None
            for ready in record.get("replicas", [record["directory"]]):
                replica = DirectoryProcess(
                    Path(ready["ready_file"]).parent,
                    cluster.directory_args,
                    host=cluster.host,
                    dataset_roots=cluster.dataset_roots,
                )
                replica.ready = ready
                cluster.replicas.append(replica)
                cluster._adopted.append(ClusterPid(ready["pid"], ready["ready_file"]))
            cluster.directory = cluster.replicas[0]
            for pid, marker in record.get("etcd", []):
                cluster._adopted.append(ClusterPid(pid, marker))
            for i, ready in enumerate(record["daemons"]):
                daemon = cluster._daemon(i)
                daemon.ready = ready
                cluster.daemons.append(daemon)
                cluster._adopted.append(ClusterPid(ready["pid"], ready["ready_file"]))
        except (KeyError, TypeError) as exc:
            raise ClusterError(f"{path} is not a cluster record ({exc!r} missing or wrong)") from None
        return cluster

    def running(self) -> list[int]:
        """Pids of the cluster's processes that still run."""
        return [p.pid for p in self._pids() if p.running()]

    # ------------------------------------------------------------- nodes

    def kill_node(self, index: int) -> None:
        """SIGKILLs node ``index``'s daemon: the crash case."""
        self._kill(self.daemons[index])

    def restart_node(self, index: int, timeout: float = 30.0, extra_args: Sequence[str] = ()) -> DaemonProcess:
        """Starts node ``index``'s daemon again on its cache, socket and ports
        (after :meth:`kill_node`, or stops it first), as a rebooted node would
        come back; ``extra_args`` override the cluster's daemon_args for this
        start (``("--cache-size", "2M")``: a node unlike the others)."""
        old = self.daemons[index]
        self._stop(old, timeout)
        assert old.ready is not None
        port = old.ready["tcp"].rpartition(":")[2]
        bulk = ("--bulk-listen", f"{old.host}:{old.ready['bulk'].rpartition(':')[2]}") if old.ready.get("bulk") else ()
        daemon = self._daemon(
            index,
            "--listen",
            f"{old.host}:{port}",
            "--metrics-port",
            str(old.ready["metrics_port"]),
            *bulk,
            *extra_args,
        )
        self.daemons[index] = daemon
        daemon.start(timeout)
        self._save()
        return daemon

    def kill_directory(self, index: int = 0) -> None:
        """SIGKILLs the directory (replica ``index``): the crash case."""
        assert self.replicas, "cluster not started"
        self._kill(self.replicas[index])

    def restart_directory(self, timeout: float = 30.0, index: int = 0) -> DirectoryProcess:
        """Starts the directory (replica ``index``) again on its state and ports
        (after :meth:`kill_directory`, or stops it first), where the daemons look for it."""
        old = self.replicas[index] if self.replicas else None
        assert old is not None and old.ready is not None, "cluster not started"
        self._stop(old, timeout)
        port = str(old.ready["tcp"]).rpartition(":")[2]
        store = ("--store", self.etcd.store_url) if self.etcd is not None else ()
        self.replicas[index] = DirectoryProcess(
            old.home,
            (
                *self.directory_args,
                *store,
                *self._security_args,
                "--listen",
                f"{old.host}:{port}",
                "--http-port",
                str(old.ready["http_port"]),
            ),
            start_new_session=self.detached,
            host=old.host,
            dataset_roots=self.dataset_roots,
        ).start(timeout)
        self.directory = self.replicas[0]
        self._save()
        return self.replicas[index]

    def wait_for_nodes(
        self, *, up: Sequence[str] = (), down: Sequence[str] = (), timeout: float = 60.0
    ) -> list[jpb.NodeStatus]:
        """Waits until the directory lists every node of ``up`` as up and every
        node of ``down`` as down; returns its list.

        Raises:
            ClusterError: not so within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        states: dict[str, int] = {}
        with self.credentials().channel(self.live_directory().address, channel_options()) as channel:
            stub = directory_pb2_grpc.DirectoryStub(channel)
            while True:
                try:
                    nodes = list(stub.ListNodes(dpb.ListNodesRequest(), timeout=5.0).nodes)
                    states = {n.info.name: n.state for n in nodes}
                    if all(states.get(n) == jpb.NODE_UP for n in up) and all(
                        states.get(n) == jpb.NODE_DOWN for n in down
                    ):
                        return nodes
                except grpc.RpcError as exc:
                    if exc.code() not in UNREACHABLE:
                        raise
                if time.monotonic() > deadline:
                    shown = ", ".join(f"{n} {jpb.NodeState.Name(s)}" for n, s in sorted(states.items()))
                    raise ClusterError(
                        f"the directory at {self.directory_address} does not list "
                        f"{'up: ' + ', '.join(up) if up else ''}{' down: ' + ', '.join(down) if down else ''} "
                        f"after {timeout:.0f} s (it lists: {shown or 'nothing'}); "
                        f"node logs under {self.base_dir}: {self._log_tails()}"
                    )
                time.sleep(POLL_SECONDS * 2)

    # ------------------------------------------------------------- where

    @property
    def directory_address(self) -> str:
        """HOST:PORT of the directory's gRPC service; of every replica, separated by commas."""
        assert self.replicas, "cluster not started"
        return ",".join(replica.address for replica in self.replicas)

    def live_directory(self) -> DirectoryProcess:
        """The first replica not known to be dead."""
        for replica in self.replicas:
            if replica.process is None or replica.process.poll() is None:
                return replica
        raise ClusterError(f"every directory of the cluster in {self.base_dir} is gone")

    @property
    def sd_url(self) -> str:
        """Prometheus HTTP service discovery of the cluster's daemons."""
        assert self.directory is not None, "cluster not started"
        return f"{self.directory.http_url}/sd"

    def cluster_env(self) -> dict[str, str]:
        """What every process of the cluster needs (cluster.env)."""
        return {
            "DATAQUAY_DIRECTORY": self.directory_address,
            "DATAQUAY_SD_URL": self.sd_url,
            "DATAQUAY_CLUSTER_DIR": str(self.base_dir),
            "DATAQUAY_NODES": str(self.nodes),
            **({"DATAQUAY_TOKEN_FILE": str(self.token_file)} if self.token_file else {}),
            **(
                {
                    "DATAQUAY_TLS_CA": str(self.tls.ca),
                    "DATAQUAY_TLS_CERT": str(self.tls.cert),
                    "DATAQUAY_TLS_KEY": str(self.tls.key),
                }
                if self.tls
                else {}
            ),
        }

    def credentials(self) -> Credentials:
        """What a client of this cluster presents (the env files say the same)."""
        return self._credentials(self.token_file)

    def node_credentials(self) -> Credentials:
        """What the daemons of this cluster present to each other and to the directory."""
        return self._credentials(self.node_token_file)

    def _credentials(self, token_file: Path | None) -> Credentials:
        if self.tls is None:
            return Credentials.from_files(token_file)
        return Credentials.from_files(token_file, self.tls.ca, self.tls.cert, self.tls.key)

    def node_only_env(self, index: int) -> dict[str, str]:
        """What a process on node ``index`` needs on top of :meth:`cluster_env` (node-<i>.env)."""
        daemon = self.daemons[index]
        return {
            "DATAQUAY_ADDR": daemon.address,
            "DATAQUAY_METRICS_URL": daemon.metrics_url,
            "DATAQUAY_NODE_NAME": node_name(index),
            "DATAQUAY_DIRECTORY": self.directory_address,
        }

    def node_env(self, index: int) -> dict[str, str]:
        """Every variable a trainer on node ``index`` needs: cluster.env and node-<i>.env."""
        return {**self.cluster_env(), **self.node_only_env(index)}

    def rank_env(self, rank: int, ranks_per_node: int, job: str) -> dict[str, str]:
        """What a launcher (torchrun, srun) would give rank ``rank`` of ``job``
        with ``ranks_per_node`` ranks on each node, ranks filling nodes in order."""
        return {
            **self.node_env(rank // ranks_per_node),
            "DATAQUAY_JOB": job,
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks_per_node * self.nodes),
            "LOCAL_RANK": str(rank % ranks_per_node),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
        }

    def env_path(self, index: int | None = None) -> Path:
        """cluster.env, or node ``index``'s env file."""
        return self.base_dir / (CLUSTER_ENV if index is None else f"{node_name(index)}.env")

    # ---------------------------------------------------------- internals

    def _daemon(self, index: int, *more_args: str) -> DaemonProcess:
        home = self.base_dir / node_name(index)
        socket = home / "dataquay.sock"
        if len(str(socket)) > _MAX_SOCKET_PATH:
            if self.socket_dir is None:
                self.socket_dir = Path(tempfile.mkdtemp(prefix="dq-cluster-"))
            socket = self.socket_dir / f"{node_name(index)}.sock"
        elsewhere = self.node_hosts.get(index)
        return DaemonProcess(
            home,
            (
                "--directory",
                self.directory_address,
                "--node-name",
                node_name(index),
                *self.daemon_args,
                *self._security_args,
                *more_args,
            ),
            socket_path=socket,
            start_new_session=self.detached,
            host=elsewhere.address if elsewhere else self.host,
            prefix=elsewhere.prefix if elsewhere else (),
            dataset_roots=self.dataset_roots,
        )

    @property
    def _security_args(self) -> tuple[str, ...]:
        """The flags every server of the cluster gets for its tokens and TLS."""
        token = ("--token-file", str(self.token_file)) if self.token_file else ()
        if self.node_token_file:
            token = (*token, "--node-token-file", str(self.node_token_file))
        if self.tls is None:
            return token
        return (*token, "--tls-ca", str(self.tls.ca), "--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key))

    def _pids(self) -> list[ClusterPid]:
        """Every process of the cluster: the ones this object started, and
        the ones a loaded cluster.json names."""
        pids = list(self._adopted)
        for proc in [*self.replicas, *self.daemons]:
            if proc.process is not None:
                pids.append(ClusterPid(proc.process.pid, str(proc.ready_file), proc.process))
        if self.etcd is not None:
            pids += [ClusterPid(pid, marker, popen) for pid, marker, popen in self.etcd.pids()]
        return pids

    def _pid_of(self, server: ServerProcess) -> ClusterPid:
        marker = str(server.ready_file)
        for pid in self._pids():
            if pid.marker == marker:
                return pid
        raise ClusterError(f"{server.home} of the cluster in {self.base_dir} was never started")

    def _kill(self, server: ServerProcess) -> None:
        pid = self._pid_of(server)
        pid.send(signal.SIGKILL)
        terminate([pid], 5.0)

    def _stop(self, server: ServerProcess, timeout: float) -> None:
        """Stops ``server`` if it runs and forgets it, so it can be started afresh."""
        terminate([self._pid_of(server)], timeout)
        self._adopted = [p for p in self._adopted if p.marker != str(server.ready_file)]

    def _save(self) -> None:
        assert self.directory is not None and self.directory.ready is not None
        record: dict[str, Any] = {
            "nodes": self.nodes,
            "daemon_args": list(self.daemon_args),
            "directory_args": list(self.directory_args),
            "socket_dir": str(self.socket_dir) if self.socket_dir else "",
            "token_file": str(self.token_file) if self.token_file else "",
            "node_token_file": str(self.node_token_file) if self.node_token_file else "",
            "tls": [str(p) for p in self.tls] if self.tls else [],
            "host": self.host,
            "node_hosts": {str(i): [h.address, list(h.prefix)] for i, h in self.node_hosts.items()},
            "dataset_roots": [str(p) for p in self.dataset_roots],
            "directory": {**self.directory.ready, "ready_file": str(self.directory.ready_file)},
            "replicas": [{**(r.ready or {}), "ready_file": str(r.ready_file)} for r in self.replicas],
            "store": self.store,
            "etcd": [[pid, marker] for pid, marker, _ in self.etcd.pids()] if self.etcd else [],
            "daemons": [
                {**(d.ready or {"pid": d.process.pid if d.process else 0}), "ready_file": str(d.ready_file)}
                for d in self.daemons
            ],
        }
        tmp = self.base_dir / (CLUSTER_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, self.base_dir / CLUSTER_FILE)

    def _write_env_files(self) -> None:
        def how(path: Path) -> str:
            return f"\nsource with: set -a; . {shlex.quote(str(path))}; set +a"

        write_env_file(
            self.env_path(),
            self.cluster_env(),
            f"dataquay local cluster of {self.nodes} nodes in {self.base_dir}" + how(self.env_path()),
        )
        for i in range(self.nodes):
            write_env_file(
                self.env_path(i),
                self.node_only_env(i),
                f"{node_name(i)} of the dataquay local cluster in {self.base_dir}" + how(self.env_path(i)),
            )

    def _log_tails(self) -> str:
        return "; ".join(f"{node_name(i)}: {d.log_tail(2)}" for i, d in enumerate(self.daemons)) or "(none)"
