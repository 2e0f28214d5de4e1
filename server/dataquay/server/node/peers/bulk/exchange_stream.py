"""One exchange stream on a bulk connection: the sender's chunks read off the
socket in the connection's thread, the receiver's replies sent back from the
event loop.

The thread reads each chunk's body into one buffer and checks its samples'
checksums there, off the event loop, into a short queue (a few chunks: a
sender that outruns the cache's commits waits on its socket); the exchange's
receiver takes them on the loop, and its replies go out from the loop as far
as the socket takes them at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import AsyncIterator, Callable

import numpy as np
from google.protobuf.message import DecodeError

from dataquay.client.wire.record_loops import values_intact
from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import DataquayError
from dataquay.server.node.peers.bulk.frames import (
    CHUNK,
    END,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_SAMPLES,
    OK,
    REPLY,
    SAMPLE,
    BulkError,
    ExchangeChunk,
    error_frame,
    kernel_timeouts,
    parse_chunk,
    receive_timeout,
    recv_all,
    recv_bytes,
    recv_exactly,
    send_buffers,
    send_now,
)

#: Exchange chunks a connection's thread may have queued for the receiver at once.
EXCHANGE_QUEUE = 4

#: Answers one exchange stream (ExchangeReceiver.receive).
Receive = Callable[[AsyncIterator[pb.ExchangeMessage | ExchangeChunk]], AsyncIterator[pb.ExchangeReply]]


class ExchangeStream:
    """One sender's exchange stream, from its offer to its END.

    Args:
        loop: the daemon's event loop, where the receiver runs.
        receive: the receiver.
        max_value: the largest cache value the sender may send.
        taken_in: called on the loop with the samples of each chunk the receiver takes.
        idle: seconds the sender may send nothing between chunks (it may
            wait long for its ranks to read on).
        stall: seconds one chunk may make no progress.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        receive: Receive,
        max_value: int,
        taken_in: Callable[[int], None],
        idle: float,
        stall: float,
    ) -> None:
        self.loop = loop
        self.receive = receive
        self.max_value = max_value
        self.taken_in = taken_in
        self.idle = idle
        self.stall = stall

    def run(self, sock: socket.socket, offer: bytes) -> None:
        """Feeds the stream's chunks to the receiver until the sender's END;
        runs in the connection's thread.

        Raises:
            BulkError: the offer or a chunk is malformed.
        """
        try:
            first = pb.ExchangeMessage.FromString(offer)
        except DecodeError:
            raise BulkError("the exchange offer is not a valid message") from None
        kernel_timeouts(sock, self.idle, self.stall)
        inbox: asyncio.Queue[pb.ExchangeMessage | ExchangeChunk | None] = asyncio.Queue()
        slots = threading.Semaphore(EXCHANGE_QUEUE)
        answering = asyncio.run_coroutine_threadsafe(self._answer(sock, first, inbox, slots), self.loop)
        try:
            self._take_chunks(sock, inbox, slots, answering)
        finally:
            self.loop.call_soon_threadsafe(inbox.put_nowait, None)
        try:
            answering.result()
        except concurrent.futures.CancelledError:
            pass

    def _take_chunks(
        self,
        sock: socket.socket,
        inbox: asyncio.Queue[pb.ExchangeMessage | ExchangeChunk | None],
        slots: threading.Semaphore,
        answering: concurrent.futures.Future[None],
    ) -> None:
        header = bytearray(SAMPLE.size)
        largest = max(MAX_CHUNK_BYTES, SAMPLE.size + self.max_value)
        while True:
            receive_timeout(sock, self.idle)  # a sender may wait long for its ranks to read on
            recv_all(sock, [memoryview(header)])
            status, count, body_bytes, _ = SAMPLE.unpack(header)
            if status == END:
                return
            most = min(largest, count * (SAMPLE.size + self.max_value))
            if status != CHUNK or count > MAX_CHUNK_SAMPLES or body_bytes > most:
                raise BulkError(f"bad exchange frame: status {status}, {count} samples, {body_bytes} bytes")
            receive_timeout(sock, self.stall)
            samples: list[tuple[int, bytes | memoryview]]
            if body_bytes:
                body = np.empty(body_bytes, dtype=np.uint8).data  # not zeroed first, as a bytearray is
                recv_all(sock, [body])
                samples = parse_chunk(body, count, self.max_value)
            else:
                samples = self._frames_one_by_one(sock, count)
            intact = values_intact([value for _, value in samples])
            good = [sample for sample, ok in zip(samples, intact) if ok]
            while not slots.acquire(timeout=1.0):
                if answering.done():
                    raise BulkError("the receiver ended the exchange stream")
            self.loop.call_soon_threadsafe(inbox.put_nowait, ExchangeChunk(good, len(samples) - len(good)))

    def _frames_one_by_one(self, sock: socket.socket, count: int) -> list[tuple[int, bytes | memoryview]]:
        """A chunk's sample frames, from a sender that sends no body length."""
        header = bytearray(SAMPLE.size)
        samples: list[tuple[int, bytes | memoryview]] = []
        for _ in range(count):
            recv_exactly(sock, memoryview(header))
            status, sample_id, length, _ = SAMPLE.unpack(header)
            if status != OK or length > self.max_value:
                raise BulkError(f"bad exchange sample frame: status {status}, {length} bytes")
            samples.append((sample_id, recv_bytes(sock, length)))
        return samples

    async def _answer(
        self,
        sock: socket.socket,
        first: pb.ExchangeMessage,
        inbox: asyncio.Queue[pb.ExchangeMessage | ExchangeChunk | None],
        slots: threading.Semaphore,
    ) -> None:
        """Runs the receiver over the stream's messages and sends its replies back."""
        loop = asyncio.get_running_loop()

        async def messages() -> AsyncIterator[pb.ExchangeMessage | ExchangeChunk]:
            yield first
            while (item := await inbox.get()) is not None:
                slots.release()
                if isinstance(item, ExchangeChunk):
                    self.taken_in(len(item.samples))
                yield item

        try:
            async for reply in self.receive(messages()):
                data = reply.SerializeToString()
                await _send_from_loop(loop, sock, [SAMPLE.pack(REPLY, 0, len(data), 0), data])
            await _send_from_loop(loop, sock, [SAMPLE.pack(END, 0, 0, 0)])
        except DataquayError as exc:
            await _send_from_loop(loop, sock, error_frame(exc))
        except OSError:
            pass  # the sender is gone; its thread here sees it too


async def _send_from_loop(loop: asyncio.AbstractEventLoop, sock: socket.socket, frames: list[bytes]) -> None:
    """Sends small frames from the event loop as far as the socket takes them
    at once (a reply nearly always goes whole), the rest from a thread: a
    thread hand-off per reply costs more than the reply's bytes."""
    rest = send_now(sock, frames)
    if rest:
        await loop.run_in_executor(None, send_buffers, sock, rest)
