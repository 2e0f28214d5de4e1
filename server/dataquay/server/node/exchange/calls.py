"""The two transports of one exchange stream, behind one interface for the sender.

The whole stream moves to the bulk path when the receiver has one (and TLS
is off: a TLS socket cannot be read and written from two threads at once):
the offer, the chunks of cache values and the receiver's replies go as
frames of :mod:`dataquay.server.node.peers.bulk.frames` on a connection of its own,
so the guarantees stay those of the gRPC stream (a reply per chunk once
committed, the sender's window of unacknowledged chunks, restart-safe
offers). The payloads go out of the cache's map with ``sendmsg`` on a
blocking socket, without a copy or a check (the receiver checks each
checksum, once for the hop), and are taken in with ``recvmsg_into``, without
protobuf; the stream's own threads do that, off the event loop. Otherwise the stream is
the gRPC Exchange call: values read out of the map and checked, a value
larger than a message sent in pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
from typing import Protocol

import grpc
import lmdb
import numpy as np
from google.protobuf.message import DecodeError

from dataquay.client.wire.pieces import PIECE_BYTES, pieces
from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.cache.store import Store
from dataquay.server.node.peers.bulk.client import BulkClient, BulkRefusedError
from dataquay.server.node.peers.bulk.frames import (
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
    kernel_timeouts,
    recv_bytes,
    send_all,
)

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

    async def close(self) -> None:
        """Ends the stream (cancels it if it is still going); returns once
        nothing of it reads this node's map any more."""


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
                await self._call.write(
                    pb.ExchangeMessage(piece=pb.Sample(id=sample_id, value=part, offset=offset, length=len(value)))
                )
            return
        await self._call.write(pb.ExchangeMessage(samples=[pb.Sample(id=i, value=v) for i, v in samples]))

    async def read(self) -> pb.ExchangeReply | None:
        reply = await self._call.read()
        return None if reply is grpc.aio.EOF else reply

    async def done_writing(self) -> None:
        await self._call.done_writing()

    async def close(self) -> None:
        self._call.cancel()


class BulkExchangeCall:
    """An exchange stream on a bulk connection of its own, with two threads of its own.

    The event loop only hands chunks over and takes replies in: ``send``
    queues a chunk for the stream's sending thread (the sender's window
    bounds how many wait), which sends it straight out of the map on the
    blocking socket; the stream's reading thread takes the receiver's
    replies and hands them to the loop, those that arrived while the loop
    was busy in one call. A thread hand-off per chunk and per reply costs
    the loop more than the chunk's bookkeeping.
    """

    def __init__(self, client: BulkClient, address: str, store: Store) -> None:
        self._client = client
        self._address = address
        self._store = store
        self._sock: socket.socket | None = None
        self._chunks: queue.SimpleQueue[tuple[str, list[int]] | None] = queue.SimpleQueue()
        self._replies: asyncio.Queue[pb.ExchangeReply | BulkError | None] = asyncio.Queue()
        self._landed: list[pb.ExchangeReply | BulkError | None] = []
        self._lock = threading.Lock()
        self._send_error: BulkError | None = None
        self._sending: threading.Thread | None = None
        self._ended = asyncio.Event()

    async def offer(self, offer: pb.ExchangeOffer) -> None:
        body = pb.ExchangeMessage(offer=offer).SerializeToString()
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(self._client.threads, self._client.connect, self._address)
        try:
            kernel_timeouts(sock, STALL_SECONDS)
            await loop.run_in_executor(
                self._client.threads,
                send_all,
                sock,
                [REQUEST.pack(REQUEST_MAGIC, EXCHANGE, len(body)), body],
                STALL_SECONDS,
            )
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError):
                raise self._failed(exc) from None
            raise
        self._sock = sock
        self._sending = threading.Thread(
            target=self._send_chunks, args=(sock,), daemon=True, name=f"exchange-send-{self._address}"
        )
        self._sending.start()
        threading.Thread(
            target=self._read_replies, args=(sock, loop), daemon=True, name=f"exchange-replies-{self._address}"
        ).start()

    async def send(self, db: str, ids: np.ndarray) -> None:
        self._chunks.put((db, ids.tolist()))

    async def read(self) -> pb.ExchangeReply | None:
        reply = await self._replies.get()
        if isinstance(reply, BulkError):
            raise reply
        return reply

    async def done_writing(self) -> None:
        self._chunks.put(None)

    async def close(self) -> None:
        """Shuts the connection, which ends both threads, and waits for them."""
        if self._sock is None:
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        await self._ended.wait()

    def _send_chunks(self, sock: socket.socket) -> None:
        """The sending thread: each queued chunk, then END once the loop is done writing."""
        readers = self._store.map_readers
        try:
            while (chunk := self._chunks.get()) is not None:
                db, ids = chunk
                # A sender waiting on a slow receiver must not hold its own
                # map's growth back: the rest goes as a copy, out of the read
                # transaction, or two nodes exchanging both ways could wait on each other.
                with self._store.value_views(db) as get:
                    values = ((i, get(i)) for i in ids)
                    frames = chunk_frames([(i, v) for i, v in values if v is not None])
                    rest = send_all(sock, frames, STALL_SECONDS, readers.growth_waiting)
                send_all(sock, rest, STALL_SECONDS)
            send_all(sock, [SAMPLE.pack(END, 0, 0, 0)], STALL_SECONDS)
        except (OSError, lmdb.Error) as exc:
            self._send_error = self._failed(exc)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _read_replies(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """The reading thread: every reply, then None at END or the error that
        ended the stream (the sending thread's, if it failed first); it closes
        the connection once both threads are out of it."""
        assert self._sending is not None
        ending: BulkError | None = None
        try:
            while (reply := self._read_reply(sock)) is not None:
                self._hand_over(loop, reply)
        except (OSError, BulkError, DecodeError) as exc:
            ending = self._send_error or (exc if isinstance(exc, BulkError) else self._failed(exc))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._chunks.put(None)
        self._sending.join()
        sock.close()
        self._hand_over(loop, ending)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it
            loop.call_soon_threadsafe(self._ended.set)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, item: pb.ExchangeReply | BulkError | None) -> None:
        with self._lock:
            self._landed.append(item)
            if len(self._landed) > 1:
                return  # a drain is scheduled and not run yet
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            landed, self._landed = self._landed, []
        for item in landed:
            self._replies.put_nowait(item)

    def _failed(self, exc: Exception) -> BulkError:
        return BulkError(f"bulk exchange stream to {self._address} failed: {str(exc) or type(exc).__name__}")

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
