"""What the parties of a job ask of an epoch: owners, rank orders, moves, steps, balance, re-forming.

Each answer validates its arguments and asks the job's mode
(:data:`~dataquay.client.placement.modes.MODES`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dataquay.client.placement.balance import BatchBalance, LocalityEpoch, balance_epoch
from dataquay.client.placement.modes import MODES
from dataquay.client.placement.orders import check_epoch
from dataquay.client.placement.plan import JobPlan, check_rank, check_ranks_known


def owners(plan: JobPlan, epoch: int, previous: np.ndarray | None = None) -> np.ndarray:
    """The node (0..M-1) that owns each sample of ``plan`` in ``epoch`` (int32).

    Args:
        plan: the job.
        epoch: 0 or more.
        previous: the owners of ``epoch - 1``, if the caller keeps them; modes
            whose ownership moves then need one step instead of a replay.

    Raises:
        ValueError: a negative epoch, or ``previous`` of the wrong length.
    """
    check_epoch(epoch)
    if previous is not None and len(previous) != plan.num_samples:
        raise ValueError(f"previous owners have {len(previous)} entries for {plan.num_samples} samples")
    return MODES[plan.settings.mode].owners(plan, epoch, previous)


def reform(before: JobPlan, after: JobPlan, epoch: int, previous: np.ndarray | None = None) -> np.ndarray:
    """The owners of ``epoch`` on ``after``'s nodes, for a job re-formed there from ``before``'s (int32).

    Modes whose owners stay take the stable placement on the new node set
    (:func:`owners`), which moves about 1/M of the samples. Modes whose
    owners move keep their history: every sample stays on its node if that
    node is still in the job, unless the stable placement on the new set
    gives it to a node that joined; a departed node's samples go where that
    placement puts them. So a leave moves the departed share and a join the
    newcomer's, each about 1/M, and the exchange steps on from the result
    (pass it as ``previous`` to :func:`owners` of ``after`` for epoch + 1).

    Args:
        before: the job on its old node set.
        after: the same job on its new one (same dataset, sizes and settings
            but the nodes).
        epoch: the epoch whose owners ``previous`` are.
        previous: the owners of ``epoch`` under ``before``, if the caller
            keeps them; else they are replayed.

    Raises:
        ValueError: a negative epoch, ``previous`` of the wrong length, or
            plans of other sizes or modes.
    """
    check_epoch(epoch)
    if (before.num_samples, before.settings.mode) != (after.num_samples, after.settings.mode):
        raise ValueError(
            f"a re-formed job keeps its samples and mode: {before.num_samples} samples in mode "
            f"{before.settings.mode}, not {after.num_samples} in mode {after.settings.mode}"
        )
    if not MODES[after.settings.mode].owners_move:
        return owners(after, epoch)
    if previous is not None and len(previous) != before.num_samples:
        raise ValueError(f"previous owners have {len(previous)} entries for {before.num_samples} samples")
    held = owners(before, epoch) if previous is None else np.asarray(previous)
    index = {name: node for node, name in enumerate(after.nodes)}
    staying = np.array([index.get(name, -1) for name in before.nodes], dtype=np.int32)
    current = staying[held]
    placed = owners(after, 0)
    old = set(before.nodes)
    joined = [node for node, name in enumerate(after.nodes) if name not in old]
    moving = (current < 0) | np.isin(placed, joined)
    current[moving] = placed[moving]
    return current


def rank_order(plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None = None) -> np.ndarray:
    """The ids rank ``rank`` of ``plan`` reads in ``epoch``, in reading order (int64).

    Every rank gets :func:`rank_length` ids. ``epoch_owners`` (this epoch's
    :func:`owners`) saves their computation in modes that need them.

    Raises:
        ValueError: a negative epoch, a rank outside 0..world_size-1, or
            ranks per node not known yet.
    """
    check_epoch(epoch)
    check_rank(plan, rank)
    return MODES[plan.settings.mode].rank_order(plan, epoch, rank, epoch_owners)


def rank_length(plan: JobPlan) -> int:
    """How many ids every rank of ``plan`` reads per epoch.

    Raises:
        ValueError: the plan's ranks per node are not known yet.
    """
    check_ranks_known(plan)
    return MODES[plan.settings.mode].rank_length(plan)


def node_of_rank(plan: JobPlan, rank: int) -> int:
    """The node (0..M-1) rank ``rank`` runs on: ranks fill nodes g at a time.

    Raises:
        ValueError: a rank outside 0..world_size-1, or ranks per node not known yet.
    """
    check_rank(plan, rank)
    return rank // plan.settings.ranks_per_node


class Moves(NamedTuple):
    """Samples whose owner changes from one epoch to the next, ascending by id."""

    ids: np.ndarray  #: int64 sample ids
    sources: np.ndarray  #: int32 owner in the epoch before
    targets: np.ndarray  #: int32 owner in the epoch


def moves(plan: JobPlan, epoch: int, previous: np.ndarray | None = None) -> Moves:
    """What the exchange before ``epoch`` ships: every sample whose owner changes.

    Empty for epoch 0 and for modes whose ownership never moves; for
    ``partial``, node m sends at most round(q * owned) samples (some of its
    picks may be dealt back to itself).

    Args:
        plan: the job.
        epoch: 0 or more.
        previous: the owners of ``epoch - 1``, if the caller keeps them.

    Raises:
        ValueError: a negative epoch, or ``previous`` of the wrong length.
    """
    check_epoch(epoch)
    if epoch == 0:
        before = after = owners(plan, 0)
    else:
        before = owners(plan, epoch - 1) if previous is None else np.asarray(previous)
        after = owners(plan, epoch, before)
    ids = np.flatnonzero(before != after).astype(np.int64, copy=False)
    return Moves(ids, before[ids].astype(np.int32, copy=False), after[ids].astype(np.int32, copy=False))


def node_steps(plan: JobPlan, epoch: int, node: int) -> list[np.ndarray]:
    """What ``node``'s ranks read at each step of ``epoch``: per step, the
    ``plan.settings.batch_size`` ids of each of its ranks, rank after rank (int64).

    For a daemon that fetches the samples its ranks will need from other
    nodes a few steps ahead of them.

    Raises:
        ValueError: a negative epoch, ranks per node not known yet, no batch
            size, or a node outside 0..M-1.
    """
    check_epoch(epoch)
    check_ranks_known(plan)
    MODES["locality"].check_settings(plan.settings.q, plan.settings.batch_size)
    if not 0 <= node < plan.num_nodes:
        raise ValueError(f"node must be in 0..{plan.num_nodes - 1}, not {node}")
    epoch_owners = owners(plan, epoch)
    if plan.settings.mode == "locality":
        return list(balance_epoch(plan, epoch, epoch_owners).node_slots(node))
    g, b = plan.settings.ranks_per_node, plan.settings.batch_size
    orders = [rank_order(plan, epoch, rank, epoch_owners) for rank in range(node * g, (node + 1) * g)]
    return [np.concatenate([order[start : start + b] for order in orders]) for start in range(0, rank_length(plan), b)]


def node_orders(plan: JobPlan, epoch: int, node: int, epoch_owners: np.ndarray | None = None) -> np.ndarray:
    """What each of ``node``'s ranks reads in ``epoch``: one row per rank, in
    reading order (int64, g x :func:`rank_length`).

    For a daemon that reads ahead of its ranks: column p is what they need
    at their p-th sample, in every mode, with or without a batch size.
    ``epoch_owners`` (this epoch's :func:`owners`) saves their computation.

    Raises:
        ValueError: a negative epoch, ranks per node not known yet, or a node
            outside 0..M-1.
    """
    check_epoch(epoch)
    check_ranks_known(plan)
    if not 0 <= node < plan.num_nodes:
        raise ValueError(f"node must be in 0..{plan.num_nodes - 1}, not {node}")
    if epoch_owners is None:
        epoch_owners = owners(plan, epoch)
    g = plan.settings.ranks_per_node
    if plan.settings.mode == "locality":
        steps = balance_epoch(plan, epoch, epoch_owners).node_slots(node)
        return np.stack([steps[:, local::g].ravel() for local in range(g)])
    return np.stack([rank_order(plan, epoch, rank, epoch_owners) for rank in range(node * g, (node + 1) * g)])


class NodeReads(NamedTuple):
    """When the ranks of one node read each sample in an epoch."""

    rank: np.ndarray  #: int32 the rank that reads the sample first, -1 if none of the node's ranks does
    position: np.ndarray  #: int64 its position in that rank's order, -1 likewise


def node_reads(plan: JobPlan, epoch: int, node: int, epoch_owners: np.ndarray | None = None) -> NodeReads:
    """Which rank of ``node`` reads each sample in ``epoch``, and at which position.

    A daemon ships the samples it gives away in the order its ranks read them,
    and knows which are read from how far each rank got.

    Raises:
        ValueError: as :func:`node_orders`.
    """
    orders = node_orders(plan, epoch, node, epoch_owners)
    rank_of = np.full(plan.num_samples, -1, dtype=np.int32)
    position = np.full(plan.num_samples, -1, dtype=np.int64)
    for local, order in enumerate(orders):
        # Reversed, so that a sample read twice (padding) keeps its first position.
        first = order[::-1]
        unseen = rank_of[first] < 0
        rank_of[first[unseen]] = node * plan.settings.ranks_per_node + local
        position[first[unseen]] = np.arange(len(order) - 1, -1, -1)[unseen]
    return NodeReads(rank_of, position)


def owner_read_positions(plan: JobPlan, epoch: int, epoch_owners: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each of ``ids``'s position in the order of the rank of its owner in
    ``epoch`` that reads it then (-1 where none of them does): where a sample
    stands in its reader's epoch, for the exchange that brings it there."""
    at = np.full(len(ids), -1, dtype=np.int64)
    holders = epoch_owners[ids]
    for node in np.unique(holders).tolist():
        theirs = holders == node
        at[theirs] = node_reads(plan, epoch, node, epoch_owners).position[ids[theirs]]
    return at


def locality_epoch(plan: JobPlan, epoch: int, epoch_owners: np.ndarray | None = None) -> LocalityEpoch:
    """Mode ``locality``'s plan of ``epoch``, computed once for every rank's
    order (:meth:`~LocalityEpoch.rank_order`), node's share
    (:meth:`~LocalityEpoch.node_slots`) and the balancer's cost
    (:meth:`~LocalityEpoch.balance`).

    A process that asks several of them saves the passes over all samples
    they share. Describes ``plan``'s batch size whatever its mode.
    ``epoch_owners`` (this epoch's :func:`owners`) saves their computation.

    Raises:
        ValueError: a negative epoch, ranks per node not known yet, no
            batch size, or ``epoch_owners`` of the wrong length.
    """
    check_epoch(epoch)
    check_ranks_known(plan)
    MODES["locality"].check_settings(plan.settings.q, plan.settings.batch_size)
    if epoch_owners is None:
        epoch_owners = owners(plan, epoch)
    elif len(epoch_owners) != plan.num_samples:
        raise ValueError(f"epoch owners have {len(epoch_owners)} entries for {plan.num_samples} samples")
    return balance_epoch(plan, epoch, epoch_owners)


def locality_balance(plan: JobPlan, epoch: int, epoch_owners: np.ndarray | None = None) -> BatchBalance:
    """The network cost of each global batch of ``epoch`` under mode ``locality``.

    For simulators and the exchange engine: the split itself is
    :func:`rank_order`'s. Describes ``plan``'s batch size whatever its mode.
    ``epoch_owners`` (this epoch's :func:`owners`) saves their computation.

    Raises:
        ValueError: as :func:`locality_epoch`.
    """
    return locality_epoch(plan, epoch, epoch_owners).balance()
