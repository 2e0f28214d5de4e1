"""Starting daemons as child processes: for the demo, the benchmarks and tests.

Each daemon gets its own directory (socket, cache, state, logs) and ports chosen
by the OS; the daemon reports what it bound in a ready file, which is how the
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
from typing import Any

from dataquay.server.errors import StartupError


@dataclass
class DaemonProcess:
    """A daemon running in a child process, rooted at ``home``."""

    home: Path
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        socket = self.home / "dataquay.sock"
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
    def log_path(self) -> Path:
        return self.home / "daemon.log"

    @property
    def metrics_url(self) -> str:
        assert self.ready is not None
        return f"http://127.0.0.1:{self.ready['metrics_port']}/metrics"

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        """Starts the daemon and waits until it serves; raises with its log if it cannot."""
        self.home.mkdir(parents=True, exist_ok=True)
        ready_file = self.home / "ready.json"
        ready_file.unlink(missing_ok=True)
        args = [
            sys.executable, "-m", "dataquay.server.cli", "serve",
            "--socket", str(self.socket),
            "--listen", "127.0.0.1:0",
            "--cache-dir", str(self.cache_dir),
            "--state-dir", str(self.home / "state"),
            "--metrics-host", "127.0.0.1",
            "--metrics-port", "0",
            "--ready-file", str(ready_file),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while not ready_file.exists():
            if self.process.poll() is not None:
                raise StartupError(f"daemon in {self.home} exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise StartupError(f"daemon in {self.home} not ready after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.02)
        self.ready = json.loads(ready_file.read_text())
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
