"""The coded exchange of a simulated job: caches with spare copies, and what each exchange sends.

``simulate --exchange-coding coded|uber`` runs the planner
(:mod:`dataquay.server.node.exchange.coding`) on every exchange of a job whose
owners move. Caches follow UberShuffle's model (:mod:`.spare_copies`): staging
caches a node's share only; after each exchange a node keeps its new share
and, up to its capacity, spares of what it held (a cache short of its share
is taken to hold it: the model is for caches with room to spare). Spares
are what coding needs: with caches that hold their shares only, every sample sits on one node
and no packet serves two receivers for less than two unicasts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataquay.server.node.exchange.coding import Load, Packets, holder_bits, load, plan
from dataquay.server.node.exchange.coding_payoff import NodeBytes, node_bytes
from dataquay.server.tools.spare_copies import refill


@dataclass(frozen=True)
class CodedEpoch:
    """One coded exchange, against the uncoded exchange from the same caches.

    Attributes:
        scheme: ``coded`` or ``uber``.
        copies: caches holding a sample, on average, before the exchange.
        uncoded: the exchange sent sample by sample (spares already in place
            need nothing).
        coded: the scheme's exchange, under the planner's sender rule.
        sent: samples' worth each node puts on the wire (a multicast once).
        received: samples' worth each node takes in (a multicast at each decoder).
        uncoded_nodes: the same two for the uncoded exchange.
    """

    scheme: str
    copies: float
    uncoded: Load
    coded: Load
    sent: np.ndarray
    received: np.ndarray
    uncoded_nodes: NodeBytes

    @property
    def saved(self) -> float:
        """The fraction of the uncoded exchange's transmissions that coding saves."""
        return 1.0 - self.coded.transmissions / self.uncoded.transmissions if self.uncoded.transmissions else 0.0


def node_traffic(packets: Packets, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples' worth each node sends and receives for ``packets`` (:func:`.coding_payoff.node_bytes`)."""
    traffic = node_bytes(packets, num_nodes)
    return traffic.sent, traffic.received


class CodedExchanges:
    """The caches of a job's nodes across its exchanges, and each exchange's packets.

    Args:
        owners: the owners staged in epoch 0 (each node caches its share).
        num_nodes: M.
        capacity: samples a cache holds; a node's share stays even beyond it.
        scheme: ``coded`` or ``uber``.
        seed: the draw of which spares stay.
    """

    def __init__(self, owners: np.ndarray, num_nodes: int, capacity: int, scheme: str, seed: int) -> None:
        self.num_nodes, self.capacity, self.scheme = num_nodes, capacity, scheme
        self._rng = np.random.default_rng([seed, 2])
        self.caches = [np.flatnonzero(owners == node) for node in range(num_nodes)]

    def exchange(self, owners: np.ndarray) -> CodedEpoch:
        """Plans the exchange to ``owners`` from the caches, then moves the caches on."""
        holders = holder_bits(self.caches, len(owners))
        packets, uncoded = plan(holders, owners, self.scheme), plan(holders, owners, "none")
        sent, received = node_traffic(packets, self.num_nodes)
        epoch = CodedEpoch(
            self.scheme,
            float(np.bitwise_count(holders).sum()) / len(owners),
            load(uncoded),
            load(packets),
            sent,
            received,
            node_bytes(uncoded, self.num_nodes),
        )
        self.caches = refill(self.caches, owners, self.capacity, self._rng)
        return epoch
