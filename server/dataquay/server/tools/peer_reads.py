"""What a job's ranks read from other nodes in an epoch, per mode, as
:mod:`.simulate` counts it: samples per node sent and received by peer
reads (the exchange aside), and ``locality``'s per-batch balance.

Plain functions over owner arrays, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dataquay.client.placement import BatchBalance, JobPlan, epoch_permutation, locality_epoch, rank_length

#: Samples per node sent to peers, received from peers, and the batch balance (``locality`` only).
PeerReads = tuple[np.ndarray, np.ndarray, BatchBalance | None]


def no_peer_reads(plan: JobPlan, epoch: int, epoch_owners: np.ndarray) -> PeerReads:
    """``local`` and ``partial`` ranks read only their node's owned set."""
    none = np.zeros(plan.num_nodes, dtype=np.int64)
    return none, none, None


def global_reads(plan: JobPlan, epoch: int, epoch_owners: np.ndarray) -> PeerReads:
    """Samples per node that ``global`` ranks read from, and serve to, peers.

    Rank r reads positions r, r + W, ... of the (padded) epoch permutation, so
    position i is read on node (i % W) // g: no per-rank orders needed.
    """
    world = plan.world_size
    order = np.resize(epoch_permutation(plan.num_samples, plan.settings.seed, epoch), rank_length(plan) * world)
    reader = (np.arange(len(order), dtype=np.int64) % world) // plan.settings.ranks_per_node
    holder = epoch_owners[order]
    remote = holder != reader
    return (
        np.bincount(holder[remote], minlength=plan.num_nodes).astype(np.int64),
        np.bincount(reader[remote], minlength=plan.num_nodes).astype(np.int64),
        None,
    )


def locality_reads(plan: JobPlan, epoch: int, epoch_owners: np.ndarray) -> PeerReads:
    """Samples per node that ``locality``'s balancer moves, and its per-batch figures.

    The balancer only pairs a node that has a surplus with one that has a
    deficit, so each node sends its surplus and receives its deficit in every
    global batch.
    """
    split = locality_epoch(plan, epoch, epoch_owners)
    surplus = split.counts - plan.settings.ranks_per_node * plan.settings.batch_size
    return (
        np.maximum(surplus, 0).sum(axis=0).astype(np.int64),
        np.maximum(-surplus, 0).sum(axis=0).astype(np.int64),
        split.balance(),
    )


#: The peer reads of each mode.
PEER_READS: dict[str, Callable[[JobPlan, int, np.ndarray], PeerReads]] = {
    "global": global_reads,
    "local": no_peer_reads,
    "partial": no_peer_reads,
    "locality": locality_reads,
}
