"""Caps on what one remote peer may have in flight at once: calls, and payload bytes.

A daemon serves every trainer of its node and every peer of the cluster; one
misbehaving host opening thousands of streams must not starve the others. A
call over the cap is refused at once with RESOURCE_EXHAUSTED (the caller
backs off and reads elsewhere) instead of queueing. Calls over the unix
socket come from this node's own trainers and are not capped.

Bytes are capped by waiting instead (:class:`ByteBudget`): a Read holds the
payloads of a window of its reply at a time, and the windows of one host's
calls, like this daemon's fetches from one peer, share a budget, so that many
calls at once cost memory in proportion to the budget, not to their number.
The same budget bounds the memory a node's prefetches for its ranks hold
(``--prefetch-memory``), where a read that does not fit is not started.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from dataquay.server.interceptors import reshaped

MiB = 1 << 20
#: Payload bytes the Reads of one remote host may hold at once in this daemon.
SERVED_BYTES_PER_PEER = 256 * MiB
#: Payload bytes this daemon's fetches from one peer may have asked for and
#: not yet received, at once.
FETCHED_BYTES_PER_PEER = 256 * MiB


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


class ByteBudget:
    """Bytes that holders may have at once; lives on the event loop.

    Two kinds of holder share the one count. A holder that must get its bytes
    waits in line (:meth:`take`): a request larger than the whole budget is
    let through once nothing else is held, so that one large sample is slow to
    get, never refused. A holder that may as well not (a prefetch of the
    ranks) reserves only what fits now within a share of the limit
    (:meth:`reserve`) and waits for :meth:`changed` before trying again.

    Attributes:
        limit: the budget in bytes.
        held: bytes held now.
        peak: the most ever held at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._watchers: set[asyncio.Future[None]] = set()

    @property
    def idle(self) -> bool:
        return not self.held and not self._waiters

    def room(self, share: float = 1.0) -> int:
        """Bytes that may still be held within ``share`` of the limit."""
        return max(0, int(self.limit * share) - self.held)

    def reserve(self, nbytes: int, share: float = 1.0) -> bool:
        """Takes ``nbytes`` if they fit within ``share`` of the limit; False (nothing taken) if not. Never waits."""
        if nbytes > self.room(share):
            return False
        self._hold(nbytes)
        return True

    def try_take(self, nbytes: int) -> bool:
        """Takes ``nbytes`` if they are free now and nobody waits before; never waits."""
        if self._waiters or not self._fits(nbytes):
            return False
        self._hold(nbytes)
        return True

    async def take(self, nbytes: int) -> None:
        """Waits until ``nbytes`` are free, then takes them."""
        if self.try_take(nbytes):
            return
        future = asyncio.get_running_loop().create_future()
        waiter = (nbytes, future)
        self._waiters.append(waiter)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.give(nbytes)  # granted just as the waiter was cancelled
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self.wake()
            raise

    def give(self, nbytes: int) -> None:
        """Returns bytes taken or reserved before."""
        if nbytes:
            self.held -= nbytes
            self.wake()

    def wake(self) -> None:
        """Hands freed bytes to the waiters in line and wakes the watchers of
        :meth:`changed` (bytes were freed, or what they wait for moved on)."""
        while self._waiters and (self._waiters[0][1].done() or self._fits(self._waiters[0][0])):
            nbytes, future = self._waiters.popleft()
            if not future.done():  # a cancelled waiter is skipped
                self._hold(nbytes)
                future.set_result(None)
        for watcher in self._watchers:
            if not watcher.done():
                watcher.set_result(None)

    async def changed(self, timeout: float) -> None:
        """Returns at the next :meth:`wake`, or after ``timeout`` seconds."""
        watcher = asyncio.get_running_loop().create_future()
        self._watchers.add(watcher)
        try:
            await asyncio.wait({watcher}, timeout=timeout)
        finally:
            self._watchers.discard(watcher)

    def _hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _fits(self, nbytes: int) -> bool:
        return not self.held or self.held + nbytes <= self.limit


class ByteBudgets:
    """One :class:`ByteBudget` of ``limit`` bytes per key (a host, a peer).

    Idle budgets are dropped once more than ``keep`` keys have one, so that
    hosts that come and go leave nothing behind.
    """

    def __init__(self, limit: int, keep: int = 64) -> None:
        self.limit = limit
        self.keep = keep
        self._budgets: dict[str, ByteBudget] = {}

    def __len__(self) -> int:
        return len(self._budgets)

    def get(self, key: str) -> ByteBudget:
        budget = self._budgets.get(key)
        if budget is None:
            if len(self._budgets) >= self.keep:
                self._budgets = {k: b for k, b in self._budgets.items() if not b.idle}
            budget = self._budgets[key] = ByteBudget(self.limit)
        return budget
