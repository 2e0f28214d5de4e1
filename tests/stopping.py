"""Stopping a process (SIGSTOP) for a test, at a moment it holds no lock of
the node's LMDB cache.

The daemon and its trainers share one lock over LMDB's reader table. A
process stopped while it holds it leaves every process that then begins a
new reader waiting, and py-lmdb waits with the GIL held, where no timeout of
the test reaches it (docs/reliability.md). The tests that stop a daemon or a
trainer mean a hung node, not that rarer wedge: :func:`stopped` checks from
a process of its own that a new reader still begins, and where it does not,
lets the stopped process run on a moment and stops it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polling import wait_until

from dataquay.server.tools.pids import stat_state

#: Longer than a loaded machine takes to start Python and begin a reader.
PROBE_SECONDS = 10.0
TRIES = 10
_BEGIN_A_READER = (
    "import lmdb, sys; env = lmdb.open(sys.argv[1], readonly=True, lock=True); env.begin().abort(); env.close()"
)


@contextmanager
def stopped(pid: int, cache: Path) -> Iterator[None]:
    """Process ``pid`` stopped for the block, not holding the reader lock of
    the LMDB environment at ``cache``; continued (SIGCONT) after it."""
    try:
        for _ in range(TRIES):
            os.kill(pid, signal.SIGSTOP)
            wait_until(lambda: _all_threads_stopped(pid), f"process {pid} stopped")
            try:
                subprocess.run(
                    [sys.executable, "-c", _BEGIN_A_READER, str(cache)],
                    check=True,
                    timeout=PROBE_SECONDS,
                    capture_output=True,
                )
                break
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.05)
        else:
            raise AssertionError(f"process {pid} held the reader lock of {cache} at each of {TRIES} stops")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = stat_state(task / "stat")
        except FileNotFoundError:  # a thread that ended
            continue
        if state not in ("T", "t"):
            return False
    return True
