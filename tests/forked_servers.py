"""Daemons and directories for the tests, forked from a server process that
has loaded dataquay once (multiprocessing's forkserver).

A server's start is mostly Python loading its modules (a third of a CPU
second), and the suite starts some 750 servers: forked, a directory and four
daemons are up in a fifth of a second, not in more than one. What runs is
the same: `dataquay.server.cli.main` with the server's command
line, environment and working directory, its output into its log, in a
process of its own that the test signals and waits for as it would a child.

Servers that run under a prefix (a network namespace, another user, a
stepped clock) or in a session of their own (a detached cluster, which
`dataquay cluster down` finds again by its command line) are still started
as programs, so the suite keeps going through the command line's own start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from typing import BinaryIO

from dataquay.server.tools import processes
from dataquay.server.tools.processes import DATAQUAY_COMMAND

#: How servers start as programs, kept before the fixture puts :func:`launch` in its place.
start_as_program = processes.launch
PRELOAD = ["dataquay.server.cli", "dataquay.server.node.daemon", "dataquay.server.directory.server"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _serve(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """A forked server: what `python -m dataquay.server.cli ARGV` would run."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((log, 1), (log, 2), (null, 0)):
        os.dup2(fd, target)
    os.close(log)
    os.close(null)
    sys.argv = [DATAQUAY_COMMAND[-1], *argv]
    from dataquay.server.cli import main

    sys.exit(main(argv))


class ForkedServer:
    """The part of `subprocess.Popen` the tests and local clusters use, for a forked server."""

    def __init__(self, args: list[str], process: multiprocessing.process.BaseProcess) -> None:
        self.args = args
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(args: list[str], log: BinaryIO, start_new_session: bool) -> subprocess.Popen[bytes] | ForkedServer:
    """`processes.launch`, forking the servers it can."""
    # A prefix (netns, setpriv, faketime) comes before the command.
    if start_new_session or tuple(args[: len(DATAQUAY_COMMAND)]) != DATAQUAY_COMMAND:
        return start_as_program(args, log, start_new_session)
    argv = args[len(DATAQUAY_COMMAND) :]
    # Daemonic: a server a failed test left running is ended when its worker exits.
    process = _context.Process(target=_serve, args=(argv, dict(os.environ), os.getcwd(), log.name), daemon=True)
    process.start()
    return ForkedServer(args, process)
