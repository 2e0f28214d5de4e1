"""The coded exchange's multicast datagrams and the reliability state behind them (no I/O).

A coded packet (the XOR of several samples, padded to the longest) goes to a
group of nodes by IP multicast, cut into datagrams that fit the network's MTU.
UDP loses and reorders, so each sender numbers its datagrams per group
(sequence numbers from 0, one stream per sender session and group), keeps
every datagram until each member of the group has acknowledged it, and
resends what a member reports missing. Receivers acknowledge cumulatively and
list their gaps (NACKs) in a unicast reply to the sender; a sender that waits
on acknowledgements multicasts a tail announcement (its next sequence number)
so that a receiver learns of datagrams it lost at the end of a burst, as
PGM's source path messages do. Every datagram is sealed under its pass's
key by the caller (:mod:`.mcast_seal`).

The state machines here, :class:`SendWindow` and :class:`ReceiveLog`, and
:class:`Assembler`, which rebuilds packets from fragments and checks their
xxh3 against the header, are driven by :mod:`.mcast` and by tests alike.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

MAGIC = b"DQ"
VERSION = 1
DATA, TAIL, ACK = 1, 2, 3
#: Gaps listed in one acknowledgement at most (it must stay one small datagram).
MAX_NACKS = 64

_PREFIX = struct.Struct("<2sBB")  # magic, version, kind
# sender, session, group, seq, packet id, fragment index, fragment count, packet length, xxh3 of the packet
_DATA = struct.Struct("<IQIQQIIIQ")
_TAIL = struct.Struct("<IQIQ")  # sender, session, group, next seq
_ACK = struct.Struct("<IIQIQH")  # receiver, sender, session, group, cumulative seq, gaps that follow
_SEQ = struct.Struct("<Q")
#: Bytes of a data datagram's header (before the fragment's payload and the signature).
DATA_HEADER_BYTES = _PREFIX.size + _DATA.size


class WireError(ValueError):
    """A datagram that is not one of ours, or is malformed."""


@dataclass(frozen=True)
class Fragment:
    """One data datagram: a slice of a packet, numbered in its sender's stream to a group."""

    sender: int
    session: int
    group: int
    seq: int
    packet: int
    index: int
    count: int
    length: int
    digest: int
    payload: bytes


@dataclass(frozen=True)
class Tail:
    """A sender's announcement of the next sequence number it will use in a group."""

    sender: int
    session: int
    group: int
    next_seq: int


@dataclass(frozen=True)
class Ack:
    """A receiver's report on one stream: every seq below ``cumulative`` arrived; ``gaps`` did not."""

    receiver: int
    sender: int
    session: int
    group: int
    cumulative: int
    gaps: tuple[int, ...]


