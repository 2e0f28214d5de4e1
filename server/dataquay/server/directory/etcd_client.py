"""A small asyncio client of etcd v3's gRPC API: the calls the directory's etcd store makes.

Why not a library: no maintained Python etcd3 client works with the
protobuf this project runs on, so the store speaks etcd's own gRPC API
(:mod:`dataquay.protos.etcd_rpc_pb2`, compiled from etcd's protos) through
the grpcio the daemons use.

Endpoints are tried in turn: a call that finds its endpoint unreachable is
made again on the next one, once round all of them, then fails with
:class:`~dataquay.server.errors.DirectoryUnavailableError` naming the last
cause. A call that reached etcd and was refused (a bad request) is not
repeated. Every call has a deadline, so an etcd that hangs is an outage, not
a hung directory.

The calls and streams of all the store's tasks share one channel, closed
when one of them moves to the next endpoint: a call cut off by that is made
again on the new endpoint, and a stream ends with
:class:`~dataquay.server.errors.DirectoryUnavailableError` for its loop to
open again (see :func:`~dataquay.client.wire.channels.closed_under_the_call`);
otherwise the store's watch, keep-alive or writer task would end for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from dataquay.client.wire.channels import closed_under_the_call
from dataquay.protos import etcd_rpc_pb2 as epb
from dataquay.protos import etcd_rpc_pb2_grpc as egrpc
from dataquay.server.errors import DirectoryUnavailableError

log = logging.getLogger("dataquay.directory")

T = TypeVar("T")
U = TypeVar("U")

#: Deadline of one unary call to etcd: a loaded etcd (or replica) answers a
#: transaction of 64 nodes in well under it; a partitioned one costs a change this long per endpoint.
CALL_TIMEOUT_SECONDS = 5.0
#: Codes that say the endpoint, not the request, failed: the next one is tried.
_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN})
#: Message size etcd accepts by default (--max-request-bytes 1.5 MiB), with room for the envelope.
MAX_VALUE_BYTES = 1 << 20
#: etcd's messages are small but a Range of every record of a large cluster is not.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20)]


def parse_endpoints(store: str) -> list[str]:
    """The HOST:PORT endpoints of ``etcd://HOST:PORT[,HOST:PORT...]`` (as the config checked it)."""
    return [e.strip() for e in store.partition("://")[2].strip("/").split(",") if e.strip()]


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes a Range or Watch cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdClient:
    """Calls to the etcd cluster at ``endpoints`` (HOST:PORT each), plain text."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self._current = 0
        self._channel: grpc.aio.Channel | None = None

    def channel(self) -> grpc.aio.Channel:
        """The channel to the current endpoint."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.endpoints[self._current], options=_CHANNEL_OPTIONS)
        return self._channel

    async def reconnect(self, failed: grpc.aio.Channel) -> None:
        """Moves to the next endpoint after a call or stream on ``failed`` found
        its endpoint gone, unless another already moved: the streams of one
        channel break together, and must not move it round the ring."""
        current = self._channel
        if current is None or failed is not current:
            return
        self._channel = None
        self._current = (self._current + 1) % len(self.endpoints)
        await current.close()

    async def call(self, make: Callable[[grpc.aio.Channel], Awaitable[T]]) -> T:
        """``make(channel)`` on the current endpoint, then on each other one that answers.

        Raises:
            DirectoryUnavailableError: no endpoint answered.
        """
        cause = ""
        for _ in range(len(self.endpoints)):
            channel = self.channel()
            try:
                return await make(channel)
            except asyncio.CancelledError:
                if not closed_under_the_call():
                    raise
                cause = "its channel was closed as another call moved to the next endpoint"  # follow it
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRIED:
                    raise
                cause = f"{exc.code().name} {exc.details() or ''}".rstrip()
                await self.reconnect(channel)
        raise DirectoryUnavailableError(
            f"the directory's etcd store ({', '.join(self.endpoints)}) does not answer: {cause}"
        )

    async def range_prefix(self, prefix: bytes, revision: int = 0) -> epb.RangeResponse:
        """Every key under ``prefix``, linearizable, as of ``revision`` (0: now), with
        the revision it was read at."""
        request = epb.RangeRequest(key=prefix, range_end=prefix_end(prefix), revision=revision)
        return await self.call(lambda ch: egrpc.KVStub(ch).Range(request, timeout=CALL_TIMEOUT_SECONDS))

    async def txn(self, request: epb.TxnRequest) -> epb.TxnResponse:
        return await self.call(lambda ch: egrpc.KVStub(ch).Txn(request, timeout=CALL_TIMEOUT_SECONDS))

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its ID."""
        reply = await self.call(
            lambda ch: egrpc.LeaseStub(ch).LeaseGrant(epb.LeaseGrantRequest(TTL=ttl), timeout=CALL_TIMEOUT_SECONDS)
        )
        return int(reply.ID)

    async def revoke(self, lease: int) -> None:
        """Ends ``lease`` and deletes its keys; a lease already gone is no error."""
        try:
            await self.call(
                lambda ch: egrpc.LeaseStub(ch).LeaseRevoke(
                    epb.LeaseRevokeRequest(ID=lease), timeout=CALL_TIMEOUT_SECONDS
                )
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise

    async def keep_alive(
        self, channel: grpc.aio.Channel, leases: asyncio.Queue[int]
    ) -> AsyncIterator[epb.LeaseKeepAliveResponse]:
        """Renews each lease put on ``leases`` through one stream on ``channel``, yielding
        etcd's answers (TTL 0 or below: the lease is gone). Ends with an RpcError when it
        breaks, or DirectoryUnavailableError when its channel is closed."""

        async def requests() -> AsyncIterator[epb.LeaseKeepAliveRequest]:
            while True:
                yield epb.LeaseKeepAliveRequest(ID=await leases.get())

        call = egrpc.LeaseStub(channel).LeaseKeepAlive(requests())
        reply: epb.LeaseKeepAliveResponse
        async for reply in _stream(call):
            yield reply

    async def watch(
        self, channel: grpc.aio.Channel, prefix: bytes, start_revision: int
    ) -> AsyncIterator[epb.WatchResponse]:
        """The changes under ``prefix`` from ``start_revision`` on, as etcd sends them on ``channel``.
        Ends with an RpcError when the stream breaks, DirectoryUnavailableError when its
        channel is closed, or a response with ``canceled``
        (its ``compact_revision`` set when the revision was compacted away)."""
        create = epb.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision, progress_notify=True
        )

        async def requests() -> AsyncIterator[epb.WatchRequest]:
            yield epb.WatchRequest(create_request=create)
            await asyncio.Event().wait()  # the stream stays open until cancelled

        call = egrpc.WatchStub(channel).Watch(requests())
        reply: epb.WatchResponse
        async for reply in _stream(call):
            yield reply

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


async def _stream(call: grpc.aio.StreamStreamCall[T, U]) -> AsyncIterator[U]:
    """The replies of a stream, which is cancelled when its reader stops."""
    try:
        async for reply in call:
            yield reply
    except asyncio.CancelledError:
        if not closed_under_the_call():
            raise
        raise DirectoryUnavailableError(
            "the etcd stream's channel was closed: another call moved to the next endpoint"
        ) from None
    finally:
        call.cancel()


def put(key: bytes, value: bytes, lease: int = 0) -> epb.RequestOp:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes, prefix: bool = False) -> epb.RequestOp:
    return epb.RequestOp(
        request_delete_range=epb.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
    )


def absent(key: bytes) -> epb.Compare:
    """True while ``key`` does not exist."""
    return epb.Compare(result=epb.Compare.EQUAL, target=epb.Compare.CREATE, key=key, create_revision=0)
