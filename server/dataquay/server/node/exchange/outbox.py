"""What one node ships in one exchange, and how far it got: a ledger with no I/O.

Every sample the node gives away is in exactly one state. The sender takes
pending ids in chunks (in flight), and the receiver's replies settle them:
delivered (committed there, or already held), refused (the receiver could not
store it), or back to pending when a stream broke. Ids this node does not hold
are unavailable: their new owner reads them from the PFS. Only delivered ids
may ever be deleted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PENDING, IN_FLIGHT, DELIVERED, REFUSED, UNAVAILABLE = range(5)


@dataclass(frozen=True)
class OutboxProgress:
    total_samples: int
    total_bytes: int
    delivered_samples: int
    delivered_bytes: int
    sent_bytes: int
    unavailable_samples: int
    refused_samples: int

    @property
    def settled(self) -> bool:
        """Nothing pending or in flight: every id has its final state."""
        return self.delivered_samples + self.unavailable_samples + self.refused_samples == self.total_samples


class Outbox:
    """The give-aways of one node for one epoch, by receiver.

    Args:
        ids: sample ids this node gives away, any order.
        receivers: the receiving node of each id (its index in the job).
        sizes: payload bytes of each id.
    """

    def __init__(self, ids: np.ndarray, receivers: np.ndarray, sizes: np.ndarray) -> None:
        order = np.lexsort((ids, receivers))
        self.ids = np.asarray(ids, dtype=np.int64)[order]
        self.receivers = np.asarray(receivers, dtype=np.int64)[order]
        self.sizes = np.asarray(sizes, dtype=np.int64)[order]
        self.state = np.full(len(self.ids), PENDING, dtype=np.int8)
        self.sent_bytes = 0
        self._position = {int(sample_id): i for i, sample_id in enumerate(self.ids.tolist())}

    def receivers_left(self) -> list[int]:
        """Receivers that still have pending ids."""
        return np.unique(self.receivers[self.state == PENDING]).tolist()

    def pending(self, receiver: int) -> np.ndarray:
        """The receiver's ids not yet settled or in flight, ascending."""
        return self.ids[(self.receivers == receiver) & (self.state == PENDING)]

    def take(self, receiver: int, max_bytes: int, max_items: int, upto: int | None = None) -> np.ndarray:
        """The next pending ids of ``receiver`` (ids up to ``upto`` only, if
        given): at least one if any, ``max_items`` and ``max_bytes`` at most
        otherwise. They are in flight from now on."""
        mask = (self.receivers == receiver) & (self.state == PENDING)
        if upto is not None:
            mask &= self.ids <= upto
        rows = np.flatnonzero(mask)
        if not len(rows):
            return self.ids[rows]
        fits = int(np.searchsorted(np.cumsum(self.sizes[rows]), max_bytes, side="right"))
        rows = rows[: max(1, min(fits, max_items))]
        self.state[rows] = IN_FLIGHT
        return self.ids[rows]

    def delivered(self, ids: np.ndarray | list[int], sent: bool = True) -> int:
        """The receiver holds ``ids``: committed from this stream (``sent``) or
        held before. Returns the payload bytes this newly counts as sent."""
        rows = self._rows(ids)
        fresh = rows[self.state[rows] != DELIVERED]
        self.state[fresh] = DELIVERED
        nbytes = int(self.sizes[fresh].sum()) if sent else 0
        self.sent_bytes += nbytes
        return nbytes

    def unsettled(self, ids: np.ndarray | list[int], final: int) -> None:
        """Ids in flight that came back without an acknowledgement: ``final``
        is PENDING (try again), REFUSED or UNAVAILABLE."""
        rows = self._rows(ids)
        rows = rows[self.state[rows] == IN_FLIGHT] if final == PENDING else rows[self.state[rows] != DELIVERED]
        self.state[rows] = final

    def delivered_ids(self) -> np.ndarray:
        return self.ids[self.state == DELIVERED]

    def progress(self) -> OutboxProgress:
        delivered = self.state == DELIVERED
        return OutboxProgress(
            total_samples=len(self.ids),
            total_bytes=int(self.sizes.sum()),
            delivered_samples=int(delivered.sum()),
            delivered_bytes=int(self.sizes[delivered].sum()),
            sent_bytes=self.sent_bytes,
            unavailable_samples=int((self.state == UNAVAILABLE).sum()),
            refused_samples=int((self.state == REFUSED).sum()),
        )

    def _rows(self, ids: np.ndarray | list[int]) -> np.ndarray:
        """Row of each known id, once each."""
        position = self._position
        return np.unique(np.fromiter((position[int(i)] for i in ids if int(i) in position), dtype=np.int64))
