"""Binding a server's listeners with errors a user can act on, and the address
other nodes should be told."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import grpc

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


def claim_socket_path(path: Path) -> None:
    """Makes ``path`` free for a new socket; refuses if a live daemon is on it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"cannot create socket dir {path.parent}: {exc.strerror}") from exc
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