def fragments(packet: bytes, payload_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """``(index, count, slice)`` of ``packet`` cut into slices of ``payload_bytes`` (one for an empty packet)."""
    count = max(1, -(-len(packet) // payload_bytes))
    view = memoryview(packet)
    for index in range(count):
        yield index, count, bytes(view[index * payload_bytes : (index + 1) * payload_bytes])


def encode_data(fragment: Fragment) -> bytes:
    f = fragment
    return (
        _PREFIX.pack(MAGIC, VERSION, DATA)
        + _DATA.pack(f.sender, f.session, f.group, f.seq, f.packet, f.index, f.count, f.length, f.digest)
        + f.payload
    )


def encode_tail(tail: Tail) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, TAIL) + _TAIL.pack(tail.sender, tail.session, tail.group, tail.next_seq)


def encode_ack(ack: Ack) -> bytes:
    gaps = ack.gaps[:MAX_NACKS]
    return (
        _PREFIX.pack(MAGIC, VERSION, ACK)
        + _ACK.pack(ack.receiver, ack.sender, ack.session, ack.group, ack.cumulative, len(gaps))
        + b"".join(_SEQ.pack(seq) for seq in gaps)
    )


def decode(datagram: bytes) -> Fragment | Tail | Ack:
    """The message in ``datagram`` (its signature already checked and cut off).

    Raises:
        WireError: not a dataquay datagram of this version, or truncated.
    """
    if len(datagram) < _PREFIX.size:
        raise WireError("datagram shorter than its prefix")
    magic, version, kind = _PREFIX.unpack_from(datagram)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not a version {VERSION} dataquay datagram")
    body = memoryview(datagram)[_PREFIX.size :]
    try:
        if kind == DATA:
            sender, session, group, seq, packet, index, count, length, digest = _DATA.unpack_from(body)
            if not index < count:
                raise WireError(f"fragment {index} of {count}")
            return Fragment(
                sender, session, group, seq, packet, index, count, length, digest, bytes(body[_DATA.size :])
            )
        if kind == TAIL:
            return Tail(*_TAIL.unpack_from(body))
        if kind == ACK:
            receiver, sender, session, group, cumulative, count = _ACK.unpack_from(body)
            if len(body) != _ACK.size + count * _SEQ.size or count > MAX_NACKS:
                raise WireError(f"acknowledgement of {len(body)} bytes lists {count} gaps")
            gaps = tuple(_SEQ.unpack_from(body, _ACK.size + i * _SEQ.size)[0] for i in range(count))
            return Ack(receiver, sender, session, group, cumulative, gaps)
    except struct.error as exc:
        raise WireError(f"truncated datagram: {exc}") from None
    raise WireError(f"unknown datagram kind {kind}")


class SendWindow:
    """A sender's datagrams of one group, kept until every member has acknowledged them.

    Acknowledgements are cumulative, so a member's progress is one number;
    a datagram is released once every member's number has passed it.
    """

    def __init__(self, members: frozenset[int]) -> None:
        if not members:
            raise ValueError("a group needs at least one member")
        self.members = members
        self.next_seq = 0
        self.kept: dict[int, bytes] = {}
        self.kept_bytes = 0
        self._acked = dict.fromkeys(members, 0)

    def reserve(self) -> int:
        """The next sequence number, taken."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def keep(self, seq: int, datagram: bytes) -> None:
        """Holds ``seq``'s signed datagram for resending until every member has it."""
        self.kept[seq] = datagram
        self.kept_bytes += len(datagram)

    def on_ack(self, ack: Ack) -> list[int]:
        """Applies a member's acknowledgement; returns the kept seqs it asks to be resent."""
        if ack.receiver not in self._acked:
            return []
        if ack.cumulative > self._acked[ack.receiver]:
            self._acked[ack.receiver] = min(ack.cumulative, self.next_seq)
            floor = min(self._acked.values())
            for seq in [s for s in self.kept if s < floor]:
                self.kept_bytes -= len(self.kept.pop(seq))
        return [seq for seq in ack.gaps if seq in self.kept]

    @property
    def done(self) -> bool:
        """Every member has every datagram sent so far."""
        return min(self._acked.values()) >= self.next_seq

    def lagging(self) -> list[int]:
        """Members that still miss datagrams."""
        return sorted(m for m, acked in self._acked.items() if acked < self.next_seq)


class ReceiveLog:
    """Which datagrams of one sender's stream to a group have arrived, and which are missing."""

    def __init__(self, session: int) -> None:
        self.session = session
        self.cumulative = 0
        self._above: set[int] = set()
        self._horizon = 0

    def on_data(self, seq: int) -> bool:
        """Records ``seq``; False for a duplicate (already received)."""
        if seq < self.cumulative or seq in self._above:
            return False
        self._above.add(seq)
        self._horizon = max(self._horizon, seq + 1)
        while self.cumulative in self._above:
            self._above.remove(self.cumulative)
            self.cumulative += 1
        return True

    def on_tail(self, next_seq: int) -> None:
        self._horizon = max(self._horizon, next_seq)

    def gaps(self) -> tuple[int, ...]:
        """The first :data:`MAX_NACKS` seqs below the known horizon that have not arrived."""
        missing: list[int] = []
        seq = self.cumulative
        while seq < self._horizon and len(missing) < MAX_NACKS:
            if seq not in self._above:
                missing.append(seq)
            seq += 1
        return tuple(missing)

    @property
    def behind(self) -> bool:
        return self.cumulative < self._horizon


class Assembler:
    """Rebuilds packets from their fragments and checks each whole packet's xxh3.

    Attributes:
        corrupt: packets whose bytes did not match their header (dropped).
    """

    def __init__(self) -> None:
        self._parts: dict[tuple[int, int, int], dict[int, bytes]] = {}
        self.corrupt = 0

    def add(self, fragment: Fragment) -> bytes | None:
        """The whole packet once its last fragment arrives, else None."""
        key = (fragment.sender, fragment.session, fragment.packet)
        parts = self._parts.setdefault(key, {})
        parts[fragment.index] = fragment.payload
        if len(parts) < fragment.count:
            return None
        del self._parts[key]
        packet = b"".join(parts[i] for i in range(fragment.count))
        if len(packet) != fragment.length or xxhash.xxh3_64_intdigest(packet) != fragment.digest:
            self.corrupt += 1
            return None
        return packet

    @property
    def pending(self) -> int:
        """Packets with some fragments held."""
        return len(self._parts)
