"""The processes of a local cluster found again by pid, possibly from another
process than the one that started them (``dataquay cluster down`` in a later
shell), and stopped: SIGTERM, a grace period, SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: How often a wait for processes to exit looks again.
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class ClusterPid:
    """A process of the cluster, found again by pid (possibly from another process).

    ``marker`` is an argument only this process has on its command line (its
    ready file): a pid that the OS gave to some other program since is never
    signalled.
    """

    pid: int
    marker: str
    popen: subprocess.Popen[bytes] | None = None

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _pid_running(self.pid, self.marker)

    def send(self, sig: int) -> None:
        if self.running():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def stat_state(stat: Path) -> str:
    """The state letter (R, S, T, Z, ...) in a ``/proc/<pid>/stat`` or
    ``/proc/<pid>/task/<tid>/stat`` file: the field after the command name,
    which is in parentheses and may hold spaces and parentheses itself.

    Raises:
        OSError: the process or thread is gone (or ``/proc`` is not Linux's).
    """
    return stat.read_text().rpartition(")")[2].split()[0]


def _pid_running(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line holds ``marker``."""
    proc = Path("/proc") / str(pid)
    if Path("/proc/self").exists():
        try:
            state = stat_state(proc / "stat")
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X") and marker.encode() in cmdline
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's: not ours either way
        return False
    return True


def terminate(pids: list[ClusterPid], timeout: float) -> None:
    """SIGTERM all, wait up to ``timeout`` for them to exit, SIGKILL the rest."""
    for p in pids:
        p.send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.running() for p in pids) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    for p in pids:
        p.send(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(p.running() for p in pids) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
