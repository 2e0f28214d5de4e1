"""The servers' side of the two tokens and TLS (see :mod:`dataquay.client.wire.security`).

Two credentials, two kinds of party. The cluster token is what trainers and
tools present: it reads, registers datasets and runs jobs. The node token is
what daemons and the directory present to each other, and trainers never
hold it: only it may put a caller's bytes into a cache or change the node
list (:data:`NODE_METHODS`), sign heartbeat and coded-exchange datagrams and
open the bulk data port. A trainer's process, its environment and whatever
code it runs thus cannot poison another node's cache or fake a node.

One server interceptor (:class:`CredentialCheck`) names the caller's
credential, comparing in constant time: a call without a valid token ends
UNAUTHENTICATED, a node-only call with the cluster token PERMISSION_DENIED.
It logs the method and the refusal, never a token. The standard health
service is left open, so that probes (systemd, load balancers) need no secret
and learn nothing. Datagrams carry an HMAC-SHA256 of their bytes under the
node token instead of the token itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from dataquay.client.wire.channels import server_options
from dataquay.client.wire.security import METADATA_KEY, TOKEN_BYTES, Credentials, CredentialsError, read_token
from dataquay.server.interceptors import EncodedReplies, RequestParsing, reshaped
from dataquay.server.limits import PeerCallLimit

log = logging.getLogger("dataquay.auth")

#: Methods anyone may call: health probes.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
#: The methods only the node credential may call, each with the rule it
#: keeps: every call that puts a caller's bytes into a cache or changes the
#: node list. Reads, dataset registration, jobs and stats stay open to the
#: cluster token; so does CacheBehind, whose bytes the daemon reads back from
#: the PFS's page cache or takes only from a segment of its own user.
NODE_METHODS: Mapping[str, str] = {
    "/dataquay.v1.Cache/Exchange": "only daemons write into another node's cache",
    "/dataquay.v1.Cache/CodedPass": "only daemons take part in a coded pass",
    "/dataquay.v1.Directory/RegisterNode": "only daemons join the node list",
    "/dataquay.v1.Directory/Heartbeat": "only daemons renew a node's lease",
}
#: A refusal of each kind is logged at most this often.
REFUSAL_LOG_SECONDS = 10.0
DIGEST_BYTES = hashlib.sha256().digest_size


def new_token_file(path: str | os.PathLike[str], force: bool = False) -> Path:
    """Writes a fresh random token to ``path``, readable by its owner only.

    Raises:
        CredentialsError: the file exists (and not ``force``) or cannot be written.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, flags, 0o600)
        with os.fdopen(descriptor, "w") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(secrets.token_hex(TOKEN_BYTES) + "\n")
    except FileExistsError:
        raise CredentialsError(f"{path} exists; pass --force to replace its token") from None
    except OSError as exc:
        raise CredentialsError(f"cannot write the token file {path}: {exc.strerror}") from None
    except ValueError as exc:  # a path with a NUL character
        raise CredentialsError(f"cannot write the token file {str(path)!r}: {exc}") from None
    return path


@dataclass(frozen=True)
class ServerCredentials:
    """What a daemon or the directory holds: ``user``, the cluster token it
    accepts from trainers and tools, and ``node``, the node token it accepts
    from and presents to the other servers (its channels, the bulk port,
    signed datagrams). Both carry the server's TLS material."""

    user: Credentials = Credentials()
    node: Credentials = Credentials()

    @classmethod
    def from_files(
        cls,
        token_file: str | os.PathLike[str] | None,
        node_token_file: str | os.PathLike[str] | None,
        ca: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
    ) -> ServerCredentials:
        """Reads the files that are named.

        A cluster token without a node token is refused: every trainer could
        then write into caches and fake nodes. Without either, every call is
        open (a loopback test cluster).

        Raises:
            CredentialsError: a file that cannot be used, or the rule above.
        """
        user = Credentials.from_files(token_file, ca, cert, key)
        node = replace(user, token=read_token(node_token_file) if node_token_file else "")
        if user.token and not node.token:
            raise CredentialsError(
                "--token-file needs --node-token-file, or every trainer could write into caches and join the "
                "node list; make one for the servers only with `dataquay token new --node PATH`"
            )
        if node.token and node.token == user.token:
            raise CredentialsError(
                "--node-token-file holds the cluster token of --token-file; the node token must be a separate "
                "one that trainers never hold (`dataquay token new --node PATH`)"
            )
        return cls(user, node)


