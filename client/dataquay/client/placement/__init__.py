"""Who reads what, computed: pure functions of (seed, epoch, sizes), no I/O.

Every process of a job computes the same orders from the same arguments, so no
party ever has to ask another where a sample goes.

A job's epoch plan has two steps: an order of sample ids (:mod:`.orders`'
keyed permutations), then a split of that order over ranks (:func:`rank_split`).
The cluster modes replace the first step with per-node orders over owned
samples; the split keeps DistributedSampler's contract, because synchronous
SGD deadlocks when ranks disagree on the number of steps.

A cluster job (:class:`JobPlan`, :mod:`.plan`) adds ownership: which node's
cache holds each sample. Its initial partition (:func:`initial_owners`,
:mod:`.partition`) is cut once; a mode of :data:`MODES` (:mod:`.modes`, with
``locality``'s batch balancer in :mod:`.balance`) then says who owns what in
each epoch and what each rank reads, which the parties ask through
:mod:`.epochs`. Placement hashes node names (:mod:`.rendezvous`), so a job
re-formed on another node set (:func:`reform`) moves about 1/M of its
samples. ``partial``'s q reads two ways (:mod:`.exchange_q`).
"""

from dataquay.client.placement.epochs import (
    BatchBalance,
    LocalityEpoch,
    Moves,
    NodeReads,
    locality_balance,
    locality_epoch,
    moves,
    node_of_rank,
    node_orders,
    node_reads,
    node_steps,
    owner_read_positions,
    owners,
    rank_length,
    rank_order,
    reform,
)
from dataquay.client.placement.exchange_q import drawn_fraction, leaving_fraction
from dataquay.client.placement.modes import MODES, Mode, owned_ids
from dataquay.client.placement.orders import (
    MAX_EPOCH,
    MAX_EPOCHS_AHEAD,
    epoch_order,
    epoch_permutation,
    rank_indices,
    rank_split,
    samples_per_rank,
)
from dataquay.client.placement.partition import PARTITIONS, initial_owners
from dataquay.client.placement.plan import JobPlan

__all__ = [
    "MAX_EPOCH",
    "MAX_EPOCHS_AHEAD",
    "MODES",
    "PARTITIONS",
    "BatchBalance",
    "JobPlan",
    "LocalityEpoch",
    "Mode",
    "Moves",
    "NodeReads",
    "drawn_fraction",
    "epoch_order",
    "epoch_permutation",
    "initial_owners",
    "leaving_fraction",
    "locality_balance",
    "locality_epoch",
    "moves",
    "node_of_rank",
    "node_orders",
    "node_reads",
    "node_steps",
    "owned_ids",
    "owner_read_positions",
    "owners",
    "rank_indices",
    "rank_length",
    "rank_order",
    "rank_split",
    "reform",
    "samples_per_rank",
]
