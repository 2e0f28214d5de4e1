"""When coding an exchange pays: the bytes each node sends and receives, and the time its links take.

Coding (:mod:`.coding`) cuts what senders put on the wire, never what a
receiver takes in: every node still receives one transmission per sample it
lacks (a packet is as long as its longest part, so a coded one is longer).
An exchange takes as long as its busiest link, so coding shortens it only
where a sender's egress bounds it (fewer links send, or they are slower
than the receivers'), and only where caches overlap, so that packets have
parts for several receivers. This module is that model, pure (numpy in,
numpy out, no I/O) as the planner is: ``dataquay simulate`` reports it, and
the wire benchmark and its test check its byte counts against a real run's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataquay.server.node.exchange.coding import PFS, Packets
from dataquay.server.sizes import format_bytes

#: Coding pays when it takes no more than this fraction of the uncoded exchange's time.
PAYS_BELOW = 0.95


@dataclass(frozen=True)
class NodeBytes:
    """Bytes each node puts on its link and takes off it (indexed by node).

    Attributes:
        sent: a packet once (multicast), at its sender; a fetch at its source.
        received: a packet at each of its decoders but its sender (which
            has its own part from its fetch); a fetch at the packet's sender.
    """

    sent: np.ndarray
    received: np.ndarray


def node_bytes(
    packets: Packets,
    num_nodes: int,
    sizes: np.ndarray | None = None,
    payload_bytes: int = 0,
    datagram_overhead: int = 0,
) -> NodeBytes:
    """What ``packets`` cost each node's link.

    Args:
        packets: the exchange's plan.
        num_nodes: nodes of the job.
        sizes: bytes per sample id (unit samples when None).
        payload_bytes: packet bytes per datagram (0: not cut into datagrams).
        datagram_overhead: bytes each datagram adds (headers and seal), counted
            ``ceil(length / payload_bytes)`` times per transmission.
    """
    part_bytes = np.ones(len(packets.samples), dtype=np.int64) if sizes is None else sizes[packets.samples]
    packet_bytes = np.maximum.reduceat(part_bytes, packets.start[:-1]) if len(packets) else part_bytes[:0]
    fetch_bytes = np.ones(len(packets.fetch_samples), dtype=np.int64) if sizes is None else sizes[packets.fetch_samples]
    packet_bytes = _framed(packet_bytes, payload_bytes, datagram_overhead)
    fetch_bytes = _framed(fetch_bytes, payload_bytes, datagram_overhead)
    sent_by_node = packets.senders != PFS
    fetched = packets.fetch_sources != PFS
    sender_of_part = packets.senders[packets.packet_of_part]
    multicast = (sender_of_part != PFS) & (packets.decoders != sender_of_part)
    sent = np.bincount(
        packets.senders[sent_by_node], weights=packet_bytes[sent_by_node], minlength=num_nodes
    ) + np.bincount(packets.fetch_sources[fetched], weights=fetch_bytes[fetched], minlength=num_nodes)
    received = np.bincount(
        packets.decoders[multicast], weights=packet_bytes[packets.packet_of_part[multicast]], minlength=num_nodes
    ) + np.bincount(packets.senders[packets.fetch_packets[fetched]], weights=fetch_bytes[fetched], minlength=num_nodes)
    return NodeBytes(sent.astype(np.int64), received.astype(np.int64))


def _framed(lengths: np.ndarray, payload_bytes: int, overhead: int) -> np.ndarray:
    """``lengths`` with each datagram's overhead added (one datagram at least)."""
    if payload_bytes <= 0:
        return lengths.astype(np.int64)
    return lengths + np.maximum(1, -(-lengths // payload_bytes)) * overhead


@dataclass(frozen=True)
class Payoff:
    """The coded exchange against the uncoded one, on the same links.

    Attributes:
        uncoded_seconds: the uncoded exchange's time: its busiest link.
        coded_seconds: the coded exchange's.
        bound: what bounds the uncoded exchange: ``egress`` (a sender's
            link) or ``ingress`` (a receiver's).
        coded_bound: what bounds the coded exchange.
        copies: caches holding a sample, on average, before the exchange.
        busiest_sent: bytes of the busiest sender, uncoded then coded.
        busiest_received: bytes of the busiest receiver, uncoded then coded.
    """

    uncoded_seconds: float
    coded_seconds: float
    bound: str
    coded_bound: str
    copies: float
    busiest_sent: tuple[int, int]
    busiest_received: tuple[int, int]

    @property
    def pays(self) -> bool:
        """Whether coding shortens the exchange by more than :data:`PAYS_BELOW` leaves."""
        return self.coded_seconds <= PAYS_BELOW * self.uncoded_seconds

    @property
    def reason(self) -> str:
        """Why it pays or not, in words a user can act on."""
        if self.copies <= 1.0 + 1e-9:
            return "caches do not overlap (each holds its share only): no packet serves two receivers"
        ratio = self.coded_seconds / self.uncoded_seconds if self.uncoded_seconds else 1.0
        if self.pays:
            return (
                f"senders' egress bounds the exchange and caches overlap ({self.copies:.2f} copies of a sample): "
                f"coding cuts the busiest sender from {format_bytes(self.busiest_sent[0])} to "
                f"{format_bytes(self.busiest_sent[1])} "
                f"({ratio:.2f}x the time)"
            )
        if self.coded_bound == "ingress":
            return (
                f"receivers' ingress bounds the exchange: a node still takes in one transmission per sample it lacks "
                f"({format_bytes(self.busiest_received[0])} uncoded, {format_bytes(self.busiest_received[1])} coded), "
                f"so coding "
                f"saves sender bytes but no time ({ratio:.2f}x)"
            )
        return f"coding cuts the busiest sender too little ({ratio:.2f}x the time)"


def payoff(uncoded: NodeBytes, coded: NodeBytes, copies: float, egress: float = 1.0, ingress: float = 1.0) -> Payoff:
    """Whether the coded exchange beats the uncoded one when each node sends at ``egress`` and receives at
    ``ingress`` bytes/s (full duplex, a switch that replicates multicast; equal when not given)."""
    if not (egress > 0 and ingress > 0):
        raise ValueError(f"bandwidths must be positive, not egress {egress} and ingress {ingress}")

    def links(load: NodeBytes) -> tuple[float, float]:
        return float(load.sent.max(initial=0)) / egress, float(load.received.max(initial=0)) / ingress

    (out, into), (coded_out, coded_into) = links(uncoded), links(coded)
    return Payoff(
        max(out, into),
        max(coded_out, coded_into),
        "egress" if out > into else "ingress",
        "egress" if coded_out > coded_into else "ingress",
        copies,
        (int(uncoded.sent.max(initial=0)), int(coded.sent.max(initial=0))),
        (int(uncoded.received.max(initial=0)), int(coded.received.max(initial=0))),
    )
