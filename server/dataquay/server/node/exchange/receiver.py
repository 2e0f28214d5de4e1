"""The receiving side of the per-epoch exchange: check, commit, acknowledge.

An offer is accepted only for ids this node owns in the offer's epoch, as its
own placement computes it, so a sender with a wrong view of the job cannot
fill this cache with samples nobody will ask it for. Payloads are checked
against their checksums and the admission rule (:mod:`dataquay.server.node.cache.admission`: the
manifest's length, from the node the plan says gives them; a value refused is
never acknowledged, so its sender keeps it and a reader gets it from the next
tier), committed in the store's large transactions, and acknowledged only
once committed: an acknowledgement is what allows the
sender to delete its copy. Reading the next message overlaps the commit of the
previous one. A sample larger than a message comes in pieces, and is checked
and committed once joined. Over the bulk path (:mod:`.calls`) the same
stream comes as :class:`ExchangeChunk` messages, whole values, no pieces.

Nothing sent is dropped for lack of room: each message reserves its bytes in
the cache before it is taken (:meth:`CacheSpace.reserve`), waiting while the cache
is full, which holds the sender back until this node has given away enough of
its own samples. A message that finds no room in ROOM_WAIT_SECONDS ends the
stream with RESOURCE_EXHAUSTED, and the sender offers its samples again later.
A message into a later epoch than this node's next takes only the room the
arrivals still to come before it leave (:class:`~.arrivals.Expected`).

Every node full at once can hold every exchange still: each waits for room
that only a delivery elsewhere frees. A receiver that waited BREAK_SECONDS
for room, while its own sender deleted nothing it gave away, has that sender
delete as many bytes of samples it gave away and its ranks read, not yet
shipped (through the :mod:`.broker`); their new owners read them from the
PFS, and every exchange moves again. A wait during which deletes go on is an
exchange at the pace of the ranks' reads, and is waited out.

A cache that cannot hold this node's share of the epoch is full of samples it
owns, and every sample it takes ahead of the sender's reads would be held
twice, in place of one that is cached nowhere else. Such a receiver asks for
samples only once the sender's ranks have read them (``after_reads``), so
the sender deletes each as it is acknowledged and the cluster's caches keep
as many distinct samples as they have room for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from dataquay.client.errors import PieceError
from dataquay.client.placement import MAX_EPOCH, MODES
from dataquay.client.wire.pieces import Joiner
from dataquay.client.wire.records import CHECKSUM_BYTES, decode_value
from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import (
    CacheFullError,
    DatasetReplacedError,
    DirectoryUnavailableError,
    ExchangeRefusedError,
    InvalidRequestError,
    SampleIdError,
)
from dataquay.server.node.cache.admission import ADMITTED, REASONS, Origin, gives, refusals
from dataquay.server.node.cache.manager import CacheManager
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.cluster.placements import Placement, Placements
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.exchange.arrivals import Expected
from dataquay.server.node.exchange.broker import ExchangeBroker
from dataquay.server.node.peers.bulk.frames import ExchangeChunk
from dataquay.server.planning.capacity import stored_bytes
from dataquay.server.registry import Registered

log = logging.getLogger("dataquay.exchange")

#: How long one message may wait for room in this cache.
ROOM_WAIT_SECONDS = 60.0
#: How long a message waits for room before this node deletes some of what
#: it gives away to make room.
BREAK_SECONDS = 1.0
#: Smallest message asked of a sender (one sample always goes).
MIN_MESSAGE_BYTES = 64 * 1024


@dataclass(frozen=True)
class _Taken:
    """One message's samples, queued for the writer under a reservation."""

    writes: list[PendingWrite]
    ticket: int
    reserved: int
    #: The store's count of unstored writes before these were queued.
    unstored_before: int

    @property
    def ids(self) -> np.ndarray:
        return np.fromiter((w.sample_id for w in self.writes), dtype=np.int64, count=len(self.writes))


