"""What one node ships in one exchange, and how far it got: a ledger with no I/O.

Every sample the node gives away is in exactly one state. The sender takes
pending ids in chunks (in flight), and the receiver's replies settle them:
delivered (committed there, or already held), refused (the receiver could not
store it), or back to pending when a stream broke. Ids this node does not hold
are unavailable: their new owner reads them from the PFS. Only delivered ids
may ever be deleted here, and then they are dropped.

A receiver's ids go out in the order this node's ranks read them in the
current epoch, so the first to arrive are the first that may be deleted here:
what a node takes in then keeps pace with what it lets go. An id the
receiver's ranks read early in the next epoch goes sooner, by its ``due``
position: a rank's read-ahead asks for the next epoch's first batches while
this node's ranks still read the current one. A receiver whose
cache is short of its share takes only ids this node's ranks have read, which
are deleted here as soon as they are delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PENDING, IN_FLIGHT, DELIVERED, REFUSED, UNAVAILABLE, DROPPED = range(6)
#: Rows looked at in one step when looking for a receiver's next pending ids.
SCAN_ROWS = 4096


def acknowledged(sent: np.ndarray, held: Sequence[int]) -> np.ndarray:
    """The ids of ``sent`` that a receiver's reply names as held, in the order
    sent. A reply settles only what it answers: an id it names that was not
    sent in that chunk or offer (another chunk's, another receiver's, no
    sample id at all) counts for nothing, or a receiver could have the
    sender count samples delivered that it never took."""
    named = np.fromiter(held, dtype=np.uint64, count=len(held))
    mine = sent.astype(np.uint64)
    if len(named) == len(mine) and np.array_equal(named, mine):
        return sent  # as a rule every id comes back, in order
    return sent[np.isin(mine, named)]


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
        readers: the rank of this node that reads each id in the current
            epoch (an index into the positions :meth:`read_and_delivered`
            takes), -1 where none does; None: none is read here.
        read_at: the id's position in that rank's order.
        due: where in that order the id goes at the latest (-1: where it is
            read), so that it reaches the receiver before its ranks read it.
    """

    def __init__(
        self,
        ids: np.ndarray,
        receivers: np.ndarray,
        sizes: np.ndarray,
        readers: np.ndarray | None = None,
        read_at: np.ndarray | None = None,
        due: np.ndarray | None = None,
    ) -> None:
        unread = np.full(len(ids), -1, dtype=np.int64)
        readers = unread if readers is None else np.asarray(readers, dtype=np.int64)
        read_at = unread if read_at is None else np.asarray(read_at, dtype=np.int64)
        goes_at = read_at if due is None else np.where(due >= 0, np.minimum(read_at, due), read_at)
        order = np.lexsort((ids, read_at, goes_at, receivers))
        self.ids = np.asarray(ids, dtype=np.int64)[order]
        self.receivers = np.asarray(receivers, dtype=np.int64)[order]
        self.sizes = np.asarray(sizes, dtype=np.int64)[order]
        self.readers = readers[order]
        self.read_at = read_at[order]
        self.state = np.full(len(self.ids), PENDING, dtype=np.int8)
        self.sent_bytes = 0
        self._by_id = np.argsort(self.ids, kind="stable")
        self._sorted_ids = self.ids[self._by_id]
        #: Per receiver, a row before which none of its rows is pending: a
        #: chunk's look for pending ids starts there, not at the receiver's first row.
        self._first_pending: dict[int, int] = {}

    def receivers_left(self) -> list[int]:
        """Receivers that still have pending ids."""
        return np.unique(self.receivers[self.state == PENDING]).tolist()

    def pending(self, receiver: int) -> np.ndarray:
        """The receiver's ids not yet settled or in flight, in sending order."""
        return self.ids[(self.receivers == receiver) & (self.state == PENDING)]

    def offer(self, receiver: int, max_items: int) -> tuple[np.ndarray, int]:
        """The receiver's next ``max_items`` pending ids, to name in an offer,
        and the row to pass :meth:`take` as ``upto`` so it hands out only those."""
        rows = self._pending_rows(receiver, most_items=max_items)[:max_items]
        return self.ids[rows], int(rows[-1]) if len(rows) else -1

    def take(
        self,
        receiver: int,
        max_bytes: int,
        max_items: int,
        upto: int | None = None,
        read_upto: np.ndarray | None = None,
    ) -> np.ndarray:
        """The next pending ids of ``receiver`` in sending order (from rows up
        to ``upto`` only, if given; only ids read as :meth:`read_and_delivered`
        counts them, if ``read_upto`` is given): at least one if any,
        ``max_items`` and ``max_bytes`` at most otherwise. They are in flight
        from now on."""
        rows = self._pending_rows(receiver, upto, read_upto, max_items, max_bytes)
        if not len(rows):
            return self.ids[rows]
        fits = int(np.searchsorted(np.cumsum(self.sizes[rows]), max_bytes, side="right"))
        rows = rows[: max(1, min(fits, max_items))]
        self.state[rows] = IN_FLIGHT
        return self.ids[rows]

    def pending_upto(self, receiver: int, upto: int | None = None) -> bool:
        """Whether ``receiver`` has pending ids in rows up to ``upto``."""
        return bool(len(self._pending_rows(receiver, upto, most_items=1)))

    def delivered(self, ids: np.ndarray | list[int], sent: bool = True) -> int:
        """The receiver holds ``ids``: committed from this stream (``sent``) or
        held before. Returns the payload bytes this newly counts as sent."""
        rows = self._rows(ids)
        fresh = rows[(self.state[rows] != DELIVERED) & (self.state[rows] != DROPPED)]
        self.state[fresh] = DELIVERED
        nbytes = int(self.sizes[fresh].sum()) if sent else 0
        self.sent_bytes += nbytes
        return nbytes

    def unsettled(self, ids: np.ndarray | list[int], final: int) -> None:
        """Ids in flight that came back without an acknowledgement: ``final``
        is PENDING (try again), REFUSED or UNAVAILABLE."""
        rows = self._rows(ids)
        if final == PENDING:
            rows = rows[self.state[rows] == IN_FLIGHT]
            # Rows are in receiver order: each receiver's first is its lowest.
            receivers, first = np.unique(self.receivers[rows], return_index=True)
            for receiver, row in zip(receivers.tolist(), rows[first].tolist()):
                self._first_pending[receiver] = min(self._first_pending.get(receiver, row), row)
        else:
            rows = rows[(self.state[rows] != DELIVERED) & (self.state[rows] != DROPPED)]
        self.state[rows] = final

    def delivered_ids(self) -> np.ndarray:
        """Ids delivered and still held here."""
        return self.ids[self.state == DELIVERED]

    def undelivered_ids(self) -> np.ndarray:
        """Ids held here that never reached their receiver (pending, in flight or refused)."""
        return self.ids[(self.state == PENDING) | (self.state == IN_FLIGHT) | (self.state == REFUSED)]

    def read_pending(self, read_upto: np.ndarray, max_bytes: int) -> np.ndarray:
        """Pending ids this node's ranks have read: the first, in sending
        order, that add up to ``max_bytes`` (all of them if they add up to less)."""
        rows = np.flatnonzero(self.state == PENDING)
        rows = rows[self._read(rows, read_upto)]
        fits = int(np.searchsorted(np.cumsum(self.sizes[rows]), max_bytes, side="left")) + 1
        return self.ids[rows[:fits]]

    def read_and_delivered(self, read_upto: np.ndarray) -> np.ndarray:
        """Delivered ids still held here that this node's ranks have read:
        ``read_upto[r]`` is how many ids of its order reader ``r`` has read."""
        rows = np.flatnonzero(self.state == DELIVERED)
        return self.ids[rows[self._read(rows, read_upto)]]

    def all_read(self, read_upto: np.ndarray) -> bool:
        """Whether this node's ranks have read every id given away (as
        :meth:`read_and_delivered` counts them)."""
        return bool(self._read(np.arange(len(self.ids)), read_upto).all())

    def dropped(self, ids: np.ndarray | list[int]) -> None:
        """Delivered ``ids`` are deleted here."""
        rows = self._rows(ids)
        self.state[rows[self.state[rows] == DELIVERED]] = DROPPED

    def progress(self) -> OutboxProgress:
        delivered = (self.state == DELIVERED) | (self.state == DROPPED)
        return OutboxProgress(
            total_samples=len(self.ids),
            total_bytes=int(self.sizes.sum()),
            delivered_samples=int(delivered.sum()),
            delivered_bytes=int(self.sizes[delivered].sum()),
            sent_bytes=self.sent_bytes,
            unavailable_samples=int((self.state == UNAVAILABLE).sum()),
            refused_samples=int((self.state == REFUSED).sum()),
        )

    def _pending_rows(
        self,
        receiver: int,
        upto: int | None = None,
        read_upto: np.ndarray | None = None,
        most_items: int | None = None,
        most_bytes: int | None = None,
    ) -> np.ndarray:
        """The receiver's pending rows in sending order (up to row ``upto``;
        read ones only, given ``read_upto``): all of them, or once there are
        ``most_items`` or ``most_bytes``, those found so far. A chunk's look
        then costs about the chunk, not the whole outbox."""
        start, end = (int(bound) for bound in np.searchsorted(self.receivers, (receiver, receiver + 1)))
        if upto is not None:
            end = min(end, upto + 1)
        at = max(start, self._first_pending.get(receiver, start))
        found: list[np.ndarray] = []
        first_pending = -1
        items = nbytes = 0
        while at < end:
            stop = min(end, at + SCAN_ROWS)
            rows = at + np.flatnonzero(self.state[at:stop] == PENDING)
            at = stop
            if first_pending < 0 and len(rows):
                first_pending = int(rows[0])
            if read_upto is not None:
                rows = rows[self._read(rows, read_upto)]
            found.append(rows)
            items += len(rows)
            nbytes += int(self.sizes[rows].sum())
            if (most_items is not None and items >= most_items) or (most_bytes is not None and nbytes >= most_bytes):
                break
        self._first_pending[receiver] = first_pending if first_pending >= 0 else at
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def _read(self, rows: np.ndarray, read_upto: np.ndarray) -> np.ndarray:
        """Which of ``rows`` this node's ranks have read (those no rank reads here count as read)."""
        readers = self.readers[rows]
        read = readers < 0
        read[~read] = self.read_at[rows[~read]] < read_upto[readers[~read]]
        return read

    def _rows(self, ids: np.ndarray | list[int]) -> np.ndarray:
        """Row of each known id, once each."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if not len(self.ids) or not len(ids):
            return np.empty(0, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._sorted_ids, ids), len(self._sorted_ids) - 1)
        return np.unique(self._by_id[at[self._sorted_ids[at] == ids]])
