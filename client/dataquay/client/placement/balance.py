"""Mode ``locality``'s split of each global batch over the nodes that hold its bytes.

A greedy balancer evens the nodes' shares of every global batch, all batches
at once. Everything a rank's order, a node's steps and the balancer's cost
share (the epoch's order, the owner at each position, the per-batch counts,
the transfers) is computed once per epoch, in a :class:`LocalityEpoch`:
at 10^7 samples a pass over all of them costs a tenth of a second and each
temporary of their size as much again, so an epoch makes each pass once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dataquay.client.placement.orders import epoch_permutation
from dataquay.client.placement.plan import check_rank

if TYPE_CHECKING:
    from dataquay.client.placement.plan import JobPlan

#: Batch positions keyed per pass when counting or searching: whole batches
#: of about this many, so that the keys stay small and warm in the cache.
CHUNK = 1 << 20


class Transfers(NamedTuple):
    """The balancer's moves, ordered by round, then batch (int64 each)."""

    batch: np.ndarray
    source: np.ndarray
    target: np.ndarray
    amount: np.ndarray


class BatchBalance(NamedTuple):
    """What ``locality``'s balancer does to each global batch of an epoch."""

    transfers: np.ndarray  #: int64 (source, target) node pairs per batch, at most M-1
    moved: np.ndarray  #: int64 samples that cross the network per batch (the sum of deficits)
    imbalance: np.ndarray  #: float64 ``moved`` as a percentage of the global batch W * b