class ExchangeReceiver:
    """Takes the samples other daemons hand to this node."""

    def __init__(
        self, store: Store, datasets: Datasets, placements: Placements, broker: ExchangeBroker, cache: CacheManager
    ) -> None:
        self.store = store
        #: Evicts datasets no live job pins for arrivals, and holds them to their user's quota.
        self.cache = cache
        self.datasets = datasets
        self.placements = placements
        self.broker = broker
        self.expected = Expected(store, placements, broker)
        self.received_samples = 0
        self.received_bytes = 0
        self.bad_checksums = 0
        #: Values refused by the admission rule, by reason (see :mod:`dataquay.server.node.cache.admission`).
        self.refused = dict.fromkeys(REASONS.values(), 0)
        self._readers: set[asyncio.Task[None]] = set()
        self._closing = False

    def close(self) -> None:
        """Ends every stream at the next message: a sender waiting for its
        ranks to read on would otherwise hold the daemon's shutdown for its
        whole grace period. What was taken is committed and acknowledged;
        the senders offer the rest again later."""
        self._closing = True
        for reader in self._readers:
            reader.cancel()

    async def receive(
        self, messages: AsyncIterator[pb.ExchangeMessage | ExchangeChunk]
    ) -> AsyncIterator[pb.ExchangeReply]:
        """Answers one exchange stream (see the Exchange RPC in cache.proto), over
        gRPC or the bulk path (whose chunks come as :class:`ExchangeChunk`).

        Raises:
            InvalidRequestError: the stream does not start with an offer.
            ExchangeRefusedError: the offer names ids this node does not own then.
        """
        first = await anext(aiter(messages), None)
        if not isinstance(first, pb.ExchangeMessage) or not first.HasField("offer"):
            raise InvalidRequestError("an exchange stream must start with an offer")
        offer = first.offer
        entry, offered, placement = await self._accept(offer)
        origin = await self._origin(offer, entry, placement)
        db, sizes = entry.record.cache_db, entry.manifest.sample_length
        # What the pass decodes would otherwise be sent again, uncommitted when this offer asks.
        await self.broker.coded_pass_over(offer.job, int(offer.epoch))
        await self.broker.ranks_waits_before(offer.job, int(offer.epoch))
        if MODES[placement.job.spec.mode].owners_move:
            await self.expected.track(offer.job, entry, int(offer.epoch))
        # Ids the sender does not give are refused as their values come, and count for nothing here.
        given = offered[gives(offered, origin)]
        async with self.broker.holding:
            held = given[self.store.cached_mask(db, given)]
            self.broker.answered_held(offer.job, int(offer.epoch), held)
        cached = np.isin(given, held)
        await self.store.grow_to_hold(stored_bytes(sizes[given[~cached]]))
        yield pb.ExchangeReply(
            held=held.tolist(),
            message_bytes=self._message_bytes(),
            after_reads=self.placements.short_of_share(placement, entry, self.store.capacity),
        )

        # Unbounded: the reservations and the sender's window bound it.
        commits: asyncio.Queue[_Taken | None] = asyncio.Queue()
        reader = asyncio.create_task(self._take_in(messages, entry, set(offered.tolist()), origin, offer, commits))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        if self._closing:
            reader.cancel()
        try:
            while (taken := await commits.get()) is not None:
                stored = await self._committed(db, taken)
                self.received_samples += len(stored)
                self.received_bytes += int(sizes[stored].sum())
                yield pb.ExchangeReply(held=stored.tolist())
            if not reader.cancelled():
                await reader
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            while not commits.empty():
                if (left := commits.get_nowait()) is not None:
                    await self.store.space.release(left.reserved)

    async def commit_decoded(self, entry: Registered, writes: list[PendingWrite]) -> np.ndarray:
        """Commits samples the coded pass decoded (their checksums already
        checked) under a reservation of their room, as a stream's are; returns
        their ids once committed."""
        db = entry.record.cache_db
        await self.store.open_dataset(db)
        writes = self._admitted(writes, entry, None, {"stream": "coded pass", "dataset": entry.record.name}, set())
        stored = await self._committed(db, await self._reserved(writes))
        self.received_samples += len(stored)
        self.received_bytes += sum(len(w.value) - CHECKSUM_BYTES for w in writes)
        return stored

    async def _committed(self, db: str, taken: _Taken) -> np.ndarray:
        """The ids of ``taken`` once all are committed. What the cache could
        not take after all (LMDB found no run of free pages long enough) is
        written again once it has room."""
        ids = taken.ids
        while True:
            try:
                await self.store.committed(taken.ticket)
            finally:
                await self.store.space.release(taken.reserved)
            if self.store.unstored_writes == taken.unstored_before:
                return ids  # no write at all was left out meanwhile: no need to look
            held = self.store.cached_mask(db, taken.ids)
            if held.all():
                return ids
            taken = await self._reserved([w for w, ok in zip(taken.writes, held.tolist()) if not ok])

    async def _reserved(self, writes: list[PendingWrite], keep_free: Callable[[], int] = lambda: 0) -> _Taken:
        """Queues ``writes`` under a reservation of their room, once the cache
        has it beyond the ``keep_free()`` bytes left to earlier arrivals."""
        need = stored_bytes(np.fromiter((len(w.value) - CHECKSUM_BYTES for w in writes), np.int64, len(writes)))
        for db in {w.db for w in writes}:
            self.cache.check_arrivals(db.decode(), sum(len(w.value) - CHECKSUM_BYTES for w in writes if w.db == db))
        space, waited = self.store.space, 0.0
        if (short := need + keep_free() - space.free) > 0:
            await self.cache.make_room(short)
        while not await space.reserve(need, BREAK_SECONDS, keep_free):
            waited += BREAK_SECONDS
            await self.broker.make_room(need)
            if waited < ROOM_WAIT_SECONDS:
                continue
            raise CacheFullError(
                f"no room in this node's cache for {need} bytes of exchanged samples within "
                f"{ROOM_WAIT_SECONDS:.0f} s ({self.store.space.free} bytes free); offer them again later"
            )
        try:
            unstored = self.store.unstored_writes
            return _Taken(writes, await self.store.put_all(writes), need, unstored)
        except BaseException:
            await self.store.space.release(need)
            raise

    def _admitted(
        self,
        writes: list[PendingWrite],
        entry: Registered,
        origin: Origin | None,
        stream: dict[str, object],
        logged: set[int],
    ) -> list[PendingWrite]:
        """Those of ``writes`` the admission rule lets in; the rest are counted,
        and logged once per stream and reason (``logged`` holds those logged)."""
        if not writes:
            return writes
        ids = np.fromiter((w.sample_id for w in writes), dtype=np.int64, count=len(writes))
        lengths = np.fromiter((len(w.value) - CHECKSUM_BYTES for w in writes), dtype=np.int64, count=len(writes))
        reasons = refusals(ids, lengths, entry.manifest.sample_length, origin)
        if reasons.any():
            self._refused(reasons, ids, entry, stream, logged)
        return [w for w, reason in zip(writes, reasons.tolist()) if reason == ADMITTED]

    def _refused(
        self, reasons: np.ndarray, ids: np.ndarray, entry: Registered, stream: dict[str, object], logged: set[int]
    ) -> None:
        """Counts the values ``reasons`` refuses; logs each reason once per stream."""
        for code, label in REASONS.items():
            refused = int((reasons == code).sum())
            if not refused:
                continue
            self.refused[label] += refused
            if code not in logged:
                logged.add(code)
                first = int(ids[reasons == code][0])
                log.warning(
                    "refused values not admitted to this cache; they stay with their sender",
                    extra={
                        "fields": {
                            **stream,
                            "reason": label,
                            "sample": first,
                            "manifest_length": int(entry.manifest.sample_length[first]),
                        }
                    },
                )

    def _check_pieces(self, piece: pb.Sample, entry: Registered, stream: dict[str, object], logged: set[int]) -> None:
        """Refuses a value in pieces whose whole length is not the manifest's
        before any of it is held: the stream ends, as for any bad piece."""
        ids = np.array([piece.id], dtype=np.int64)
        reasons = refusals(ids, np.array([int(piece.length) - CHECKSUM_BYTES]), entry.manifest.sample_length)
        if reasons.any():
            self._refused(reasons, ids, entry, stream, logged)
            raise InvalidRequestError(
                f"sample {piece.id} comes in pieces of a {int(piece.length) - CHECKSUM_BYTES}-byte payload; "
                f"the manifest says {int(entry.manifest.sample_length[piece.id])} bytes"
            )

    async def _origin(self, offer: pb.ExchangeOffer, entry: Registered, placement: Placement) -> Origin:
        """Who the plan says may send this offer's ids: its named sender, if
        that node held them the epoch before."""
        nodes = placement.nodes
        sender = nodes.index(offer.sender) if offer.sender in nodes else -1
        before = None
        if placement.epoch > 0:
            before = (await self.placements.placement(offer.job, entry, placement.epoch - 1)).holders
        return Origin(sender, placement.node_index, before, placement.holders)

    def _message_bytes(self) -> int:
        """A message size that fits this cache's room a few times over: the
        sender keeps a window of messages in flight, and others send too."""
        return max(MIN_MESSAGE_BYTES, self.store.space.free // 8)

    async def _accept(self, offer: pb.ExchangeOffer) -> tuple[Registered, np.ndarray, Placement]:
        entry = await self.datasets.entry(offer.dataset)
        if offer.manifest_id and offer.manifest_id != entry.record.manifest_id:
            raise DatasetReplacedError(f"exchange for another version of dataset {offer.dataset!r} than this node has")
        ids = np.fromiter(offer.ids, dtype=np.uint64, count=len(offer.ids))
        n = entry.manifest.num_samples
        if len(ids) and int(ids.max()) >= n:
            raise SampleIdError(
                f"offered sample id {int(ids.max())} out of range for dataset {offer.dataset!r} (N={n})"
            )
        ids = ids.astype(np.int64)
        if offer.epoch > MAX_EPOCH:
            raise InvalidRequestError(
                f"offered epoch {offer.epoch} is beyond the last one a job may reach ({MAX_EPOCH})"
            )
        placement = await self.placements.placement(offer.job, entry, int(offer.epoch))
        foreign = int((placement.holders[ids] != placement.node_index).sum())
        if foreign:
            # The sender may have the directory's later word on the job's absent nodes.
            with contextlib.suppress(DirectoryUnavailableError):
                await self.placements.link.refresh_job(offer.job)
            placement = await self.placements.placement(offer.job, entry, int(offer.epoch))
            foreign = int((placement.holders[ids] != placement.node_index).sum())
        if foreign:
            raise ExchangeRefusedError(
                f"{foreign} of {len(ids)} offered ids are not held by this node in epoch {offer.epoch} "
                f"of job {offer.job!r}"
            )
        await self.store.open_dataset(entry.record.cache_db)
        return entry, ids, placement

    async def _take_in(
        self,
        messages: AsyncIterator[pb.ExchangeMessage | ExchangeChunk],
        entry: Registered,
        offered: set[int],
        origin: Origin,
        offer: pb.ExchangeOffer,
        commits: asyncio.Queue[_Taken | None],
    ) -> None:
        """Checks each message's samples, reserves their room and queues them
        for the writer; they go on to be acknowledged once committed. A sample
        sent in pieces is queued once its last piece is in."""
        name = entry.record.cache_db.encode()
        lengths = entry.manifest.sample_length
        joiner = Joiner("the exchange's sender")
        stream: dict[str, object] = {"stream": "exchange", "sender": offer.sender, "dataset": entry.record.name}
        job, epoch = offer.job, int(offer.epoch)
        logged: set[int] = set()
        try:
            async for message in messages:
                values: list[tuple[int, bytes | memoryview]]
                # A bulk chunk's checksums were checked in its connection's thread.
                checked = isinstance(message, ExchangeChunk)
                try:
                    if isinstance(message, ExchangeChunk):
                        joiner.check_done()
                        values = message.samples
                        self.bad_checksums += message.bad_checksums
                    elif message.HasField("piece"):
                        piece = message.piece
                        if piece.id not in offered:
                            raise InvalidRequestError(f"sample {piece.id} was not in the exchange offer")
                        self._check_pieces(piece, entry, stream, logged)
                        joined = joiner.add(
                            piece.id, piece.offset, piece.length, piece.value, int(lengths[piece.id]) + CHECKSUM_BYTES
                        )
                        if joined is None:
                            continue
                        values = [(piece.id, joined)]
                    else:
                        joiner.check_done()
                        values = [(sample.id, sample.value) for sample in message.samples]
                except PieceError as exc:
                    raise InvalidRequestError(str(exc)) from None
                writes = []
                for sample_id, value in values:
                    if sample_id not in offered:
                        raise InvalidRequestError(f"sample {sample_id} was not in the exchange offer")
                    if not checked and decode_value(value) is None:
                        self.bad_checksums += 1
                        continue
                    writes.append(PendingWrite(name, sample_id, value, reserved=True))
                writes = self._admitted(writes, entry, origin, stream, logged)
                commits.put_nowait(await self._reserved(writes, lambda: self.expected.room_before(job, epoch)))
        finally:
            commits.put_nowait(None)
