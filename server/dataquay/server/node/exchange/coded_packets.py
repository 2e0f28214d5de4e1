"""What a coded exchange puts on the wire: packets as XORs of cache values,
and the multicast stream each send travels on.

Pure functions of a plan (:func:`dataquay.server.node.exchange.coding.plan`),
so that every node derives the same streams from the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataquay.server.node.exchange.coding import Packets


def xor_encode(parts: Sequence[bytes]) -> bytes:
    """One packet: the XOR of ``parts``, each zero-padded to the longest."""
    out = np.zeros(max((len(p) for p in parts), default=0), dtype=np.uint8)
    for part in parts:
        out[: len(part)] ^= np.frombuffer(part, dtype=np.uint8)
    return out.tobytes()


def xor_decode(packet: bytes, known: Sequence[bytes], length: int) -> bytes:
    """The part of ``packet`` that is not in ``known``, cut to its ``length``."""
    return xor_encode([packet, *known])[:length]


@dataclass(frozen=True)
class Streams:
    """Which multicast stream carries each send: the packets, then the fetches.

    A sender numbers its groups (distinct member sets) in the order of its
    sends, so every node derives the same numbers from the same plan.

    Attributes:
        senders: each send's node (:data:`PFS`: none; its receiver reads the PFS).
        groups: each send's group in its sender's numbering.
        members: each send's receivers: a packet's decoders but its sender
            (which got its own part by a fetch), a fetch's packet sender.
    """

    senders: np.ndarray
    groups: np.ndarray
    members: list[frozenset[int]]


def streams(packets: Packets) -> Streams:
    """The :class:`Streams` of ``packets``: send i < len(packets) is packet i, the rest fetch i - len(packets)."""
    decoders = np.split(packets.decoders, packets.start[1:-1]) if len(packets) else []
    members = [frozenset(d.tolist()) - {sender} for d, sender in zip(decoders, packets.senders.tolist(), strict=True)]
    members += [frozenset({int(packets.senders[p])}) for p in packets.fetch_packets.tolist()]
    senders = np.concatenate([packets.senders, packets.fetch_sources]).astype(np.int64)
    groups = np.zeros(len(members), dtype=np.int64)
    numbering: dict[tuple[int, frozenset[int]], int] = {}
    counts: dict[int, int] = {}
    for i, key in enumerate(zip(senders.tolist(), members, strict=True)):
        if key not in numbering:
            numbering[key] = counts.get(key[0], 0)
            counts[key[0]] = numbering[key] + 1
        groups[i] = numbering[key]
    return Streams(senders, groups, members)


def slots(sent: Streams, pool: int) -> np.ndarray:
    """The address of a pool of ``pool`` that each send travels on: one per member set where there is room.

    Slot 0 carries what every node hears (the caches' snapshots); the member
    sets take the others, the most used first. Where there are more sets than
    addresses, each of the rest goes where it adds the fewest deliveries to
    nodes that do not decode them: its sends to the nodes of the address that
    are not its members, and the address's sends to its members that are not
    of the address yet. Every node derives the same slots from the same plan.
    """
    if pool <= 1:
        return np.zeros(len(sent.members), dtype=np.int64)
    counts: dict[frozenset[int], int] = {}
    for members in sent.members:
        counts[members] = counts.get(members, 0) + 1
    ranked = sorted(counts, key=lambda m: (-counts[m], sorted(m)))
    joined: list[frozenset[int]] = []  # per slot but 0, the nodes that join it
    carried: list[int] = []  # per slot but 0, the sends it carries
    slot_of: dict[frozenset[int], int] = {}
    for members in ranked:
        if len(joined) < pool - 1:
            slot = len(joined)
            joined.append(members)
            carried.append(counts[members])
        else:
            slot = min(
                range(len(joined)),
                key=lambda k: (counts[members] * len(joined[k] - members) + carried[k] * len(members - joined[k]), k),
            )
            joined[slot] |= members
            carried[slot] += counts[members]
        slot_of[members] = 1 + slot
    return np.array([slot_of[m] for m in sent.members], dtype=np.int64)
