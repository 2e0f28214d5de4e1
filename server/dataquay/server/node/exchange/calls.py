"""The two transports of one exchange stream, behind one interface for the sender.

The whole stream moves to the bulk path when the receiver has one (and TLS
is off: a TLS socket cannot be read and written from two threads at once):
the offer, the chunks of cache values and the receiver's replies go as
frames of :mod:`dataquay.server.node.bulk.frames` on a connection of its own,
so the guarantees stay those of the gRPC stream (a reply per chunk once
committed, the sender's window of unacknowledged chunks, restart-safe
offers). The payloads go out of the cache's map with ``writev``, without a
copy or a check (the receiver checks each checksum, once for the hop), and
are taken in with ``recv_into``, without protobuf. Otherwise the stream is
the gRPC Exchange call: values read out of the map and checked, a value
larger than a message sent in pieces.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np

from dataquay.client.pieces import PIECE_BYTES, pieces
from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.bulk.client import BulkClient, BulkRefusedError
from dataquay.server.node.bulk.frames import (
    END,
    ERROR,
    EXCHANGE,
    MAX_ERROR_BYTES,
    MAX_REPLY_BYTES,
    REPLY,
    REQUEST,
    REQUEST_MAGIC,
    SAMPLE,
    BulkError,
    chunk_frames,
    recv_bytes,
    send_buffers,
    send_now,
)
from dataquay.server.node.store import Store

T = TypeVar("T")
#: Longest a bulk exchange connection may make no progress either way.
STALL_SECONDS = 300.0


class ExchangeCall(Protocol):
    """One exchange stream, as the sender drives it."""

    async def offer(self, offer: pb.ExchangeOffer) -> None: ...

    async def send(self, db: str, ids: np.ndarray) -> None:
        """One chunk: the cache values of ``ids`` in ``db`` (those still
        cached), answered by one reply."""

    async def read(self) -> pb.ExchangeReply | None:
        """The next reply; None once the receiver has answered everything."""

    async def done_writing(self) -> None: ...

    def cancel(self) -> None: ...


class GrpcExchangeCall:
    """The Exchange RPC."""

    def __init__(self, call: grpc.aio.StreamStreamCall, store: Store) -> None:
        self._call = call
        self._store = store

    async def offer(self, offer: pb.ExchangeOffer) -> None:
        await self._call.write(pb.ExchangeMessage(offer=offer))

    async def send(self, db: str, ids: np.ndarray) -> None:
        ids_list = ids.tolist()
        samples = [(i, v) for i, v in zip(ids_list, self._store.get_values(db, ids_list)) if v is not None]
        if len(samples) == 1 and len(samples[0][1]) > PIECE_BYTES:
            sample_id, value = samples[0]
            for offset, part in pieces(value):
                await self._call.write(pb.ExchangeMessage(
                    piece=pb.Sample(id=sample_id, value=part, offset=offset, length=len(value))))
            return
        await self._call.write(pb.ExchangeMessage(samples=[pb.Sample(id=i, value=v) for i, v in samples]))

    async def read(self) -> pb.ExchangeReply | None:
        reply = await self._call.read()
        return None if reply is grpc.aio.EOF else reply

    async def done_writing(self) -> None:
        await self._call.done_writing()

    def cancel(self) -> None:
        self._call.cancel()


class BulkExchangeCall:
    """An exchange stream on a bulk connection of its own."""

    def __init__(self, client: BulkClient, address: str, store: Store) -> None:
        self._client = client
        self._address = address
        self._store = store
        self._sock: socket.socket | None = None

    async def offer(self, offer: pb.ExchangeOffer) -> None:
        body = pb.ExchangeMessage(offer=offer).SerializeToString()
        self._sock = await self._run(self._client.connect, self._address)
        self._sock.settimeout(STALL_SECONDS)
        await self._run(send_buffers, self._sock, [REQUEST.pack(REQUEST_MAGIC, EXCHANGE, len(body)), body])

    async def send(self, db: str, ids: np.ndarray) -> None:
        await self._run(self._send_stored, self._connected(), db, ids.tolist())

    def _send_stored(self, sock: socket.socket, db: str, ids: list[int]) -> None:
        """Sends the chunk straight out of the map as far as the socket takes
        it at once, and a copy of the rest once the read transaction is over: a
        sender waiting on a slow receiver must not hold its own map's growth
        back (MapReaders), or two nodes exchanging both ways could wait on each other."""
        with self._store.value_views(db) as get:
            values = ((i, get(i)) for i in ids)
            rest = send_now(sock, chunk_frames([(i, v) for i, v in values if v is not None]))
        send_buffers(sock, rest)

    async def read(self) -> pb.ExchangeReply | None:
        return await self._run(self._read_reply, self._connected())

    async def done_writing(self) -> None:
        await self._run(self._connected().sendall, SAMPLE.pack(END, 0, 0, 0))

    def cancel(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()

    def _connected(self) -> socket.socket:
        if self._sock is None:
            raise BulkError("the exchange stream has no connection yet")
        return self._sock

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._client.threads, fn, *args)
        except OSError as exc:
            raise BulkError(f"bulk exchange stream to {self._address} failed: {exc}") from None

    @staticmethod
    def _read_reply(sock: socket.socket) -> pb.ExchangeReply | None:
        status, code, length, _ = SAMPLE.unpack(recv_bytes(sock, SAMPLE.size))
        if status == END:
            return None
        if status == ERROR and length <= MAX_ERROR_BYTES:
            raise BulkRefusedError(code, recv_bytes(sock, length).decode(errors="replace"))
        if status != REPLY or length > MAX_REPLY_BYTES:
            raise BulkError(f"bad exchange reply frame: status {status}, {length} bytes")
        return pb.ExchangeReply.FromString(recv_bytes(sock, length))
