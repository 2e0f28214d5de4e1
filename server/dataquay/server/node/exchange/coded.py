"""The coded pass of a job's exchange (``--exchange-coding coded|uber``), before its uncoded streams.

Every node of the job freezes the ids of the dataset it caches, multicasts
that snapshot to the others and, once it has everyone's, plans the same
packets (:func:`.coding.plan`) from the same caches and new owners. It then
multicasts the packets it sends (fetching first, from the node the plan
names, the one part it lacks), and decodes from the packets it receives the
samples it owns next and lacks. A packet is the XOR of whole cache values,
so a decoded value carries its own xxh3 and is checked like any other
before the store commits it, under a reservation of its room. The pass's
datagrams are sealed under a key of its random id (:mod:`.mcast_seal`,
:mod:`.pass_ids`). The snapshots travel on the first address of the
daemon's multicast pool, which every node of the pass joins; each set of
a packet's receivers on an address of its own where the pool has room
(:func:`.coded_packets.slots`), joined only by those receivers, so a node
hears the packets it decodes and not the others'. Once its own part is
done (its packets acknowledged by every member, its own decoded), a node
keeps answering for as long as senders still announce tails to it
(:func:`linger`): an acknowledgement of its that was lost would otherwise
leave its sender waiting for the pass's timeout. A whole packet that the
plan does not have its sender send this node, or that has the wrong
length, is dropped and counted.

The pass is an optimisation only: whatever it does not deliver (a peer
that is down, restarted, or late beyond the timeouts; a part deleted since
its snapshot) the uncoded streams that follow ship, and their offers learn
what the receivers already hold, so nothing is sent twice. The uncoded
exchange's guarantees therefore hold unchanged: the old owner deletes only
what the new owner acknowledged as committed, and a restarted daemon redoes
its part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES, decode_value
from dataquay.server.errors import DataquayError
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.cluster.placements import Placement
from dataquay.server.node.exchange import coded_packets, coding
from dataquay.server.node.exchange.broker import ExchangeBroker
from dataquay.server.node.exchange.mcast import Channel, MulticastEndpoint, interface_mtu, payload_bytes
from dataquay.server.node.exchange.receiver import ExchangeReceiver
from dataquay.server.registry import Registered

log = logging.getLogger("dataquay.exchange")

#: How long a node waits for every peer's snapshot before it leaves the exchange to the uncoded streams.
SNAPSHOT_SECONDS = 20.0
#: How long the packets may take once planned, before the uncoded streams take over.
PASS_SECONDS = 60.0
#: Decoded samples committed together.
COMMIT_BATCH = 64
#: Batches handed to the store and not yet committed, at most (with the store's reservations, what caps memory).
COMMITS_IN_FLIGHT = 4
#: Whole packets received and not yet decoded, at most; more are dropped and resent.
READY_PACKETS = 2 * COMMIT_BATCH
#: The group of the snapshots; the plan's groups follow it.
SNAPSHOTS = 0
#: A node done with its part keeps answering until it heard of no stream of the pass for this long.
LINGER_IDLE_SECONDS = 1.0


@dataclass
class CodedProgress:
    """One node's coded pass.

    Attributes:
        packets_sent: packets and fetches this node multicast.
        bytes_sent: their bytes (a packet as long as its longest part).
        samples_decoded: samples this node decoded, checked and committed.
        datagrams_received: datagrams that reached this node from other nodes of the pass
            (its groups' data and tails, the acknowledgements of its own streams).
        bytes_received: their bytes (UDP payloads): what the fabric delivered here.
        foreign_datagrams: of those, datagrams of streams this node does not decode.
        note: why the pass ended early or did not run, if it did.
    """

    packets_sent: int = 0
    bytes_sent: int = 0
    samples_decoded: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    foreign_datagrams: int = 0
    note: str = ""

    def heard(self, endpoint: MulticastEndpoint) -> None:
        """Takes the counts of what reached ``endpoint``."""
        stats = endpoint.stats
        self.datagrams_received, self.bytes_received = stats.datagrams_received, stats.bytes_received
        self.foreign_datagrams = stats.foreign_datagrams


@dataclass(frozen=True)
class PassTransport:
    """Where and how one pass's datagrams travel.

    Attributes:
        channel: the multicast address, port and interface.
        token: the node token the pass key derives from.
        pass_id: the pass's random id, agreed over the TCP path (:mod:`.pass_ids`).
        others: ids of this daemon's other passes under way (their datagrams are not counted as drops).
        on_drop: told the reason of each datagram or packet dropped (the daemon's metric).
        rate: bytes/s this node multicasts at most (0: uncapped).
    """

    channel: Channel
    token: str
    pass_id: int
    others: Collection[int] = ()
    on_drop: Callable[[str], None] | None = None
    rate: int = 0


async def coded_pass(
    transport: PassTransport,
    store: Store,
    receiver: ExchangeReceiver,
    broker: ExchangeBroker,
    entry: Registered,
    job: str,
    scheme: str,
    after: Placement,
    progress: CodedProgress,
) -> MulticastEndpoint | None:
    """Runs this node's part of the coded pass into ``after``'s epoch (module docstring) on an
    endpoint of its own (its node id is this node's rank in the job); offers into that epoch
    wait for it (``broker``). Never raises but for cancellation: what it leaves, the streams
    ship; a failure is logged and noted in ``progress``. Returns the endpoint, still open, for
    the caller to :func:`linger` on (None after a failure, its endpoint closed)."""
    channel = transport.channel
    with broker.coded_pass(job, after.epoch):
        endpoint = MulticastEndpoint(
            after.node_index,
            channel,
            transport.token,
            payload_bytes(interface_mtu(channel.interface)),
            rate=transport.rate or None,
            max_ready=READY_PACKETS,
            pass_id=transport.pass_id,
            others=transport.others,
            on_drop=transport.on_drop,
        )
        try:
            await endpoint.start()
            await _coded_pass(endpoint, store, receiver, entry, job, scheme, after, progress)
        except BaseException as exc:
            endpoint.close()
            if not isinstance(exc, Exception):
                raise
            progress.note = _failure(exc, channel, job, after.epoch)
            return None
        progress.heard(endpoint)
        return endpoint


def _failure(exc: Exception, channel: Channel, job: str, epoch: int) -> str:
    """The note of a pass that ``exc`` ended."""
    if isinstance(exc, OSError):
        return f"multicast on {channel.group}:{channel.port} via {channel.interface} failed: {exc}"
    if isinstance(exc, DataquayError):
        return f"stopped: {exc}"
    # The pass only saves traffic: its failure leaves the job to the streams.
    log.exception(
        "coded exchange pass failed; the streams ship its samples",
        extra={"fields": {"job": job, "epoch": epoch}},
        exc_info=exc,
    )
    return f"failed: {type(exc).__name__}: {exc}"


async def linger(endpoint: MulticastEndpoint, progress: CodedProgress) -> None:
    """Keeps ``endpoint`` answering its pass's senders until none has been heard of for
    :data:`LINGER_IDLE_SECONDS` (:data:`PASS_SECONDS` at most), then closes it."""
    try:
        with contextlib.suppress(TimeoutError):
            await endpoint.linger(LINGER_IDLE_SECONDS, PASS_SECONDS)
    finally:
        progress.heard(endpoint)
        endpoint.close()


async def _coded_pass(
    endpoint: MulticastEndpoint,
    store: Store,
    receiver: ExchangeReceiver,
    entry: Registered,
    job: str,
    scheme: str,
    after: Placement,
    progress: CodedProgress,
) -> None:
    me, nodes = after.node_index, len(after.nodes)
    db, num_samples = entry.record.cache_db, entry.manifest.num_samples
    inbox: asyncio.Queue[tuple[int, int, int, bytes]] = asyncio.Queue()
    peers = [m for m in range(nodes) if m != me]
    if not peers:
        return
    opened: set[int] = set()
    try:
        mine = np.packbits(store.cached_mask(db, np.arange(num_samples, dtype=np.int64))).tobytes()
        await endpoint.join(SNAPSHOTS)
        for peer in peers:
            endpoint.expect(peer, SNAPSHOTS, inbox)
        endpoint.open_group(SNAPSHOTS, frozenset(peers))
        opened.add(SNAPSHOTS)
        await endpoint.send(SNAPSHOTS, me, mine)
        snapshots = {me: mine}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SNAPSHOT_SECONDS):
                while len(snapshots) < nodes:
                    sender, _, packet_id, snapshot = await inbox.get()
                    if sender in snapshots:
                        endpoint.drop("duplicate")
                    elif packet_id != sender or len(snapshot) != len(mine):
                        endpoint.drop("malformed")
                    else:
                        snapshots[sender] = snapshot
        if len(snapshots) < nodes:
            progress.note = f"{nodes - len(snapshots)} peers sent no snapshot within {SNAPSHOT_SECONDS:.0f} s"
            return
        caches = [
            np.flatnonzero(np.unpackbits(np.frombuffer(snapshots[m], np.uint8))[:num_samples]) for m in range(nodes)
        ]
        sizes = entry.manifest.sample_length.astype(np.int64) + CHECKSUM_BYTES
        started = time.monotonic()
        packets = await asyncio.get_running_loop().run_in_executor(
            None, lambda: coding.plan(coding.holder_bits(caches, num_samples), after.owners, scheme, sizes)
        )
        log.info(
            "coded exchange planned",
            extra={
                "fields": {
                    "job": job,
                    "epoch": after.epoch,
                    "scheme": scheme,
                    "packets": len(packets),
                    "plan_seconds": round(time.monotonic() - started, 3),
                }
            },
        )
        sent = coded_packets.streams(packets)
        slots = coded_packets.slots(sent, endpoint.channel.pool)
        sends = np.flatnonzero(sent.senders == me).tolist()
        for i in sends:
            group = SNAPSHOTS + 1 + int(sent.groups[i])
            if group not in opened:
                endpoint.open_group(group, sent.members[i], int(slots[i]))
                opened.add(group)
        receiving = {
            i: (int(sent.senders[i]), SNAPSHOTS + 1 + int(sent.groups[i]))
            for i, m in enumerate(sent.members)
            if me in m and sent.senders[i] != coding.PFS
        }
        # Joined before anything is sent here: a peer's first datagrams find this node listening.
        for key, slot in {receiving[i]: int(slots[i]) for i in receiving}.items():
            await endpoint.join(slot)
            endpoint.expect(*key, inbox)
        async with asyncio.timeout(PASS_SECONDS):
            await _run(endpoint, store, receiver, entry, packets, sent, me, sends, receiving, inbox, progress)
    except TimeoutError:
        progress.note = f"packets still missing after {PASS_SECONDS:.0f} s"
    finally:
        # Its own streams end here; those it receives stay expected, for :func:`linger` to answer.
        for group in opened:
            endpoint.close_group(group)


async def _run(
    endpoint: MulticastEndpoint,
    store: Store,
    receiver: ExchangeReceiver,
    entry: Registered,
    packets: coding.Packets,
    sent: coded_packets.Streams,
    me: int,
    sends: list[int],
    receiving: dict[int, tuple[int, int]],
    inbox: asyncio.Queue[tuple[int, int, int, bytes]],
    progress: CodedProgress,
) -> None:
    """Sends this node's packets and fetches, and decodes the ``receiving`` ones (send -> its (sender, group))."""
    db, num_packets = entry.record.cache_db, len(packets)
    lengths = entry.manifest.sample_length.astype(np.int64) + CHECKSUM_BYTES
    fetched = {int(p): asyncio.Event() for p in packets.fetch_packets if packets.senders[p] == me}
    parts_of: dict[int, bytes] = {}
    name = db.encode()
    pending: list[PendingWrite] = []

    commits: list[asyncio.Task[None]] = []
    in_flight = asyncio.Semaphore(COMMITS_IN_FLIGHT)

    async def committed(writes: list[PendingWrite]) -> None:
        try:
            stored = await receiver.commit_decoded(entry, writes)
            progress.samples_decoded += len(stored)
        finally:
            in_flight.release()

    async def commit(force: bool = False) -> None:
        """Hands a batch to the store without waiting for its commit (the store syncs in large transactions)."""
        if pending and (force or len(pending) >= COMMIT_BATCH):
            await in_flight.acquire()
            commits.append(asyncio.create_task(committed(list(pending))))
            pending.clear()

    def decoded(sample: int, value: bytes) -> None:
        if decode_value(value) is None:
            receiver.bad_checksums += 1
            return
        pending.append(PendingWrite(name, sample, value, reserved=True))

    async def send_all() -> None:
        # Fetches first, then packets that wait on none: a wait on a peer's fetch never blocks its own.
        for i in sorted(sends, key=lambda i: (i < num_packets, i in fetched)):
            if i >= num_packets:
                value = store.get_values(db, [int(packets.fetch_samples[i - num_packets])])[0]
            else:
                if i in fetched:
                    await fetched[i].wait()
                ids = packets.samples[packets.start[i] : packets.start[i + 1]].tolist()
                held = [parts_of.get(sample, v) for sample, v in zip(ids, store.get_values(db, ids), strict=True)]
                values = [v for v in held if v is not None]
                value = coded_packets.xor_encode(values) if len(values) == len(held) else None
            if value is None:
                continue  # deleted since the snapshot: the uncoded streams deliver it
            await endpoint.send(SNAPSHOTS + 1 + int(sent.groups[i]), i, value)
            progress.packets_sent += 1
            progress.bytes_sent += len(value)
        # The snapshot too: a peer that lost it waits for it before it plans.
        await endpoint.flush({SNAPSHOTS, *(SNAPSHOTS + 1 + int(sent.groups[i]) for i in sends)})

    def length(i: int) -> int:
        """Bytes of send ``i``: a fetch's sample, a packet's longest part."""
        if i >= num_packets:
            return int(lengths[packets.fetch_samples[i - num_packets]])
        return int(lengths[packets.samples[packets.start[i] : packets.start[i + 1]]].max())

    async def receive_all() -> None:
        left = dict(receiving)
        while left:
            sender, group, i, packet = await inbox.get()
            if left.get(i) != (sender, group):
                endpoint.drop(
                    "duplicate" if receiving.get(i) == (sender, group) or group == SNAPSHOTS else "unexpected_packet"
                )
                continue
            del left[i]
            if len(packet) != length(i):
                endpoint.drop("malformed")
                continue
            if i >= num_packets:
                fetch = i - num_packets
                sample = int(packets.fetch_samples[fetch])
                parts_of[sample] = packet
                decoded(sample, packet)
                fetched[int(packets.fetch_packets[fetch])].set()
            else:
                lo, hi = int(packets.start[i]), int(packets.start[i + 1])
                parts, decoders = packets.samples[lo:hi].tolist(), packets.decoders[lo:hi].tolist()
                own = parts[decoders.index(me)]
                others = store.get_values(db, [p for p in parts if p != own])
                known = [v for v in others if v is not None]
                if len(known) == len(others):
                    decoded(own, coded_packets.xor_decode(packet, known, int(lengths[own])))

            await commit()
        await commit(force=True)

    try:
        await asyncio.gather(send_all(), receive_all())
        await asyncio.gather(*commits)
    finally:
        for task in commits:
            task.cancel()
        await asyncio.gather(*commits, return_exceptions=True)