def server_tls(credentials: Credentials) -> grpc.ServerCredentials | None:
    """TLS for a server's TCP port when it has a certificate; clients must
    present one signed by the CA when a CA is configured (mutual TLS)."""
    if credentials.cert is None or credentials.key is None:
        return None
    return grpc.ssl_server_credentials(
        [(credentials.key, credentials.cert)],
        root_certificates=credentials.ca,
        require_client_auth=credentials.ca is not None,
    )


def new_server(
    credentials: ServerCredentials,
    calls_per_peer: int = 0,
    encoded_replies: frozenset[str] = frozenset(),
    checks: tuple[grpc.aio.ServerInterceptor, ...] = (),
) -> grpc.aio.Server:
    """A gRPC server that refuses calls without a valid credential, when it
    has tokens (:class:`CredentialCheck`), calls that ``checks`` refuse, a TCP host's calls beyond
    ``calls_per_peer`` in flight (0: no cap) and malformed requests; the
    methods named in ``encoded_replies`` may answer with encoded bytes
    (:class:`~dataquay.server.interceptors.EncodedReplies`)."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if credentials.user.token or credentials.node.token:
        interceptors.append(CredentialCheck(credentials.user.token, credentials.node.token))
    interceptors.extend(checks)
    if calls_per_peer:
        interceptors.append(PeerCallLimit(calls_per_peer))
    if encoded_replies:
        interceptors.append(EncodedReplies(encoded_replies))
    interceptors.append(RequestParsing())
    return grpc.aio.server(options=server_options(), interceptors=interceptors)


def sign(token: str, payload: bytes) -> bytes:
    """``payload`` followed by its HMAC-SHA256 under ``token`` (the node token);
    the payload itself when there is no token."""
    if not token:
        return payload
    return payload + hmac.new(token.encode(), payload, hashlib.sha256).digest()


def verified(token: str, datagram: bytes) -> bytes | None:
    """The payload of a :func:`sign`-ed datagram, or None when its signature is wrong."""
    if not token:
        return datagram
    if len(datagram) <= DIGEST_BYTES:
        return None
    payload, tag = datagram[:-DIGEST_BYTES], datagram[-DIGEST_BYTES:]
    expected = hmac.new(token.encode(), payload, hashlib.sha256).digest()
    return payload if hmac.compare_digest(tag, expected) else None


def supplied_credential(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes:
    """What a call carries as its credential (``Bearer <token>``), as bytes; empty for none."""
    supplied = next((v for k, v in metadata or () if k == METADATA_KEY), "")
    return supplied.encode() if isinstance(supplied, str) else bytes(supplied)


class CredentialCheck(grpc.aio.ServerInterceptor):
    """Names each caller's credential and lets through what it may call.

    The node token may call every method; the cluster token every method but
    :data:`NODE_METHODS` (PERMISSION_DENIED, naming the rule); no valid token
    nothing but the open methods (UNAUTHENTICATED). A server without a cluster
    token (``user`` empty) lets any caller call what the cluster token may.
    """

    def __init__(self, user: str, node: str) -> None:
        self._user = f"Bearer {user}".encode() if user else b""
        self._node = f"Bearer {node}".encode() if node else b""
        self._logged_at: dict[str, float] = {}
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        raw = supplied_credential(details.invocation_metadata)
        # Both compared, always: the time taken says nothing about which matched.
        is_node = hmac.compare_digest(raw, self._node) & bool(self._node)
        is_user = hmac.compare_digest(raw, self._user) & bool(self._user)
        if is_node:
            return handler
        rule = NODE_METHODS.get(details.method)
        if rule is None and (is_user or not self._user):
            return handler
        name = details.method.rpartition("/")[2]
        if rule is not None and is_user:
            self._log("refused a node-only call made with the cluster token", details.method, "cluster")
            return _refusal(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} needs the node credential ({rule}); the cluster token of trainers and tools may not call it",
            )
        needed = "node token" if rule is not None or not self._user else "cluster token"
        self._log(f"refused a call without the {needed}", details.method, "wrong" if raw else "missing")
        return _refusal(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            f"missing or wrong {needed}" if raw else f"this call needs the {needed}",
        )

    def _log(self, message: str, method: str, token: str) -> None:
        """Logs a refusal, each kind at most once per :data:`REFUSAL_LOG_SECONDS`."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at.get(message, -REFUSAL_LOG_SECONDS) >= REFUSAL_LOG_SECONDS:
            self._logged_at[message] = now
            log.warning(message, extra={"fields": {"method": method, "token": token, "refused_so_far": self.refused}})


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with ``code``."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # makes this an async generator, as streaming handlers are

    return reshaped(handler, lambda _behavior: unary, lambda _behavior: streaming)
