"""Binding a server's listeners with errors a user can act on, and the address
other nodes should be told."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import socket
import stat
from pathlib import Path

import grpc

from dataquay.server.dirs import enterable_by_group
from dataquay.server.errors import StartupError

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_host(host: str) -> str:
    """The name other nodes reach a listener by: the host name for a wildcard bind."""
    host = host.strip("[]")
    return socket.gethostname() if host in _WILDCARD_HOSTS else host


def bind_tcp(server: grpc.aio.Server, listen: str, tls: grpc.ServerCredentials | None = None) -> str:
    """Adds ``listen`` (HOST:PORT, port 0 picks one) to ``server``, with TLS
    when given; returns the address to advertise."""
    host, _, port = listen.rpartition(":")
    check_port_free(host, port)
    try:
        bound = server.add_secure_port(listen, tls) if tls is not None else server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {listen}: port taken or address not local") from exc
    if not bound:
        raise StartupError(f"cannot listen on {listen}: port taken or address not local")
    return f"{advertised_host(host)}:{bound}"


def check_port_free(host: str, port: str) -> None:
    """Fails with a clear message before gRPC would fail with a vague one."""
    if not port.isdigit():
        raise StartupError(f"bad listen address {host}:{port}: expected HOST:PORT")
    if int(port) == 0:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host.strip("[]") or "0.0.0.0", int(port)))
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    finally:
        probe.close()


def check_socket_dir(directory: Path, uid: int | None = None) -> None:
    """Refuses a socket directory that another user owns or may write into.

    Whoever can write into the directory can put a socket of their own in
    the daemon's place and collect the cluster token its clients send, so
    the directory must belong to the daemon's user and be writable by it
    alone, as a shared one in /tmp created by someone else is not.
    """
    uid = os.geteuid() if uid is None else uid
    st = directory.stat()
    owner, mode = st.st_uid, stat.S_IMODE(st.st_mode)
    if owner != uid or mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StartupError(
            f"socket dir {directory} (owner {_user_name(owner)}, mode {mode:04o}) must be owned by "
            f"{_user_name(uid)} and writable by it alone; remove it or pick another --socket"
        )


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def claim_socket_path(path: Path, group: str = "") -> None:
    """Makes ``path`` free for a new socket; refuses if a live daemon is on it.

    A missing socket directory is created 0700, or 0750 of ``group`` (the
    socket's group) when one is given: its members reach the socket only
    through a directory they may enter.
    """
    directory = path.parent
    if not directory.exists():
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=0o700)
            if group:
                shutil.chown(directory, group=group)
            directory.chmod(0o750 if group else 0o700)
        except LookupError:
            raise StartupError(f"cannot give socket dir {directory} to group {group!r}: no such group") from None
        except OSError as exc:
            raise StartupError(f"cannot create socket dir {directory}: {exc.strerror}") from exc
    check_socket_dir(directory)
    if not path.exists():
        return
    if not stat.S_ISSOCK(path.stat().st_mode):
        raise StartupError(f"socket path {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise StartupError(f"another daemon is serving on socket {path}")


def group_entry_problem(directory: Path, group: str) -> str | None:
    """Why the members of ``group`` cannot enter the socket directory, or None.

    The daemon gives a directory it creates to the group, but one made
    before (by an earlier run, or the operator) keeps its mode and group:
    there the socket's group would see "permission denied" for a socket
    it was given.
    """
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return None  # giving the socket to it fails the start, naming the group
    st = directory.stat()
    if enterable_by_group(st, gid):
        return None
    mode = stat.S_IMODE(st.st_mode)
    return (
        f"socket dir {directory} (mode {mode:04o}, gid {st.st_gid}) cannot be entered by group {group}; "
        f"chgrp {group} {directory} && chmod 0750 {directory}, or remove it for the daemon to create"
    )


#: What tells one socket file from another at the same path: (device, inode).
SocketIdentity = tuple[int, int]


def socket_identity(path: Path) -> SocketIdentity:
    """The identity of the socket this process just bound at ``path``."""
    st = path.stat()
    return st.st_dev, st.st_ino


def remove_own_socket(path: Path, identity: SocketIdentity | None) -> None:
    """Removes the socket at ``path`` only if it is the one this process bound.

    A serve that did not bind ``path`` (another daemon serves there) must
    leave that daemon's socket in place, or its clients lose it until it
    restarts.
    """
    if identity is None:
        return
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        path.unlink(missing_ok=True)
