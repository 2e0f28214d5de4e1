"""The servers' side of the cluster token and TLS (see :mod:`dataquay.client.security`).

A server interceptor refuses every call that does not carry the cluster
token with UNAUTHENTICATED, comparing in constant time; it logs the method
and the caller, never the token. The standard health service is left open,
so that probes (systemd, load balancers) need no secret and learn nothing.
Heartbeat datagrams carry an HMAC-SHA256 of their bytes under the token
instead of the token itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from dataquay.client.channels import server_options
from dataquay.client.security import METADATA_KEY, TOKEN_BYTES, Credentials, CredentialsError
from dataquay.server.interceptors import EncodedReplies, RequestParsing, reshaped
from dataquay.server.limits import PeerCallLimit

log = logging.getLogger("dataquay.auth")

#: Methods anyone may call: health probes.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
#: A refused caller is logged at most this often.
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
    credentials: Credentials, calls_per_peer: int = 0, encoded_replies: frozenset[str] = frozenset(),
    checks: tuple[grpc.aio.ServerInterceptor, ...] = (),
) -> grpc.aio.Server:
    """A gRPC server that refuses calls without the cluster token, when there
    is one, calls that ``checks`` refuse, a TCP host's calls beyond
    ``calls_per_peer`` in flight (0: no cap) and malformed requests; the
    methods named in ``encoded_replies`` may answer with encoded bytes
    (:class:`~dataquay.server.interceptors.EncodedReplies`)."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if credentials.token:
        interceptors.append(TokenCheck(credentials.token))
    interceptors.extend(checks)
    if calls_per_peer:
        interceptors.append(PeerCallLimit(calls_per_peer))
    if encoded_replies:
        interceptors.append(EncodedReplies(encoded_replies))
    interceptors.append(RequestParsing())
    return grpc.aio.server(options=server_options(), interceptors=interceptors)


def sign(token: str, payload: bytes) -> bytes:
    """``payload`` followed by its HMAC-SHA256 under ``token``; the payload itself when there is no token."""
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


class TokenCheck(grpc.aio.ServerInterceptor):
    """Lets through only calls that carry ``token`` (and the open methods)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._logged_at = 0.0
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        supplied = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        raw = supplied.encode() if isinstance(supplied, str) else bytes(supplied)
        if hmac.compare_digest(raw, self._expected):
            return handler
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_SECONDS:
            self._logged_at = now
            log.warning("refused a call without the cluster token",
                        extra={"fields": {"method": details.method, "token": "missing" if not raw else "wrong",
                                          "refused_so_far": self.refused}})
        return _refusal(handler, "missing or wrong cluster token" if raw else "this call needs the cluster token")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # makes this an async generator, as streaming handlers are

    return reshaped(handler, lambda _behavior: unary, lambda _behavior: streaming)
