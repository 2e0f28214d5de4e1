"""The placement modes: how a job's samples move between nodes and reach its ranks.

Modes are the entries of one registry, :data:`MODES`; callers go through
:mod:`~dataquay.client.placement.epochs`, so adding a mode changes no caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from dataquay.client.placement.balance import balance_epoch, global_batches
from dataquay.client.placement.orders import (
    EXCHANGE_PICKS_KEY,
    EXCHANGE_POOL_KEY,
    NODE_ORDER_KEY,
    epoch_permutation,
    keyed_generator,
    rank_split,
    samples_per_rank,
)
from dataquay.client.placement.partition import initial_owners

if TYPE_CHECKING:
    from dataquay.client.placement.plan import JobPlan


class Mode(Protocol):
    """How a job's samples move between nodes and reach its ranks, epoch by epoch.

    A mode is an entry of :data:`MODES`; callers go through :func:`owners`,
    :func:`rank_order` and :func:`rank_length`, so adding one changes no caller.
    Modes whose ownership moves (``partial``) derive epoch e's owners from
    epoch e-1's: callers that keep the current owner array (daemons) pass it as
    ``previous``, others get a replay from the initial partition.
    """

    #: Whether epoch e's owners derive from epoch e-1's, so that a caller
    #: stepping through epochs should keep them (see :func:`owners`).
    owners_move: bool

    def check_settings(self, q: float, batch_size: int) -> None:
        """Raises ValueError, naming the field, for a setting this mode cannot run with."""
        ...

    def owners(self, plan: JobPlan, epoch: int, previous: np.ndarray | None) -> np.ndarray:
        """The node holding each sample in ``epoch`` (int32, one per sample).

        ``previous`` is epoch-1's owners when the caller has them, else None.
        """
        ...

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        """The ids ``rank`` reads in ``epoch``, in order (int64).

        ``epoch_owners`` is this epoch's owners when the caller has them; a
        mode that needs them computes them when it is None.
        """
        ...

    def rank_length(self, plan: JobPlan) -> int:
        """How many ids every rank reads in every epoch (one count for all)."""
        ...


class _StaticOwners:
    """Modes whose bytes stay where the initial partition put them."""

    owners_move = False

    def check_settings(self, q: float, batch_size: int) -> None:
        pass

    def owners(self, plan: JobPlan, epoch: int, previous: np.ndarray | None) -> np.ndarray:
        settings = plan.settings
        return initial_owners(plan.num_samples, plan.nodes, settings.partition, plan.groups, settings.dataset)


class _Global(_StaticOwners):
    """One global permutation per epoch, dealt over all ranks; bytes never move.

    The training maths of a single-node DistributedSampler with the job's world
    size, while the initial partition spreads the bytes: most reads are peer
    hits (a partitioned cache).
    """

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        order = epoch_permutation(plan.num_samples, plan.settings.seed, epoch)
        return rank_split(order, rank, plan.world_size, plan.settings.drop_last)

    def rank_length(self, plan: JobPlan) -> int:
        return samples_per_rank(plan.num_samples, plan.world_size, plan.settings.drop_last)


class _Local(_StaticOwners):
    """Ownership never changes; each node deals a fresh permutation of what it owns.

    No sample ever crosses the network after staging, at the price of a
    shuffle that never mixes nodes. Every rank reads :meth:`rank_length` ids:
    node loads differ (by one with ``sample``, by up to a shard with
    ``shard``), so a node pads by repeating its own permutation up to the
    largest node's share, or with ``drop_last`` cuts to the smallest node's
    (with uneven shards that can drop much: prefer padding there). A node
    that owns nothing pads from the epoch's global permutation.
    """

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        if epoch_owners is None:
            epoch_owners = self.owners(plan, epoch, None)
        return _deal_within_node(plan, epoch, rank, epoch_owners)

    def rank_length(self, plan: JobPlan) -> int:
        return _node_share(plan, np.bincount(self.owners(plan, 0, None), minlength=plan.num_nodes))


class _Partial(_Local):
    """Before each epoch every node draws a fraction ``q`` of what it owns into a pool.

    Node m draws round(q * owned) of its samples, picked at random (key
    seed, epoch, m); the pooled picks are permuted (key seed, epoch) and dealt
    back in node order, each node receiving as many as it gave, so node loads
    never change and ranks read their node's owned set as in ``local``.
    ``q`` = 1 is a full global reshuffle of the owners. About 1/M of a node's
    draws are dealt back to it, so q(1 - 1/M) of its samples leave it
    (:mod:`.exchange_q`).
    """

    owners_move = True

    def check_settings(self, q: float, batch_size: int) -> None:
        if not 0.0 < q <= 1.0:
            raise ValueError(
                f"q must be in (0, 1] for mode partial (the fraction each node draws into the pool per epoch), not {q}"
            )

    def owners(self, plan: JobPlan, epoch: int, previous: np.ndarray | None) -> np.ndarray:
        if epoch == 0 or previous is None:
            current, first = super().owners(plan, 0, None), 1
        else:
            current, first = previous, epoch
        for step in range(first, epoch + 1):
            current = _exchange(plan, step, current)
        return current


class _Locality(_StaticOwners):
    """Global batches in mode ``global``'s order, each split where its bytes are.

    Node m takes the samples of a global batch (W * b ids) that it owns since
    the initial partition; a greedy balancer (:func:`locality_balance`) moves
    the surplus of over-full nodes to under-full ones until every node has
    g * b, and each of its ranks reads b of them per step. The batch, and so
    the gradient, is the one ``global`` would use; only the imbalance crosses
    the network. A last partial batch is dropped with ``drop_last``, else
    completed by repeating the epoch's order from its start, as ``global`` pads.
    """

    def check_settings(self, q: float, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 for mode locality (the per-rank batch), not {batch_size}")

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        if epoch_owners is None:
            epoch_owners = self.owners(plan, epoch, None)
        return balance_epoch(plan, epoch, epoch_owners).rank_order(rank)

    def rank_length(self, plan: JobPlan) -> int:
        return global_batches(plan) * plan.settings.batch_size


#: The placement modes by name, as a job's ``mode`` names them.
MODES: dict[str, Mode] = {"global": _Global(), "local": _Local(), "partial": _Partial(), "locality": _Locality()}


def owned_ids(epoch_owners: np.ndarray, node: int) -> np.ndarray:
    """The ids ``node`` owns in an owner array from :func:`owners`, ascending (int64)."""
    return np.flatnonzero(np.asarray(epoch_owners) == node).astype(np.int64, copy=False)


def _node_share(plan: JobPlan, loads: np.ndarray) -> int:
    """Ids per rank when each node deals what it owns: the largest node's share
    padded, or with ``drop_last`` the smallest node's, so all ranks step alike."""
    g = plan.settings.ranks_per_node
    if plan.settings.drop_last:
        return int(loads.min()) // g
    return -(-int(loads.max()) // g)


def _deal_within_node(plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray) -> np.ndarray:
    """Rank ``rank``'s share of its node's permuted owned set, as ``local`` deals it.

    A node that owns nothing (fewer samples or shards than nodes) pads from
    the epoch's global permutation, reading from peers, so its ranks step too.
    """
    node, local = divmod(rank, plan.settings.ranks_per_node)
    length = _node_share(plan, np.bincount(epoch_owners, minlength=plan.num_nodes))
    owned = owned_ids(epoch_owners, node)
    if len(owned):
        order = keyed_generator(plan.settings.seed, NODE_ORDER_KEY, epoch, node).permutation(owned)
    else:
        order = epoch_permutation(plan.num_samples, plan.settings.seed, epoch)
    return np.resize(order, length * plan.settings.ranks_per_node)[local :: plan.settings.ranks_per_node]


def _exchange_picks(plan: JobPlan, epoch: int, previous: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The samples ``partial`` pools before ``epoch``, node by node, and how many each node gave.

    A stable sort by owner lists each node's ids in ascending order (a radix
    sort for 16-bit keys, so O(N)); node m picks round(q * owned) of them with
    its own keyed generator, so its picks do not depend on any other node's.
    """
    by_node = previous.astype(np.uint16) if plan.num_nodes <= 1 << 16 else previous
    grouped = np.argsort(by_node, kind="stable")
    loads = np.bincount(previous, minlength=plan.num_nodes)
    starts = np.cumsum(loads) - loads
    given = np.rint(plan.settings.q * loads).astype(np.int64)
    picks = [
        starts[node]
        + keyed_generator(plan.settings.seed, EXCHANGE_PICKS_KEY, epoch, node).choice(
            int(loads[node]), int(given[node]), replace=False
        )
        for node in np.flatnonzero(given).tolist()
    ]
    return (grouped[np.concatenate(picks)] if picks else np.empty(0, dtype=np.int64)), given


def _exchange(plan: JobPlan, epoch: int, previous: np.ndarray) -> np.ndarray:
    """``partial``'s owners of ``epoch`` from those of ``epoch - 1``, in O(N):
    the pooled picks, permuted, dealt back in node order, as many as each gave."""
    pool, given = _exchange_picks(plan, epoch, previous)
    current = previous.astype(np.int32, copy=True)
    current[keyed_generator(plan.settings.seed, EXCHANGE_POOL_KEY, epoch).permutation(pool)] = np.repeat(
        np.arange(plan.num_nodes, dtype=np.int32), given
    )
    return current
