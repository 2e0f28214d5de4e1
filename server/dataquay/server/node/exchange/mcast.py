"""Reliable multicast of coded packets over IP multicast (UDP), on the event loop.

One :class:`MulticastEndpoint` per node and pass: it multicasts the packets
this node sends to their groups and receives the packets of the groups it
decodes for. The cluster's channel is a bounded pool of multicast addresses
on one port; each group travels on one address of the pool, and a node joins
only the addresses of the groups it decodes for, for as long as its pass
needs them, so a datagram reaches the nodes that decode it (and, where the
pool is smaller than the groups, those of groups that share its address)
rather than every node of the cluster. A datagram carries
its sender's node, its group and its place in the sender's stream to that
group (:mod:`.mcast_wire`), sealed under its pass's key (:mod:`.mcast_seal`);
a node drops the streams it was not told to expect. What it did not expect
to see at all (another pass's datagram, a forged or malformed one, a
session of a stream that it already left behind) is dropped and counted by
reason, never raised. Reliability is the sender's: it keeps each datagram until every
member acknowledged it, resends what members report missing, announces its
stream's tail while it waits, and never has more than ``window`` datagrams
unacknowledged nor sends faster than ``rate``. A receiver acknowledges to the
sender's unicast address and holds at most ``max_ready`` whole packets that
its consumer has not taken; beyond that it drops fragments of new packets,
which the sender then resends, so memory stays capped at both ends.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import ipaddress
import logging
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import xxhash

from dataquay.server.node.exchange import mcast_seal
from dataquay.server.node.exchange import mcast_wire as wire
from dataquay.server.ratelimit import TokenBucket

log = logging.getLogger("dataquay.exchange.mcast")

#: A receiver acknowledges at least once per this many datagrams of a stream.
ACK_EVERY = 32
#: Receive buffer asked of the kernel: bursts of a window's datagrams must fit.
RECEIVE_BUFFER_BYTES = 8 << 20
ETHERNET_MTU = 1500
#: IPv4 and UDP headers; the largest IPv4 datagram.
IP_UDP_BYTES, MAX_DATAGRAM = 28, 65535
_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFMTU = 0x8913, 0x8915, 0x8921
_IFF_LOOPBACK, _IFF_MULTICAST = 0x8, 0x1000


@dataclass(frozen=True)
class Channel:
    """Where a job's coded packets travel.

    Attributes:
        group: the first IPv4 multicast address of the pool (224.0.0.0/4).
        port: the UDP port of every address of the pool.
        interface: the local address of the interface to send and join on.
        ttl: multicast hops (1: the local subnet, as an HPC fabric usually is).
        pool: addresses in the pool: ``group`` and the ``pool - 1`` after it.
    """

    group: str
    port: int
    interface: str = "127.0.0.1"
    ttl: int = 1
    pool: int = 1

    def address(self, slot: int) -> str:
        """The pool's address number ``slot`` (taken modulo the pool)."""
        return _pool_address(self.group, slot % self.pool)


@functools.lru_cache(maxsize=4096)
def _pool_address(group: str, slot: int) -> str:
    # Asked once per datagram sent: parsing the address each time costs more than sealing it.
    return str(ipaddress.IPv4Address(group) + slot)


def interface_mtu(address: str) -> int:
    """The MTU of the interface that has ``address`` (Linux), else Ethernet's 1500."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                found = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24])
                if found == address:
                    return int(struct.unpack_from("i", fcntl.ioctl(probe.fileno(), _SIOCGIFMTU, request), 16)[0])
            except OSError:
                continue
    return ETHERNET_MTU


def _interface_of(address: str) -> tuple[str, int] | None:
    """The name and flags of the interface that has ``address`` (Linux), None if none has it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                found = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24])
                if found == address:
                    return name, int(
                        struct.unpack_from("H", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request), 16)[0]
                    )
            except OSError:
                continue
    return None


