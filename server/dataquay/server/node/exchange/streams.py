"""The sending side's streams: how a run's give-aways reach one receiver.

Apart from :mod:`.sender`, which decides when a run starts, what it gives
away and when a delivered sample is deleted, this is what goes on the wire:
an offer of pending ids, then their payloads in chunks, a window of them
awaiting acknowledgement, over the receiver's bulk listener or the Exchange
RPC (:mod:`.calls`), retried with back-off while the receiver is unreachable.
The outbox (:mod:`.outbox`) keeps the books of what each chunk became.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import grpc
import numpy as np

from dataquay.client.wire.status_codes import UNREACHABLE, code_of_number
from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import DataquayError
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.placements import Placement
from dataquay.server.node.exchange.calls import BulkExchangeCall, ExchangeCall, GrpcExchangeCall
from dataquay.server.node.exchange.outbox import PENDING, REFUSED, UNAVAILABLE, acknowledged
from dataquay.server.node.exchange.positions import ReadPositions
from dataquay.server.node.peers.bulk.client import BulkRefusedError
from dataquay.server.node.peers.bulk.frames import EXCHANGE_UNAVAILABLE, BulkError
from dataquay.server.node.peers.reads import Peers
from dataquay.server.ratelimit import TokenBucket
from dataquay.server.registry import Registered

if TYPE_CHECKING:
    from dataquay.server.node.exchange.sender import ExchangeRun

log = logging.getLogger("dataquay.exchange")

#: Payload bytes a chunk holds at most (less where the receiver asks for less):
#: each chunk costs both event loops and both ends' threads a round of hand-offs
#: (16 MiB moved 1.2x the bytes a second of 8 MiB on two cores, bench/experiments/exchange_rounds.py), and a
#: stream holds up to WINDOW of them in the receiver's memory.
CHUNK_BYTES = 16 << 20
#: A stream's first chunk, each next one twice the last up to CHUNK_BYTES:
#: the receiver's first commit, which everything after it waits on, then
#: starts once a small chunk is in rather than a whole large one.
OPENING_CHUNK_BYTES = 1 << 20
CHUNK_ITEMS = 2048
#: Chunks sent and not yet acknowledged, per stream.
WINDOW = 4
#: Ids one offer (one stream) may name; more go in later streams.
OFFER_IDS = 1 << 16
RETRY_SECONDS = (0.5, 30.0)
#: Least time between two looks at what may be deleted or sent on, however
#: often reads and acknowledgements come in.
REACT_SECONDS = 0.05
#: Longest wait for news of reads or acknowledgements before looking again.
POLL_SECONDS = 0.25
#: Receiver errors worth another try; any other means the receiver will not take them.
RETRYABLE = UNREACHABLE | {
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
}


class News:
    """Ranks that read on and receivers that acknowledge: what waits for
    room to send on, or for samples to delete, wakes on."""

    def __init__(self) -> None:
        self._reads_or_acks = asyncio.Event()

    def tell(self) -> None:
        """Wakes everything waiting in :meth:`wait`."""
        self._reads_or_acks.set()
        self._reads_or_acks = asyncio.Event()

    async def wait(self) -> None:
        """Returns after the next :meth:`tell` (POLL_SECONDS at most), then
        REACT_SECONDS more, so that a burst of news is looked at once."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reads_or_acks.wait(), POLL_SECONDS)
        await asyncio.sleep(REACT_SECONDS)


