"""The node's identity: a random key the daemon makes once and keeps in its
cache dir, beside the LMDB.

The directory gives a live node's name to no other identity (see
:meth:`dataquay.server.directory.state.DirectoryState.register`), so the key
must outlive restarts of the daemon and be this node's alone: the cache dir
is the node's (its lock admits one daemon), and the file is the daemon
user's only (mode 0600), since trainers of the socket's group read the cache.
A node rebuilt on a fresh disk makes a new key and gets its name back once
the old identity's lease has ended.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from dataquay.server.directory.state import IDENTITY_KEY_BYTES
from dataquay.server.errors import StartupError

#: The key, as hex digits and a newline, under the cache dir.
IDENTITY_FILE = "node.key"
#: Owner only: whoever reads the key can register as this node.
KEY_MODE = 0o600


def node_identity(cache_dir: Path) -> bytes:
    """This node's key, made and written under ``cache_dir`` the first time.

    Raises:
        StartupError: the file is not one this daemon can use (another kind
            of file, not a key, unreadable, or not writable when new).
    """
    path = Path(cache_dir) / IDENTITY_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StartupError(f"cannot read the node identity key {path}: {exc.strerror}") from exc
    try:
        return _create(path)
    except OSError as exc:
        raise StartupError(f"cannot write the node identity key {path}: {exc.strerror}") from exc


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StartupError(f"the node identity key {path} is not a regular file")
        if stat.S_IMODE(st.st_mode) != KEY_MODE:
            os.fchmod(fd, KEY_MODE)
        text = os.read(fd, 4 * IDENTITY_KEY_BYTES)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) != IDENTITY_KEY_BYTES:
        raise StartupError(
            f"the node identity key {path} is not {2 * IDENTITY_KEY_BYTES} hex digits; remove it to give this "
            "node a new identity (the directory then refuses the node's name until its old lease ends)"
        )
    return key


def _create(path: Path) -> bytes:
    """Writes a new key whole or not at all: a crash leaves no short key behind."""
    key = secrets.token_bytes(IDENTITY_KEY_BYTES)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, KEY_MODE)
    try:
        os.fchmod(fd, KEY_MODE)
        os.write(fd, f"{key.hex()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return key