def no_multicast(channel: Channel) -> str:
    """Why ``channel``'s interface cannot carry the pool's datagrams to other hosts, or "" when it can.

    A host delivers its own multicast to itself whatever the interface, so
    only the interface's flags tell: one without ``MULTICAST`` (a point-to-point
    or cloud fabric) sends none out, and a coded pass would only wait for
    snapshots that never come. A loopback interface serves the nodes of its host.
    """
    found = _interface_of(channel.interface)
    if found is None:
        return f"no interface has the address {channel.interface} (--exchange-multicast-interface)"
    name, flags = found
    if not flags & (_IFF_MULTICAST | _IFF_LOOPBACK):
        return f"interface {name} ({channel.interface}) carries no multicast"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        membership = struct.pack("4s4s", socket.inet_aton(channel.group), socket.inet_aton(channel.interface))
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
        except OSError as exc:
            return f"interface {name} ({channel.interface}) cannot join {channel.group}: {exc}"
    return ""


def payload_bytes(mtu: int) -> int:
    """Packet bytes per datagram that fit ``mtu`` with IPv4, UDP, our header and seal (and UDP's limit)."""
    room = min(mtu, MAX_DATAGRAM) - IP_UDP_BYTES - wire.DATA_HEADER_BYTES - mcast_seal.OVERHEAD_BYTES
    return max(room, 512)


def multicast_channel(group_port: str, interface: str, pool: int) -> Channel | None:
    """The :class:`Channel` of ``--exchange-multicast`` (``GROUP:PORT``, checked by the config) and a pool of
    ``pool`` addresses from GROUP on, None if empty."""
    if not group_port:
        return None
    group, _, port = group_port.rpartition(":")
    return Channel(group, int(port), interface, pool=pool)


@dataclass
class EndpointStats:
    """Counts of what an endpoint put on the wire: ``wire_bytes_sent`` counts first transmissions,
    ``resent_bytes`` the rest, ``control_bytes_sent`` its tails and acknowledgements (UDP payloads,
    our headers and seals included); of what reached it from other nodes of its pass
    (``datagrams_received``, ``bytes_received``: what the fabric delivered here, acknowledgements
    included), of which ``foreign_datagrams`` belonged to streams this node does not decode
    (another group on a shared address) and ``data_bytes_received`` were the first copy of each
    data datagram of a stream it decodes; and of what it dropped, by reason (:data:`DROP_REASONS`)."""

    packets_sent: int = 0
    packet_bytes_sent: int = 0
    datagrams_sent: int = 0
    wire_bytes_sent: int = 0
    datagrams_resent: int = 0
    resent_bytes: int = 0
    control_bytes_sent: int = 0
    control_datagrams_sent: int = 0
    packets_received: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    data_bytes_received: int = 0
    foreign_datagrams: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


#: Why a received datagram (or, for ``corrupt`` and those of :mod:`.coded`, a packet) was dropped:
#: ``malformed``: not a sealed dataquay datagram, or its message does not parse;
#: ``unknown_pass``: it names a pass this endpoint is not in (a replay of an earlier pass, another job's);
#: ``unauthenticated``: its tag does not verify under this pass's key (forged, or altered on the way);
#: ``stale_session``: from a session of its sender that a newer one replaced;
#: ``duplicate``: already received (a resend another member asked for, or a replay within the pass);
#: ``backlog``: the consumer's queue of whole packets is full (the sender resends it);
#: ``corrupt``: a whole packet whose bytes do not match its header's xxh3;
#: ``unexpected_packet``: a whole packet the plan does not have its sender send this node on that stream.
DROP_REASONS = (
    "malformed",
    "unknown_pass",
    "unauthenticated",
    "stale_session",
    "duplicate",
    "backlog",
    "corrupt",
    "unexpected_packet",
)


#: Datagrams read from a socket per wake-up of the event loop, at most (the first included).
READ_BATCH = 64


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, endpoint: MulticastEndpoint, sock: socket.socket) -> None:
        self._endpoint = endpoint
        self._sock = sock

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        # The loop hands over one datagram per wake-up; what queued behind it is read here,
        # and the acknowledgements the batch earned leave once, after it.
        endpoint = self._endpoint
        endpoint._on_datagram(data, addr)
        for _ in range(READ_BATCH - 1):
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.error_received(exc)
                break
            endpoint._on_datagram(data, addr)
        endpoint._send_acks()

    def error_received(self, exc: Exception) -> None:
        log.debug("multicast socket error: %s", exc)


