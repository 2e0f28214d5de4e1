"""A local etcd cluster in child processes, for the directory's etcd store:
``cluster up --store etcd``, the tests and the benchmark.

Members listen on loopback on ports the OS picked (bound, released, then
handed to etcd: another process could take one in between, so a member that
cannot bind fails the start with its log). Raft runs fast (50 ms beats, a
500 ms election timeout), so that a killed member's place is taken within a
second, as a test needs; a production cluster keeps etcd's defaults.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from dataquay.protos import etcd_rpc_pb2 as epb
from dataquay.protos import etcd_rpc_pb2_grpc as egrpc
from dataquay.server.errors import StartupError

#: The binary the Debian package etcd-server installs.
ETCD = "etcd"
HOST = "127.0.0.1"


def etcd_binary() -> str | None:
    """The etcd binary's path, or None where it is not installed."""
    return shutil.which(ETCD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdMember:
    name: str
    home: Path
    client_port: int
    peer_port: int
    process: subprocess.Popen[bytes] | None = None
    args: list[str] = field(default_factory=list)
    start_new_session: bool = False

    @property
    def data_dir(self) -> Path:
        """Its data; on its command line only, so it marks the process (:class:`~.pids.ClusterPid`)."""
        return self.home / "data"

    def launch(self) -> None:
        """Starts the member (again: a member with data keeps its cluster and ignores the initial flags)."""
        with open(self.home / "etcd.log", "ab") as log:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=self.start_new_session,
            )

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.home / "etcd.log").read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class EtcdCluster:
    """``members`` etcd members rooted at ``home``; :meth:`start` waits until all serve."""

    home: Path
    members: int = 3
    #: Let the members outlive this process (``cluster up``).
    start_new_session: bool = False
    nodes: list[EtcdMember] = field(default_factory=list)

    @property
    def store_url(self) -> str:
        """What the directory's --store takes."""
        return "etcd://" + ",".join(m.endpoint for m in self.nodes)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        binary = etcd_binary()
        if binary is None:
            raise StartupError("no etcd binary: install the etcd-server package (make tools)")
        # A fresh cluster each start: members keep their peers' URLs in their data, and the ports are new.
        shutil.rmtree(self.home, ignore_errors=True)
        self.nodes = [
            EtcdMember(
                f"m{i}", self.home / f"m{i}", _free_port(), _free_port(), start_new_session=self.start_new_session
            )
            for i in range(self.members)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.nodes)
        token = f"dataquay-{time.time_ns()}"
        for member in self.nodes:
            member.home.mkdir(parents=True, exist_ok=True)
            client = f"http://{member.endpoint}"
            member.args = [
                binary,
                "--name",
                member.name,
                "--data-dir",
                str(member.data_dir),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                member.peer_url,
                "--initial-advertise-peer-urls",
                member.peer_url,
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                token,
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ]
            member.launch()
        deadline = time.monotonic() + timeout
        for member in self.nodes:
            self._wait_serving(member, deadline)
        return self

    def _wait_serving(self, member: EtcdMember, deadline: float) -> None:
        with grpc.insecure_channel(member.endpoint) as channel:
            stub = egrpc.MaintenanceStub(channel)
            while True:
                assert member.process is not None
                if member.process.poll() is not None:
                    self.stop()
                    raise StartupError(f"etcd member {member.name} exited: {member.log_tail()}")
                try:
                    if stub.Status(epb.StatusRequest(), timeout=1.0).leader:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise StartupError(f"etcd member {member.name} has no leader: {member.log_tail()}")
                time.sleep(0.05)

    def pids(self) -> list[tuple[int, str, subprocess.Popen[bytes]]]:
        """(pid, marker, process) of each member started."""
        return [(m.process.pid, str(m.data_dir), m.process) for m in self.nodes if m.process is not None]

    def kill(self, index: int) -> None:
        """SIGKILL one member: the crash case."""
        process = self.nodes[index].process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def restart(self, *indexes: int, timeout: float = 30.0) -> None:
        """Starts killed members again and waits until they serve (a quorum must be up)."""
        for index in indexes:
            self.nodes[index].launch()
        deadline = time.monotonic() + timeout
        for index in indexes:
            self._wait_serving(self.nodes[index], deadline)

    def stop(self) -> None:
        """Kills every member: their data is made afresh at each start, so nothing is lost."""
        for index in range(len(self.nodes)):
            self.kill(index)
