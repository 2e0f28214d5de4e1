"""The daemon's and the directory's own directories and files: created
owner/group-only whatever the umask, checked with a clear error.

Caches hold staged samples and state dirs the manifests of datasets that
other users of the node may have no right to read, so neither is left
open to others by a umask of 022.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from dataquay.server.errors import StartupError

#: Directories: owner and group (trainers of the socket's group map the cache).
DIR_MODE = 0o750
#: Files: owner writes, group reads.
FILE_MODE = 0o640


def ensure_private_dir(path: Path, what: str) -> Path:
    """Creates ``path`` (mode 0750) if needed and closes one of this user's
    that is open to others; raises StartupError naming ``what`` if unusable."""
    try:
        if not path.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=DIR_MODE, exist_ok=True)
            path.chmod(DIR_MODE)
        close_to_others(path)
    except OSError as exc:
        raise StartupError(f"{what} {path} cannot be created: {exc.strerror}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"{what} {path} is not writable")
    return path


def close_to_others(path: Path) -> None:
    """Takes the rights of others off a file or directory of this user's made before they were withheld."""
    st = path.stat()
    if st.st_uid == os.geteuid() and st.st_mode & stat.S_IRWXO:
        path.chmod(stat.S_IMODE(st.st_mode) & ~stat.S_IRWXO)


def private_dir(path: Path) -> Path:
    """Creates ``path`` and its missing parents mode 0750 (a sub-directory of a private one)."""
    if not path.is_dir():
        for missing in reversed([path, *path.parents]):
            if not missing.is_dir():
                missing.mkdir(mode=DIR_MODE, exist_ok=True)
                missing.chmod(DIR_MODE)
    return path


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that creates files mode 0640 whatever the umask."""
    fd = os.open(path, flags, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def enterable_by_group(st: os.stat_result, gid: int) -> bool:
    """Whether the members of ``gid`` may enter a directory of this stat (as
    members, not as its owner)."""
    mode = stat.S_IMODE(st.st_mode)
    return bool(mode & stat.S_IXOTH or (st.st_gid == gid and mode & stat.S_IXGRP))


def share_with_group(directory: Path, files: tuple[str, ...], writable: tuple[str, ...], group: str) -> str | None:
    """Gives ``directory`` and its ``files`` to ``group`` ("": the process's own
    group): the directory 0750, the files 0640, those of ``writable`` 0660.
    Returns why the group still cannot reach them (a directory above it that
    its members cannot enter), or None.

    Raises:
        OSError: the group cannot be given (this process is not a member).
        KeyError: no such group.
    """
    gid = grp.getgrnam(group).gr_gid if group else os.getegid()
    os.chown(directory, -1, gid)
    directory.chmod(DIR_MODE)
    for name in files:
        os.chown(directory / name, -1, gid)
        (directory / name).chmod(FILE_MODE | (stat.S_IWGRP if name in writable else 0))
    for above in directory.resolve().parents:
        st = above.stat()
        if not enterable_by_group(st, gid):
            mode = stat.S_IMODE(st.st_mode)
            return f"{above} (mode {mode:04o}, gid {st.st_gid}) cannot be entered by gid {gid}"
    return None
