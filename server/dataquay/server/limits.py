"""A cap on the calls one remote peer may have in flight at once.

A daemon serves every trainer of its node and every peer of the cluster; one
misbehaving host opening thousands of streams must not starve the others. A
call over the cap is refused at once with RESOURCE_EXHAUSTED (the caller
backs off and reads elsewhere) instead of queueing. Calls over the unix
socket come from this node's own trainers and are not capped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from dataquay.server.interceptors import reshaped


class PeerCallLimit(grpc.aio.ServerInterceptor):
    """Refuses a TCP peer's call while it already has ``limit`` in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.refused = 0
        self._in_flight: Counter[str] = Counter()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return _counted(handler, self)

    def enter(self, context: grpc.aio.ServicerContext) -> str | None:
        """Counts the call in; the peer's key, or None when it is over the cap (or not capped)."""
        peer = context.peer() or ""
        if peer.startswith("unix:"):
            return None
        host = peer.rpartition(":")[0]  # one host, whatever its source port
        if self._in_flight[host] >= self.limit:
            self.refused += 1
            return ""
        self._in_flight[host] += 1
        return host

    def leave(self, host: str | None) -> None:
        if host:
            self._in_flight[host] -= 1
            if not self._in_flight[host]:
                del self._in_flight[host]


def _counted(handler: grpc.RpcMethodHandler, limit: PeerCallLimit) -> grpc.RpcMethodHandler:
    """``handler`` with its calls counted against ``limit``, in the same shape."""
    message = f"too many calls in flight from this host (at most {limit.limit})"

    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            host = limit.enter(context)
            if host == "":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            try:
                return await behavior(request, context)
            finally:
                limit.leave(host)
        return call

    def stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            host = limit.enter(context)
            if host == "":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                limit.leave(host)
        return call

    return reshaped(handler, unary, stream)