def global_batches(plan: JobPlan) -> int:
    """Global batches of W * b per epoch: the partial last one dropped or padded."""
    global_batch = plan.world_size * plan.settings.batch_size
    if plan.settings.drop_last:
        return plan.num_samples // global_batch
    return -(-plan.num_samples // global_batch)


@dataclass(frozen=True, eq=False)
class LocalityEpoch:
    """One epoch of mode ``locality``, computed once for every question asked of it.

    The epoch's batch order is its permutation cut or padded (by repeating it
    from its start) to whole global batches of W * b; position p of it holds
    ``order[p % N]``. Built by :func:`balance_epoch`.
    """

    plan: JobPlan
    order: np.ndarray  #: the epoch's permutation of the ids (int64)
    owner_at: np.ndarray  #: the owner of each batch position (uint16 up to 65,536 nodes, else int32)
    counts: np.ndarray  #: how many of each batch every node owns (int64, batches x nodes)
    transfers: Transfers

    def node_slots(self, node: int) -> np.ndarray:
        """``node``'s share of every global batch (int64, batches x g*b ids).

        A node keeps the first g*b of its samples in batch order and gives the
        rest, in order, to its transfers in the order the balancer made them; a
        receiver appends what it receives, in the same order, after its own.
        Only the batches that send to ``node`` are searched, so one node costs
        a pass over the owners at most.

        Raises:
            ValueError: a node outside 0..M-1.
        """
        if not 0 <= node < self.plan.num_nodes:
            raise ValueError(f"node must be in 0..{self.plan.num_nodes - 1}, not {node}")
        num_nodes, share = self.plan.num_nodes, self.plan.settings.ranks_per_node * self.plan.settings.batch_size
        counts, width = self.counts, _width(self.plan)
        own = counts[:, node]
        slots = np.empty((len(counts), share), dtype=np.int64)
        mine = np.flatnonzero(self.owner_at == node)
        place = np.arange(len(mine)) - np.repeat(np.cumsum(own) - own, own)
        kept = place < share
        slots[mine[kept] // width, place[kept]] = self._ids_at(mine[kept])

        batch, source, sink, amount = self.transfers
        sender = batch * num_nodes + source
        by_sender = np.argsort(sender, kind="stable")
        given_before = np.empty_like(amount)
        given_before[by_sender] = _within_groups(sender[by_sender], amount[by_sender])
        into = np.flatnonzero(sink == node)
        into = into[np.argsort(batch[into], kind="stable")]
        size = amount[into]
        received_before = _within_groups(batch[into], size)

        wanted = np.zeros(counts.size, dtype=bool)
        wanted[sender[into]] = True
        from_senders = self._positions_of(wanted)
        groups = np.flatnonzero(wanted)
        group_first = np.cumsum(counts.ravel()[groups]) - counts.ravel()[groups]
        first = group_first[np.searchsorted(groups, sender[into])] + share + given_before[into]
        step = np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)
        slots[np.repeat(batch[into], size), np.repeat(own[batch[into]] + received_before, size) + step] = self._ids_at(
            from_senders[np.repeat(first, size) + step]
        )
        return slots

    def rank_order(self, rank: int) -> np.ndarray:
        """The ids ``rank`` reads: b of its node's share of each batch, every g-th (int64).

        Raises:
            ValueError: a rank outside 0..world_size-1.
        """
        check_rank(self.plan, rank)
        g = self.plan.settings.ranks_per_node
        node, local = divmod(rank, g)
        return self.node_slots(node)[:, local::g].ravel()

    def balance(self) -> BatchBalance:
        """The balancer's transfers and the samples they move, per batch."""
        batch, _, _, amount = self.transfers
        num_batches = len(self.counts)
        moved = np.bincount(batch, weights=amount, minlength=num_batches).astype(np.int64)
        return BatchBalance(
            np.bincount(batch, minlength=num_batches).astype(np.int64), moved, moved * 100.0 / _width(self.plan)
        )

    def _ids_at(self, positions: np.ndarray) -> np.ndarray:
        """The ids at these batch positions (the padding repeats the order)."""
        if len(self.owner_at) > len(self.order):
            positions = positions % len(self.order)
        return self.order[positions]

    def _positions_of(self, wanted: np.ndarray) -> np.ndarray:
        """The batch positions whose (batch, owner), as batch * M + owner, is ``wanted``,
        grouped by that key in ascending order, each group in position order (int64)."""
        num_nodes, width = self.plan.num_nodes, _width(self.plan)
        found = [
            first * width + np.flatnonzero(wanted[first * num_nodes : (first + rows) * num_nodes][keys])
            for first, rows, keys in _batch_keys(self.owner_at, width, num_nodes, wanted.reshape(self.counts.shape))
        ]
        positions = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
        key = positions // width * num_nodes + self.owner_at[positions]
        return positions[np.argsort(key, kind="stable")]


def balance_epoch(plan: JobPlan, epoch: int, epoch_owners: np.ndarray) -> LocalityEpoch:
    """Mode ``locality``'s split of ``epoch``: the batch order, the owner at
    each position, how many of each batch every node owns, and the balancer's transfers.

    The owners are gathered as 16-bit values when the nodes allow, which
    halves the random reads of the largest step, straight into the padded
    array.
    """
    num_batches, width = global_batches(plan), _width(plan)
    order = epoch_permutation(plan.num_samples, plan.settings.seed, epoch)
    small = np.uint16 if plan.num_nodes <= 1 << 16 else np.int32
    owner_at = np.empty(num_batches * width, dtype=small)
    head = min(len(owner_at), len(order))
    np.take(np.asarray(epoch_owners).astype(small), order[:head], out=owner_at[:head])
    if len(owner_at) > head:
        owner_at[head:] = owner_at[np.arange(len(owner_at) - head) % head]
    counts = np.empty((num_batches, plan.num_nodes), dtype=np.int64)
    for first, rows, keys in _batch_keys(owner_at, width, plan.num_nodes):
        counts[first : first + rows] = np.bincount(keys, minlength=rows * plan.num_nodes).reshape(rows, -1)
    transfers = greedy_transfers(counts, plan.settings.ranks_per_node * plan.settings.batch_size)
    return LocalityEpoch(plan, order, owner_at, counts, transfers)


def greedy_transfers(counts: np.ndarray, target: int) -> Transfers:
    """The balancer's transfers, all batches at once: (batch, source, target node, amount).

    Each round pairs, in every batch not yet even, the node of largest surplus
    with the node of largest deficit (lowest node on ties) and moves
    min(surplus, deficit); each move evens one of the two, so a batch needs at
    most M-1 rounds. Transfers come out ordered by round, then batch.
    """
    surplus = counts.astype(np.int64) - target
    active = np.flatnonzero(surplus.any(axis=1))
    rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    while len(active):
        rows = surplus[active]
        source, sink = rows.argmax(axis=1), rows.argmin(axis=1)
        picked = np.arange(len(active))
        amount = np.minimum(rows[picked, source], -rows[picked, sink])
        surplus[active, source] -= amount
        surplus[active, sink] += amount
        rounds.append((active, source, sink, amount))
        active = active[surplus[active].any(axis=1)]
    if not rounds:
        empty = np.empty(0, dtype=np.int64)
        return Transfers(empty, empty, empty, empty)
    return Transfers(*(np.concatenate(parts).astype(np.int64) for parts in zip(*rounds)))


def _width(plan: JobPlan) -> int:
    """The global batch, W * b ids."""
    return plan.world_size * plan.settings.batch_size


def _batch_keys(
    owner_at: np.ndarray, width: int, num_nodes: int, wanted: np.ndarray | None = None
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Each position's (batch, owner) as one key, a chunk of whole batches at a
    time: (first batch, batches, keys counted from the first batch's).

    Chunks with no ``wanted`` row (batches x nodes), when given, are skipped.
    """
    per_chunk, num_batches = max(1, CHUNK // width), len(owner_at) // width
    base = np.arange(min(per_chunk * width, len(owner_at)), dtype=np.intp) // width * num_nodes
    for first in range(0, num_batches, per_chunk):
        rows = min(per_chunk, num_batches - first)
        if wanted is not None and not wanted[first : first + rows].any():
            continue
        yield first, rows, base[: rows * width] + owner_at[first * width : (first + rows) * width]


def _within_groups(groups: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Exclusive running sums of ``sizes`` restarted at each new value of ``groups`` (sorted)."""
    before = np.cumsum(sizes) - sizes
    starts = np.flatnonzero(np.diff(groups, prepend=-1))
    return before - np.repeat(before[starts], np.diff(np.append(starts, len(groups))))
