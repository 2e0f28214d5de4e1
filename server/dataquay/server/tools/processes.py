"""Starting daemons and directories as child processes: for the demo, local
clusters, the benchmarks and tests.

Each server gets its own directory (socket, cache, state, logs) and ports chosen
by the OS; the server reports what it bound in a ready file, which is how the
launcher knows it is serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Self

from dataquay.server.errors import StartupError

#: The ``dataquay`` command, as this interpreter runs it.
DATAQUAY_COMMAND = (sys.executable, "-m", "dataquay.server.cli")


def launch(args: list[str], log: BinaryIO, start_new_session: bool) -> subprocess.Popen[bytes]:
    """Runs a server's command line, its output into ``log``. A module
    function, so that a test harness may start servers its own way."""
    return subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=start_new_session
    )


@dataclass
class ServerProcess:
    """A dataquay server in a child process, rooted at ``home``: what the
    daemon and the directory launchers share. Subclasses name the server and
    its command line."""

    #: The server in messages and in its log file's name.
    kind: ClassVar[str] = "server"

    home: Path
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] | None = None
    #: Detach from this process's session, so that the server outlives it
    #: and a Ctrl-C in its terminal does not reach the server.
    start_new_session: bool = False
    #: The address it listens on and other processes reach it by: loopback,
    #: or an interface's address when the servers are spread over network
    #: namespaces.
    host: str = "127.0.0.1"
    #: What its command line runs under, e.g. ``ip netns exec NAME`` to put
    #: it in a network namespace of its own.
    prefix: tuple[str, ...] = ()
    #: Its --dataset-roots; empty passes none, leaving the environment's or
    #: the config file's, or refusing every registration.
    dataset_roots: tuple[Path, ...] = ()

    @property
    def log_path(self) -> Path:
        return self.home / f"{self.kind}.log"

    @property
    def ready_file(self) -> Path:
        return self.home / "ready.json"

    def command(self) -> list[str]:
        """The ``dataquay`` arguments that start the server, before ``extra_args``."""
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> Self:
        """Starts the server and waits until it serves; raises with its log if it cannot."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        roots = ("--dataset-roots", os.pathsep.join(map(str, self.dataset_roots))) if self.dataset_roots else ()
        args = [*self.prefix, *DATAQUAY_COMMAND, *self.command(), *roots, *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.process = launch(args, log, self.start_new_session)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise StartupError(f"{self.kind} in {self.home} exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise StartupError(f"{self.kind} in {self.home} not ready after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.02)
        self.ready = json.loads(self.ready_file.read_text())
        return self

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def signal(self, sig: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, sig)


@dataclass
class DaemonProcess(ServerProcess):
    """A daemon running in a child process, rooted at ``home``."""

    kind: ClassVar[str] = "daemon"

    #: Where the unix socket goes; default ``home/dataquay.sock``.
    socket_path: Path | None = None

    def __post_init__(self) -> None:
        socket = self.socket_path or self.home / "dataquay.sock"
        # Unix socket paths are limited to 107 bytes; deep temp dirs exceed it.
        if len(str(socket)) > 100:
            socket = Path(tempfile.mkdtemp(prefix="dq-")) / "dataquay.sock"
        self.socket = socket

    @property
    def address(self) -> str:
        """What DATAQUAY_ADDR should be for a client on this node."""
        return str(self.socket)

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @property
    def metrics_url(self) -> str:
        assert self.ready is not None
        return f"http://{self.host}:{self.ready['metrics_port']}/metrics"

    def command(self) -> list[str]:
        return [
            "serve",
            "--socket",
            str(self.socket),
            "--listen",
            f"{self.host}:0",
            "--cache-dir",
            str(self.cache_dir),
            "--state-dir",
            str(self.home / "state"),
            "--metrics-host",
            self.host,
            "--metrics-port",
            "0",
            "--ready-file",
            str(self.ready_file),
        ]


@dataclass
class DirectoryProcess(ServerProcess):
    """A directory running in a child process, rooted at ``home``."""

    kind: ClassVar[str] = "directory"

    @property
    def address(self) -> str:
        """The directory's HOST:PORT, for ``--directory``."""
        assert self.ready is not None, "directory not started"
        return f"{self.host}:{str(self.ready['tcp']).rpartition(':')[2]}"

    @property
    def http_url(self) -> str:
        """Base URL of /sd, /metrics and /healthz."""
        assert self.ready is not None, "directory not started"
        return f"http://{self.host}:{self.ready['http_port']}"

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    def command(self) -> list[str]:
        return [
            "directory",
            "--listen",
            f"{self.host}:0",
            "--http-host",
            self.host,
            "--http-port",
            "0",
            "--state-dir",
            str(self.state_dir),
            "--ready-file",
            str(self.ready_file),
        ]


def run_command(*argv: str) -> int:
    """Runs ``dataquay ARGV`` in a process of its own, as a user would type it,
    its output on this process's; returns its exit code.

    The tools sit on top of the CLI rather than import it: a command run here
    reads the same environment and prints the same lines as in a shell.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.run([*DATAQUAY_COMMAND, *argv]).returncode
