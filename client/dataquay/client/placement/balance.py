"""Mode ``locality``'s split of each global batch over the nodes that hold its bytes.

A greedy balancer evens the nodes' shares of every global batch, all batches
at once; :mod:`~dataquay.client.placement.modes` reads a node's ids from it
and :func:`~dataquay.client.placement.epochs.locality_balance` its cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dataquay.client.placement.orders import epoch_permutation

if TYPE_CHECKING:
    from dataquay.client.placement.plan import JobPlan


def global_batches(plan: JobPlan) -> int:
    """Global batches of W * b per epoch: the partial last one dropped or padded."""
    global_batch = plan.world_size * plan.settings.batch_size
    if plan.settings.drop_last:
        return plan.num_samples // global_batch
    return -(-plan.num_samples // global_batch)


def batch_counts(plan: JobPlan, epoch: int, epoch_owners: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's ids in global batch order (padded or cut to whole batches),
    each id's (batch, owner) as one key, batch * M + owner, and how many of
    each batch every node owns (batches x nodes)."""
    num_batches, width = global_batches(plan), plan.world_size * plan.settings.batch_size
    order = np.resize(epoch_permutation(plan.num_samples, plan.settings.seed, epoch), num_batches * width)
    key = np.arange(len(order), dtype=np.int64) // width * plan.num_nodes
    key += epoch_owners[order]
    counts = np.bincount(key, minlength=num_batches * plan.num_nodes).reshape(num_batches, plan.num_nodes)
    return order, key, counts


def greedy_transfers(counts: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
        return empty, empty, empty, empty
    batch, source, sink, amount = (np.concatenate(parts).astype(np.int64) for parts in zip(*rounds))
    return batch, source, sink, amount


def _within_groups(groups: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Exclusive running sums of ``sizes`` restarted at each new value of ``groups`` (sorted)."""
    before = np.cumsum(sizes) - sizes
    starts = np.flatnonzero(np.diff(groups, prepend=-1))
    return before - np.repeat(before[starts], np.diff(np.append(starts, len(groups))))


def locality_node(plan: JobPlan, epoch: int, epoch_owners: np.ndarray, node: int) -> np.ndarray:
    """``node``'s share of every global batch of ``epoch`` (batches x g*b ids).

    A node keeps the first g*b of its samples in batch order and gives the
    rest, in order, to its transfers in the order the balancer made them; a
    receiver appends what it receives, in the same order, after its own. Only
    the groups that send to ``node`` are sorted, so one node costs O(N).
    """
    num_nodes, share = plan.num_nodes, plan.settings.ranks_per_node * plan.settings.batch_size
    order, key, counts = batch_counts(plan, epoch, epoch_owners)
    own = counts[:, node]
    slots = np.empty((len(counts), share), dtype=np.int64)
    mine = np.flatnonzero(key % num_nodes == node)
    batch_of_mine = mine // (plan.world_size * plan.settings.batch_size)
    place = np.arange(len(mine)) - np.repeat(np.cumsum(own) - own, own)
    kept = place < share
    slots[batch_of_mine[kept], place[kept]] = order[mine[kept]]

    batch, source, sink, amount = greedy_transfers(counts, share)
    sender = batch * num_nodes + source
    by_sender = np.argsort(sender, kind="stable")
    given_before = np.empty_like(amount)
    given_before[by_sender] = _within_groups(sender[by_sender], amount[by_sender])
    into = np.flatnonzero(sink == node)
    into = into[np.argsort(batch[into], kind="stable")]
    size = amount[into]
    received_before = _within_groups(batch[into], size)

    wanted = np.zeros(len(counts) * num_nodes, dtype=bool)
    wanted[sender[into]] = True
    from_senders = np.flatnonzero(wanted[key])
    from_senders = from_senders[np.argsort(key[from_senders], kind="stable")]
    groups = np.flatnonzero(wanted)
    group_first = np.cumsum(counts.ravel()[groups]) - counts.ravel()[groups]
    first = group_first[np.searchsorted(groups, sender[into])] + share + given_before[into]
    step = np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)
    slots[np.repeat(batch[into], size), np.repeat(own[batch[into]] + received_before, size) + step] = order[
        from_senders[np.repeat(first, size) + step]
    ]
    return slots
