"""Warnings that the processes of one trainer give once between them.

A trainer's DataLoader workers each hold a client of their own, and new ones
start every epoch: a warning that each process gives once would come once per
worker per epoch. The workers share the trainer's process group, so a marker
file in /dev/shm named after the group says that one of them has told
already. Markers of other groups whose leader is gone are removed by the next
process that tells something (never its own group's: a trainer started in
the background by a shell that has since exited is a group without a leader).
"""

from __future__ import annotations

import hashlib
import os
import re
import time

from dataquay.client.wire.shm import SHM_DIR, process_alive

_PREFIX = "dataquay.told-"
_MARKER = re.compile(rf"^{re.escape(_PREFIX)}(\d{{1,10}})-[0-9a-f]{{16}}$")

#: A topic still current after this long is told again.
RETELL_SECONDS = 600.0


def _marker(topic: str) -> str:
    digest = hashlib.blake2b(topic.encode(), digest_size=8).hexdigest()
    return str(SHM_DIR / f"{_PREFIX}{os.getpgrp()}-{digest}")


def _remove_stale_markers() -> None:
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return
    own = os.getpgrp()
    for entry in entries:
        match = _MARKER.match(entry.name)
        try:
            group = int(match.group(1)) if match else own
            if group != own and not process_alive(group) and entry.stat().st_uid == os.getuid():
                os.unlink(entry.path)
        except OSError:
            pass


def first_to_tell(topic: str) -> bool:
    """Whether this process is the first of its process group to tell ``topic``
    (or the last telling is RETELL_SECONDS old). True wherever no marker can be
    kept: a warning too many beats one lost."""
    path = _marker(topic)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        _remove_stale_markers()
        return True
    except FileExistsError:
        pass
    except OSError:
        return True
    try:
        st = os.lstat(path)
        if st.st_uid == os.getuid() and time.time() - st.st_mtime < RETELL_SECONDS:
            return False
        os.utime(path)
    except OSError:
        pass
    return True


def no_longer(topic: str) -> None:
    """Forgets that ``topic`` was told: it no longer holds, and the next time
    it does, the first process to see it tells it again."""
    try:
        os.unlink(_marker(topic))
    except OSError:
        pass