class MulticastEndpoint:
    """One node's end of a job's coded-packet multicast (module docstring).

    Args:
        node: this node's rank in the job (its id in every datagram).
        channel: the job's multicast address and port.
        token: the node token; with ``pass_id`` it keys the seal of every
            datagram ("" when the cluster has none).
        payload_bytes: packet bytes per datagram: the MTU less 28 bytes of IP
            and UDP, :data:`~.mcast_wire.DATA_HEADER_BYTES` and the seal's
            :data:`~.mcast_seal.OVERHEAD_BYTES`.
        window_bytes: bytes of datagrams sent and not yet acknowledged by all
            members, at most: every sender's window together must fit a
            receiver's socket buffer, or the overflow is lost and resent.
        rate: bytes per second this node multicasts at most (None: no cap).
        tail_interval: seconds between a waiting sender's tail announcements,
            and the least time between two resends of one datagram.
        max_ready: received packets held for the consumer, at most.
        pass_id: the pass's random id, the same at every node of the pass
            (agreed over the TCP path); datagrams of other passes are dropped.
        others: ids of this process's other passes under way: their
            datagrams reach this endpoint too and are ignored, not counted.
        on_drop: told the reason of every drop (the daemon's metric).
    """

    def __init__(
        self,
        node: int,
        channel: Channel,
        token: str = "",
        payload_bytes: int = 1400,
        window_bytes: int = 256 << 10,
        rate: float | None = None,
        tail_interval: float = 0.02,
        max_ready: int = 4096,
        *,
        pass_id: int,
        others: Collection[int] = (),
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.node = node
        self.channel = channel
        self.pass_id = pass_id
        self.stats = EndpointStats()
        self.ready: asyncio.Queue[tuple[int, int, int, bytes]] = asyncio.Queue()
        self._seal = mcast_seal.PassSeal(token, pass_id)
        self._others = others
        self._on_drop = on_drop
        self._payload_bytes = payload_bytes
        self._window_bytes = window_bytes
        # Congestion: halved when members report losses, grown back a datagram per clean acknowledgement.
        self._congestion_bytes = window_bytes
        self._halved_at = 0.0
        self._kept_bytes = 0
        self._sent_at: dict[int, float] = {}
        self._bucket = TokenBucket(rate) if rate else None
        self._tail_interval = tail_interval
        self._max_ready = max_ready
        self._session = random.getrandbits(63)
        self._groups: dict[int, wire.SendWindow] = {}
        self._resent_at: dict[tuple[int, int], float] = {}
        self._expected: dict[tuple[int, int], asyncio.Queue[tuple[int, int, int, bytes]]] = {}
        #: Datagrams counted foreign, by stream: one this node later expects came
        #: early (its sender planned first), not from another group.
        self._unexpected: Counter[tuple[int, int]] = Counter()
        self._logs: dict[tuple[int, int], wire.ReceiveLog] = {}
        self._retired_sessions: dict[tuple[int, int], set[int]] = {}
        self._since_ack: dict[tuple[int, int], int] = {}
        self._gap_acked_at: dict[tuple[int, int], float] = {}
        #: Streams owed an acknowledgement, sent once the datagrams read together are handled.
        self._acks_due: dict[tuple[int, int], wire.ReceiveLog] = {}
        self._senders: dict[int, tuple[str, int]] = {}
        self._assembler = wire.Assembler()
        self._room = asyncio.Event()
        self._progress = asyncio.Event()
        self._slots: dict[int, int] = {}
        self._send: asyncio.DatagramTransport | None = None
        #: Per joined address of the pool: its socket and the streams expected on it.
        self._receive: dict[int, tuple[asyncio.DatagramTransport, int]] = {}
        self._tails: asyncio.Task[None] | None = None
        self._heard_at = 0.0

    async def start(self) -> None:
        """Opens the sending socket (which also takes the acknowledgements); idempotent.

        Raises:
            OSError: the interface has no multicast.
        """
        if self._send is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            sock = self._send_socket()
            self._send, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self, sock), sock=sock)
        except OSError:
            self.close()
            raise
        self._tails = asyncio.create_task(self._announce_tails(), name=f"mcast tails {self.node}")

    async def join(self, slot: int) -> None:
        """Joins the pool's address ``slot`` (once per stream expected on it; :meth:`leave` undoes one).

        Raises:
            OSError: the interface cannot join it, or the port is taken by
                something that does not share it.
        """
        slot %= self.channel.pool
        found = self._receive.get(slot)
        if found is not None:
            self._receive[slot] = (found[0], found[1] + 1)
            return
        sock = self._receive_socket(self.channel.address(slot))
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Protocol(self, sock), sock=sock
        )
        self._receive[slot] = (transport, 1)

    def leave(self, slot: int) -> None:
        """Undoes one :meth:`join` of ``slot``; the last one leaves the address."""
        slot %= self.channel.pool
        found = self._receive.pop(slot, None)
        if found is None:
            return
        if found[1] > 1:
            self._receive[slot] = (found[0], found[1] - 1)
        else:
            found[0].close()

    @property
    def joined(self) -> list[str]:
        """The pool's addresses this endpoint listens on."""
        return [self.channel.address(slot) for slot in sorted(self._receive)]

    def _send_socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind((self.channel.interface, 0))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(self.channel.interface))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, self.channel.ttl)
            # Nodes of a job may share a host (tests, `dataquay cluster`): deliver to them too.
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _receive_socket(self, address: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # Every endpoint on a host binds the pool's port; the kernel gives each a copy.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            # Bound to the address itself, the socket takes only that address's datagrams.
            sock.bind((address, self.channel.port))
            membership = struct.pack("4s4s", socket.inet_aton(address), socket.inet_aton(self.channel.interface))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        if self._send is not None:
            self._send.close()
        for transport, _ in self._receive.values():
            transport.close()
        self._send, self._receive = None, {}
        if self._tails is not None:
            self._tails.cancel()
            self._tails = None

    async def __aenter__(self) -> MulticastEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def expect(self, sender: int, group: int, into: asyncio.Queue[tuple[int, int, int, bytes]] | None = None) -> None:
        """Accept ``sender``'s stream to ``group``, of which this node is a member;
        its packets go to ``into`` (default :attr:`ready`)."""
        self._expected[(sender, group)] = self.ready if into is None else into
        self.stats.foreign_datagrams -= self._unexpected.pop((sender, group), 0)

    def forget(self, sender: int, group: int) -> None:
        """Stops accepting ``sender``'s stream to ``group``."""
        self._expected.pop((sender, group), None)
        self._logs.pop((sender, group), None)
        self._retired_sessions.pop((sender, group), None)
        self._since_ack.pop((sender, group), None)
        self._gap_acked_at.pop((sender, group), None)

    def open_group(self, group: int, members: frozenset[int], slot: int = 0) -> None:
        """Declares this node's stream to ``group``, who must acknowledge it, and the pool's
        address it travels on (the one its members join)."""
        if group in self._groups:
            raise ValueError(f"group {group} is open already")
        self._groups[group] = wire.SendWindow(members)
        self._slots[group] = slot

    def close_group(self, group: int) -> None:
        """Ends this node's stream to ``group``, acknowledged or not, and frees what it kept."""
        if self._groups.pop(group, None) is not None:
            self._slots.pop(group, None)
            self._resent_at = {key: at for key, at in self._resent_at.items() if key[0] != group}
            self._sent_at.pop(group, None)
            self._kept_bytes = sum(w.kept_bytes for w in self._groups.values())
            self._room.set()
            self._progress.set()

    async def send(self, group: int, packet_id: int, packet: bytes) -> None:
        """Multicasts ``packet`` to ``group``, waiting for window room and the rate cap.

        Returns once its datagrams are on the wire, not once they are acknowledged (:meth:`flush`).
        """
        window = self._groups[group]
        digest = xxhash.xxh3_64_intdigest(packet)
        for index, count, payload in wire.fragments(packet, self._payload_bytes):
            while self._kept_bytes >= self._congestion_bytes:
                self._room.clear()
                await self._room.wait()
            seq = window.reserve()
            datagram = self._seal.seal(
                wire.encode_data(
                    wire.Fragment(
                        self.node, self._session, group, seq, packet_id, index, count, len(packet), digest, payload
                    )
                )
            )
            window.keep(seq, datagram)
            self._kept_bytes += len(datagram)
            if self._bucket is not None:
                wait = self._bucket.reserve(len(datagram))
                if wait > 0:
                    await asyncio.sleep(wait)
            self._multicast(datagram, group)
            self._sent_at[group] = time.monotonic()
            self.stats.datagrams_sent += 1
            self.stats.wire_bytes_sent += len(datagram)
        self.stats.packets_sent += 1
        self.stats.packet_bytes_sent += len(packet)

    async def flush(self, groups: set[int] | None = None) -> None:
        """Waits until every member of ``groups`` (default: every open group) has
        acknowledged every datagram sent to it (a group closed meanwhile counts as done)."""
        while not all(w.done for g, w in self._groups.items() if groups is None or g in groups):
            self._progress.clear()
            await self._progress.wait()

    def lagging(self) -> dict[int, list[int]]:
        """Per open group, the members that still miss datagrams (for a caller that gives up on them)."""
        return {group: w.lagging() for group, w in self._groups.items() if not w.done}

    async def linger(self, idle: float, most: float) -> None:
        """Keeps answering the streams still expected until none was heard of for ``idle``
        seconds (``most`` at most): a sender whose last acknowledgement from this node was
        lost announces its tail until it hears one again, and would wait in vain otherwise."""
        self._heard_at = time.monotonic()
        async with asyncio.timeout(most):
            while (quiet := time.monotonic() - self._heard_at) < idle:
                await asyncio.sleep(idle - quiet)

    def _multicast(self, datagram: bytes, group: int) -> None:
        assert self._send is not None, "the endpoint is not started"
        self._send.sendto(datagram, (self.channel.address(self._slots.get(group, 0)), self.channel.port))

    async def _announce_tails(self) -> None:
        while True:
            await asyncio.sleep(self._tail_interval)
            idle_since = time.monotonic() - self._tail_interval
            for group, window in self._groups.items():
                # A stream still sending needs no tail: its next datagrams show its members their gaps.
                if not window.done and self._sent_at.get(group, 0.0) <= idle_since:
                    datagram = self._seal.seal(
                        wire.encode_tail(wire.Tail(self.node, self._session, group, window.next_seq))
                    )
                    self._multicast(datagram, group)
                    self.stats.control_bytes_sent += len(datagram)
                    self.stats.control_datagrams_sent += 1

    def drop(self, reason: str) -> None:
        """Counts a datagram or packet dropped for ``reason`` (one of :data:`DROP_REASONS`)."""
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        if self._on_drop is not None:
            self._on_drop(reason)

    def _on_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            found = mcast_seal.pass_of(data)
            if found != self.pass_id and found in self._others:
                return
            message = wire.decode(self._seal.open(data))
        except mcast_seal.SealError as exc:
            self.drop(exc.reason)
            return
        except wire.WireError:
            self.drop("malformed")
            return
        self._count_received(message, len(data))
        if isinstance(message, wire.Ack):
            self._on_ack(message)
        elif isinstance(message, wire.Tail):
            self._on_tail(message, addr)
        else:
            self._on_fragment(message, addr, len(data))

    def _count_received(self, message: wire.Fragment | wire.Tail | wire.Ack, size: int) -> None:
        """Counts a datagram the fabric brought from another node (this node's own, looped back
        by the host, never left it), and whether it belongs to a stream this node decodes."""
        if (message.receiver if isinstance(message, wire.Ack) else message.sender) == self.node:
            return
        self.stats.datagrams_received += 1
        self.stats.bytes_received += size
        if not isinstance(message, wire.Ack) and (message.sender, message.group) not in self._expected:
            self.stats.foreign_datagrams += 1
            self._unexpected[(message.sender, message.group)] += 1

    def _on_ack(self, ack: wire.Ack) -> None:
        window = self._groups.get(ack.group)
        if ack.sender != self.node or ack.session != self._session or window is None:
            return
        now = time.monotonic()
        resend = window.on_ack(ack)
        if resend and now - self._halved_at >= self._tail_interval:
            self._halved_at = now
            self._congestion_bytes = max(self._congestion_bytes // 2, 4 * self._payload_bytes)
        elif not ack.gaps:
            self._congestion_bytes = min(self._congestion_bytes + self._payload_bytes, self._window_bytes)
        for seq in resend:
            if now - self._resent_at.get((ack.group, seq), 0.0) >= self._tail_interval:
                self._resent_at[(ack.group, seq)] = now
                datagram = window.kept[seq]
                self._multicast(datagram, ack.group)
                self.stats.datagrams_resent += 1
                self.stats.resent_bytes += len(datagram)
        self._kept_bytes = sum(w.kept_bytes for w in self._groups.values())
        if self._kept_bytes < self._congestion_bytes:
            self._room.set()
        if window.done:
            self._resent_at = {key: at for key, at in self._resent_at.items() if key[0] != ack.group}
        self._progress.set()

    def _stream(self, sender: int, group: int, session: int, addr: tuple[str, int]) -> wire.ReceiveLog | None:
        key = (sender, group)
        if key not in self._expected:
            return None
        found = self._logs.get(key)
        if found is None or found.session != session:
            retired = self._retired_sessions.setdefault(key, set())
            if session in retired:
                self.drop("stale_session")
                return None
            if found is not None:
                retired.add(found.session)
            # A sender that restarted (within this pass) numbers its stream anew.
            found = self._logs[key] = wire.ReceiveLog(session)
            self._senders[sender] = addr
        return found

    def _on_tail(self, tail: wire.Tail, addr: tuple[str, int]) -> None:
        stream = self._stream(tail.sender, tail.group, tail.session, addr)
        if stream is not None:
            self._heard_at = time.monotonic()
            stream.on_tail(tail.next_seq)
            self._acks_due[(tail.sender, tail.group)] = stream

    def _on_fragment(self, fragment: wire.Fragment, addr: tuple[str, int], size: int) -> None:
        stream = self._stream(fragment.sender, fragment.group, fragment.session, addr)
        if stream is None:
            return
        self._heard_at = time.monotonic()
        into = self._expected[(fragment.sender, fragment.group)]
        if into.qsize() >= self._max_ready and fragment.index == 0:
            self.drop("backlog")
            return
        if not stream.on_data(fragment.seq):
            self.drop("duplicate")
            return
        self.stats.data_bytes_received += size
        # Acknowledgements go where new data came from, never where a replay did.
        self._senders[fragment.sender] = addr
        corrupt = self._assembler.corrupt
        packet = self._assembler.add(fragment)
        if packet is not None:
            self.stats.packets_received += 1
            into.put_nowait((fragment.sender, fragment.group, fragment.packet, packet))
        elif self._assembler.corrupt > corrupt:
            self.drop("corrupt")
        key = (fragment.sender, fragment.group)
        self._since_ack[key] = self._since_ack.get(key, 0) + 1
        now = time.monotonic()
        gap_due = stream.behind and now - self._gap_acked_at.get(key, 0.0) >= self._tail_interval / 2
        # A whole packet with nothing missing before it is acknowledged at once: a
        # group's stream may be a packet or two, and then waiting for the sender's
        # tail announcement would cost a round of tails per group.
        caught_up = packet is not None and not stream.behind
        if self._since_ack[key] >= ACK_EVERY or gap_due or caught_up:
            if gap_due:
                self._gap_acked_at[key] = now
            self._acks_due[key] = stream

    def _send_acks(self) -> None:
        """Sends the acknowledgements the datagrams handled since the last call earned, one per stream."""
        due, self._acks_due = self._acks_due, {}
        for (sender, group), stream in due.items():
            if self._logs.get((sender, group)) is stream:
                self._acknowledge(sender, group, stream)

    def _acknowledge(self, sender: int, group: int, stream: wire.ReceiveLog) -> None:
        self._since_ack[(sender, group)] = 0
        addr = self._senders.get(sender)
        if addr is None or self._send is None:
            return
        datagram = self._seal.seal(
            wire.encode_ack(wire.Ack(self.node, sender, stream.session, group, stream.cumulative, stream.gaps()))
        )
        self._send.sendto(datagram, addr)
        self.stats.control_bytes_sent += len(datagram)
        self.stats.control_datagrams_sent += 1