class ExchangeStreams:
    """Ships runs' samples to their receivers, one stream per receiver at a time.

    Args:
        node_name: this node.
        bandwidth: cap on bytes sent per second, over all streams; 0 = none.
        news: told of every acknowledgement; a stream short of what it may
            send waits on it.
    """

    def __init__(
        self,
        node_name: str,
        store: Store,
        link: DirectoryLink,
        peers: Peers,
        positions: ReadPositions,
        news: News,
        bandwidth: int = 0,
    ) -> None:
        self.node_name = node_name
        self.store = store
        self.link = link
        self.peers = peers
        self.positions = positions
        self.news = news
        # A tenth of a second of burst: a bucket that filled while no exchange
        # ran would otherwise let a whole chunk pass above the cap.
        self.bucket = TokenBucket(bandwidth) if bandwidth else None
        self.sent_samples = 0
        self.sent_bytes = 0

    async def ship_to(
        self, run: ExchangeRun, entry: Registered, after: Placement, receiver: int, limit: asyncio.Semaphore
    ) -> None:
        """Everything ``run`` gives ``receiver``, retried with back-off while it is unreachable."""
        node = after.nodes[receiver]
        delay = RETRY_SECONDS[0]
        while len(run.outbox.pending(receiver)):
            try:
                async with limit:
                    await self._stream(run, entry, node, receiver)
                delay = RETRY_SECONDS[0]
                if run.error.startswith(f"{node}:"):
                    run.error = ""
                continue
            except (grpc.aio.AioRpcError, BulkRefusedError) as exc:
                code, details = _status(exc)
                if code not in RETRYABLE:
                    run.error = f"{node}: {code.name}: {details}"
                    log.warning(
                        "receiver refused the exchange; its samples stay here",
                        extra={
                            "fields": {
                                "job": run.job,
                                "epoch": run.epoch,
                                "peer": node,
                                "code": code.name,
                                "error": details,
                            }
                        },
                    )
                    run.outbox.unsettled(run.outbox.pending(receiver), REFUSED)
                    return
                run.error = f"{node}: {code.name}"
            except DataquayError as exc:
                run.error = f"{node}: {exc}"
            except asyncio.InvalidStateError:  # written to after the receiver ended the call
                run.error = f"{node}: the stream ended"
            log.info(
                "exchange stream to a peer failed; retrying",
                extra={
                    "fields": {
                        "job": run.job,
                        "epoch": run.epoch,
                        "peer": node,
                        "error": run.error,
                        "retry_in_s": delay,
                    }
                },
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_SECONDS[1])

    def _call(self, node: str, address: str, bulk_address: str) -> ExchangeCall:
        """The stream to ``node``: over its bulk listener when it has one this
        node may use (no TLS, no recent failure), else the Exchange RPC."""
        bulk = self.peers.bulk
        if bulk_address and bulk is not None and bulk.tls is None and self.peers.bulk_usable(bulk_address):
            return BulkExchangeCall(bulk, bulk_address, self.store)
        return GrpcExchangeCall(self.peers.stub(node, address).Exchange(), self.store)

    async def _stream(self, run: ExchangeRun, entry: Registered, node: str, receiver: int) -> None:
        """One stream: an offer of up to OFFER_IDS pending ids, then their payloads."""
        address = await self.link.address_of(node)
        if not address or self.link.is_down(node):
            raise DataquayError(f"node {node} is not reachable (down or unknown to the directory)")
        outbox, db, sizes = run.outbox, entry.record.cache_db, entry.manifest.sample_length
        offered, offered_upto = outbox.offer(receiver, OFFER_IDS)
        bulk_address = self.peers.bulk_address(node, self.link.bulk_address_of(node))
        call = self._call(node, address, bulk_address)
        in_flight: deque[np.ndarray] = deque()
        window = asyncio.Semaphore(WINDOW)

        async def take_acks() -> None:
            try:
                while (reply := await call.read()) is not None:
                    if not in_flight:
                        raise DataquayError(f"node {node} answered more chunks than it was sent")
                    chunk = in_flight.popleft()
                    held = acknowledged(chunk, reply.held)
                    if not run.first_delivery and len(held):
                        run.first_delivery = time.monotonic() - run.started
                    self.sent_bytes += outbox.delivered(held)
                    self.sent_samples += len(held)
                    self.news.tell()
                    if len(held) != len(chunk):
                        # Those this cache does not hold went unsent; the others the receiver refused.
                        missed = np.setdiff1d(chunk, held)
                        here = self.store.cached_mask(db, missed)
                        outbox.unsettled(missed[~here], UNAVAILABLE)
                        outbox.unsettled(missed[here], REFUSED)
                    window.release()
            finally:
                for _ in range(WINDOW):  # wake the sending loop, which then sees the stream is over
                    window.release()

        acks: asyncio.Task[None] | None = None
        try:
            await call.offer(
                pb.ExchangeOffer(
                    job=run.job,
                    dataset=entry.record.name,
                    manifest_id=entry.record.manifest_id,
                    epoch=run.epoch,
                    sender=self.node_name,
                    ids=offered.tolist(),
                )
            )
            first = await call.read()
            if first is None:
                raise DataquayError(f"node {node} ended the exchange stream without answering")
            outbox.delivered(acknowledged(offered, first.held), sent=False)
            most = min(CHUNK_BYTES, first.message_bytes or CHUNK_BYTES)
            chunk_bytes = min(OPENING_CHUNK_BYTES, most)
            after_reads = first.after_reads
            acks = asyncio.get_running_loop().create_task(take_acks())
            while True:
                await window.acquire()
                if acks.done():
                    await acks
                    raise DataquayError(f"node {node} ended the exchange stream early")
                ids = outbox.take(
                    receiver,
                    chunk_bytes,
                    CHUNK_ITEMS,
                    upto=offered_upto,
                    read_upto=run.read_upto(self.positions) if after_reads else None,
                )
                if not len(ids):
                    if not outbox.pending_upto(receiver, offered_upto):
                        break
                    window.release()  # the receiver is short: wait for this node's ranks to read on
                    await self.news.wait()
                    continue
                if self.bucket is not None:
                    await asyncio.sleep(self.bucket.reserve(int(sizes[ids].sum())))
                in_flight.append(ids)
                await call.send(db, ids)
                chunk_bytes = min(2 * chunk_bytes, most)
            await call.done_writing()
            await acks
        except BulkError as exc:
            refused = isinstance(exc, BulkRefusedError)
            if bulk_address and (not isinstance(exc, BulkRefusedError) or exc.code == EXCHANGE_UNAVAILABLE):
                if refused or not await self.peers.rediscovered(node, address, bulk_address):
                    self.peers.bulk_failed(bulk_address, node, exc)
            raise
        finally:
            if acks is not None:
                acks.cancel()
                await asyncio.gather(acks, return_exceptions=True)
            for chunk in in_flight:
                outbox.unsettled(chunk, PENDING)
            await call.close()


def _status(exc: grpc.aio.AioRpcError | BulkRefusedError) -> tuple[grpc.StatusCode, str]:
    """The status a receiver ended a stream with, over either transport."""
    if isinstance(exc, BulkRefusedError):
        return code_of_number(exc.code), str(exc)
    return exc.code(), exc.details() or ""
