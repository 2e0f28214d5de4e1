"""What a process holds open, read from /proc: the daemon keeps a client's
shared-memory segment open while the client lives, and lets go after."""

from __future__ import annotations

import os
from pathlib import Path


def open_files(pid: int) -> list[str]:
    """The targets of ``pid``'s open descriptors (one closed meanwhile is skipped)."""
    fds = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in os.listdir(fds):
        try:
            targets.append(os.readlink(fds / fd))
        except FileNotFoundError:
            continue
    return targets
