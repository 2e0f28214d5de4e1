"""How a party proves it belongs to the cluster: a token on every call, and TLS on TCP.

Every RPC to a daemon or the directory carries the cluster token in its
metadata (``authorization: Bearer <token>``); the servers refuse calls
without it. The token lives in a file only its owner can read, like an ssh
key, named by ``DATAQUAY_TOKEN_FILE`` (a trainer's environment) or the
services' ``--token-file``. The daemons and the directory hold a second
token besides, the node token (``--node-token-file``), which they present to
one another and which no trainer loads: only it may write into a cache or
change the node list (see ``dataquay.server.auth``). Over TCP, channels use
TLS when a CA is given (``DATAQUAY_TLS_CA``), presenting a certificate of
their own when one is given too (``DATAQUAY_TLS_CERT`` and
``DATAQUAY_TLS_KEY``, for mutual TLS). Unix
sockets stay plaintext: the socket file's permissions guard them, and a
client checks who owns the socket and its directory before it sends the
token there (see :func:`check_daemon_socket`).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from dataquay.client.errors import DataquayError
from dataquay.client.wire.channels import grpc_target

METADATA_KEY = "authorization"
#: Names the user a system daemon runs as (``dataquay`` under systemd): a
#: socket of that user is trusted like one of the client's own user or root's.
DAEMON_USER_ENV = "DATAQUAY_DAEMON_USER"
#: Bytes of randomness in a new token (hex-encoded in its file).
TOKEN_BYTES = 32


class CredentialsError(DataquayError):
    """A token or certificate file that cannot be used (missing, unreadable, too open)."""


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in ``path``, refusing a file that others than its owner may read.

    Raises:
        CredentialsError: naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise CredentialsError(f"cannot read the token file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(f"the token file {path} is readable by others than its owner; chmod 600 {path}")
    if len(text) < TOKEN_BYTES or not text.isascii() or not text.isprintable() or " " in text:
        raise CredentialsError(f"the token file {path} holds no valid token (make one with `dataquay token new`)")
    return text


def trusted_socket_owners(env: Mapping[str, str] = os.environ) -> frozenset[int]:
    """The uids whose daemon socket a client talks to: its own, root's, and
    that of the user named by DATAQUAY_DAEMON_USER (a name or a uid)."""
    uids = {os.geteuid(), 0}
    name = env.get(DAEMON_USER_ENV, "").strip()
    if name:
        try:
            uids.add(int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid)
        except KeyError:
            raise CredentialsError(f"{DAEMON_USER_ENV}={name!r} names no user on this host") from None
    return frozenset(uids)


def socket_trust_problem(
    path: str, sock: os.stat_result | None, directory: os.stat_result, trusted: frozenset[int]
) -> str | None:
    """Why the daemon socket at ``path`` (``sock`` None while it is missing)
    must not be sent the token, or None when it may.

    The socket must belong to a trusted user, and so must its directory,
    which nobody else may write into (unless it is sticky, as /tmp is):
    whoever can, can put a socket of their own in the daemon's place.
    """
    parent = os.path.dirname(path)
    if directory.st_uid not in trusted:
        return f"its directory {parent} belongs to {_foreign(directory.st_uid)}"
    dir_mode = stat.S_IMODE(directory.st_mode)
    if dir_mode & (stat.S_IWGRP | stat.S_IWOTH) and not dir_mode & stat.S_ISVTX:
        return f"its directory {parent} (mode {dir_mode:04o}) is writable by other users"
    if sock is not None and sock.st_uid not in trusted:
        return f"it belongs to {_foreign(sock.st_uid)}"
    return None


def check_daemon_socket(path: str, env: Mapping[str, str] = os.environ) -> None:
    """Refuses a daemon socket that another user could have put there, or
    that this user may not reach.

    A missing socket directory passes: there is nothing to connect to yet.
    A socket this user may not reach fails here, at once: gRPC would retry
    its connect until the call's deadline and report only that.

    Raises:
        CredentialsError: naming the socket, its owner and how to trust it,
            or that permission to reach it is denied.
    """
    try:
        directory = os.stat(os.path.dirname(path) or ".")
    except OSError:
        return
    try:
        sock: os.stat_result | None = os.stat(path)
    except PermissionError:
        raise _unreachable(path, f"its directory {os.path.dirname(path) or '.'} may not be entered") from None
    except OSError:
        sock = None
    problem = socket_trust_problem(path, sock, directory, trusted_socket_owners(env))
    if problem is not None:
        raise CredentialsError(f"refusing the daemon socket {path}: {problem}")
    # Connecting to a unix socket takes write permission on it.
    if sock is not None and not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise _unreachable(path, f"mode {stat.S_IMODE(sock.st_mode):04o}, group {_group_name(sock.st_gid)}")


def _unreachable(path: str, why: str) -> CredentialsError:
    return CredentialsError(
        f"cannot reach the daemon socket {path}: permission denied ({why}); "
        "the daemon's --socket-group must be one of your groups"
    )


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _foreign(uid: int) -> str:
    try:
        name = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        name = f"uid {uid}"
    return f"{name}, neither you nor root; if the node's daemon runs as that user, set {DAEMON_USER_ENV} to its name"


def _read_pem(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CredentialsError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Credentials:
    """What a channel presents: the token, and TLS material for TCP.

    ``ca`` verifies servers; ``cert`` and ``key`` are this party's own (a
    server's, or a client's for mutual TLS).
    """

    token: str = ""
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(
        cls,
        token_file: str | os.PathLike[str] | None = None,
        ca: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
    ) -> Credentials:
        """Reads the files that are named; raises CredentialsError for one that cannot be used."""
        if bool(cert) != bool(key):
            raise CredentialsError("a TLS certificate needs its key and a key its certificate")
        return cls(
            token=read_token(token_file) if token_file else "",
            ca=_read_pem(ca, "CA") if ca else None,
            cert=_read_pem(cert, "certificate") if cert else None,
            key=_read_pem(key, "key") if key else None,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Credentials:
        """A trainer's or a tool's credentials: DATAQUAY_TOKEN_FILE and DATAQUAY_TLS_{CA,CERT,KEY}."""
        return cls.from_files(
            env.get("DATAQUAY_TOKEN_FILE") or None,
            env.get("DATAQUAY_TLS_CA") or None,
            env.get("DATAQUAY_TLS_CERT") or None,
            env.get("DATAQUAY_TLS_KEY") or None,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    def _tls(self, target: str) -> grpc.ChannelCredentials | None:
        if target.startswith("unix:") or self.ca is None:
            return None
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A blocking channel to ``address`` (socket path or HOST:PORT) that sends these credentials."""
        target = grpc_target(address)
        _check_unix_target(target)
        tls = self._tls(target)
        channel = (
            grpc.secure_channel(target, tls, options=options)
            if tls is not None
            else grpc.insecure_channel(target, options=options)
        )
        if not self.token:
            return channel
        return grpc.intercept_channel(channel, _TokenInterceptor(self.metadata))

    def aio_channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """An asyncio channel to ``address`` that sends these credentials (daemons' peers, the directory)."""
        target = grpc_target(address)
        _check_unix_target(target)
        tls = self._tls(target)
        interceptors = [interceptor(self.metadata) for interceptor in _AIO_INTERCEPTORS] if self.token else None
        if tls is not None:
            return grpc.aio.secure_channel(target, tls, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def with_metadata(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> grpc.Channel:
    """``channel`` adding ``metadata`` to every call (a caller ticket, beside the token)."""
    return grpc.intercept_channel(channel, _TokenInterceptor(metadata)) if metadata else channel


def _check_unix_target(target: str) -> None:
    if target.startswith("unix:"):
        check_daemon_socket(target.removeprefix("unix:").removeprefix("//"))


class _ClientCallDetails(grpc.ClientCallDetails):
    _fields = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")

    def __init__(self, **fields: Any) -> None:
        for name in self._fields:
            setattr(self, name, fields.get(name))


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        fields = {name: getattr(details, name, None) for name in _ClientCallDetails._fields}
        fields["metadata"] = [*(fields.get("metadata") or ()), *self._metadata]
        return _ClientCallDetails(**fields)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioTokenMixin:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _AioUnaryUnary(_AioTokenMixin, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioTokenMixin, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioTokenMixin, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioTokenMixin, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


_AIO_INTERCEPTORS = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
