"""Who reads what, computed: pure functions of (seed, epoch, sizes), no I/O.

Every process of a job computes the same orders from the same arguments, so no
party ever has to ask another where a sample goes.

Randomness is keyed, never drawn from a shared stream: each order comes from
its own ``SeedSequence`` built from the job seed, the epoch and what the order
is for, so adding a new kind of draw (a node's permutation of the samples it
owns, the picks of a partial exchange) never changes the orders that exist.

A job's epoch plan has two steps: an order of sample ids (this module's
permutations), then a split of that order over ranks (:func:`rank_split`).
The cluster modes replace the first step with per-node orders over owned
samples; the split keeps DistributedSampler's contract, because synchronous
SGD deadlocks when ranks disagree on the number of steps.

A cluster job (:class:`JobPlan`) adds ownership: which node's cache holds each
sample. Its initial partition (:func:`initial_owners`) is cut once; a mode of
:data:`MODES` then says who owns what in each epoch and what each rank reads.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

# Keys of the kinds of draw, far above any epoch, so that no key can equal an
# epoch permutation's [seed, epoch].
#: The last epoch a job may reach. Moving placements are stepped epoch by
#: epoch, so an absurd epoch would stall whoever computes its owners.
MAX_EPOCH = 100_000

_INITIAL_SAMPLES_KEY = 0x5143_0001
_INITIAL_GROUPS_KEY = 0x5143_0002
_NODE_ORDER_KEY = 0x5143_0003
_EXCHANGE_PICKS_KEY = 0x5143_0004
_EXCHANGE_POOL_KEY = 0x5143_0005


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded order of 0..num_samples-1 for ``epoch`` (int64)."""
    return _generator(seed, epoch).permutation(num_samples).astype(np.int64, copy=False)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The job-wide order of an epoch: the seeded permutation, or 0..N-1 unshuffled.

    The daemon stages a dataset in the order of epoch 0's permutation, so the
    samples a shuffled job reads first are the first ones cached.
    """
    if shuffle:
        return epoch_permutation(num_samples, seed, epoch)
    return np.arange(num_samples, dtype=np.int64)


def samples_per_rank(num_samples: int, world_size: int, drop_last: bool = False) -> int:
    """How many ids each rank gets from :func:`rank_split` of ``num_samples`` ids."""
    _check_world(0, world_size)
    if drop_last:
        return num_samples // world_size
    return -(-num_samples // world_size)


def rank_split(order: np.ndarray, rank: int, world_size: int, drop_last: bool = False) -> np.ndarray:
    """This rank's share of ``order``, as torch's DistributedSampler deals it.

    Ranks take every ``world_size``-th id starting at ``rank``. Every rank gets
    the same count: with ``drop_last`` the tail that does not divide evenly is
    left out; otherwise the order is padded by repeating it from its start.

    Raises:
        ValueError: ``rank`` is not in 0..world_size-1, or ``order`` is not 1-D.
    """
    _check_world(rank, world_size)
    order = np.asarray(order)
    if order.ndim != 1:
        raise ValueError(f"order must be 1-D, not of shape {order.shape}")
    total = samples_per_rank(len(order), world_size, drop_last) * world_size
    if total > len(order):
        order = np.resize(order, total)
    return order[rank:total:world_size]


def rank_indices(
    num_samples: int,
    rank: int,
    world_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
) -> np.ndarray:
    """The ids rank ``rank`` reads in ``epoch``, in reading order (int64)."""
    _check_world(rank, world_size)
    return rank_split(epoch_order(num_samples, seed, epoch, shuffle), rank, world_size, drop_last)


def _generator(seed: int, *key: int) -> np.random.Generator:
    # Two 32-bit words per value: SeedSequence splits a large int into as
    # many words as it needs, so [2**32 + 5, 0] would equal [5, 1].
    words = [word for value in (seed, *key) for word in (value & 0xFFFF_FFFF, value >> 32)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


def _check_groups(groups: np.ndarray | None, num_samples: int) -> np.ndarray:
    """``groups`` as an index array, if it names a group for each of ``num_samples`` samples.

    Raises:
        ValueError: ``groups`` is missing, of another length, not integers,
            or holds a negative group id.
    """
    if groups is None:
        raise ValueError("the shard partition needs the group of every sample (Manifest.shard_groups())")
    groups = np.asarray(groups)
    if groups.ndim != 1 or len(groups) != num_samples:
        raise ValueError(f"groups must name one group per sample: {num_samples} ids, not shape {groups.shape}")
    if groups.dtype.kind not in "iu":
        raise ValueError(f"group ids must be integers, not {groups.dtype}")
    if len(groups) and groups.min() < 0:
        raise ValueError(f"group ids must not be negative, not {int(groups.min())}")
    return groups.astype(np.intp, copy=False)


def _sample_blocks(num_samples: int, num_nodes: int, seed: int, groups: np.ndarray | None) -> np.ndarray:
    """A seeded permutation cut into ``num_nodes`` blocks whose sizes differ by at most 1."""
    order = _generator(seed, _INITIAL_SAMPLES_KEY).permutation(num_samples)
    bounds = np.arange(num_nodes + 1, dtype=np.int64) * num_samples // num_nodes
    owner = np.empty(num_samples, dtype=np.int32)
    owner[order] = np.repeat(np.arange(num_nodes, dtype=np.int32), np.diff(bounds))
    return owner


def _whole_groups(num_samples: int, num_nodes: int, seed: int, groups: np.ndarray | None) -> np.ndarray:
    """Whole groups dealt to the least loaded node, largest first.

    Dealing largest first keeps the loads within one group of each other (and
    usually much closer); the seeded order of the groups breaks ties between
    groups of one size, so each seed gives each node other shards.
    """
    groups = _check_groups(groups, num_samples)
    sizes = np.bincount(groups)
    shuffled = _generator(seed, _INITIAL_GROUPS_KEY).permutation(np.flatnonzero(sizes))
    dealt = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    loads = [(0, node) for node in range(num_nodes)]  # sorted, so already a heap
    takers = []
    for size in sizes[dealt].tolist():
        load, node = loads[0]
        takers.append(node)
        heapq.heapreplace(loads, (load + size, node))
    node_of_group = np.zeros(len(sizes), dtype=np.int32)
    node_of_group[dealt] = takers
    return node_of_group[groups]


_PARTITIONERS: dict[str, Callable[[int, int, int, np.ndarray | None], np.ndarray]] = {
    "sample": _sample_blocks,
    "shard": _whole_groups,
}
#: How a dataset is cut into the nodes' initial shares: single samples, or
#: whole groups (a tar shard, an npy file, a class folder) that never split,
#: so that each node reads only its own files from the PFS.
PARTITIONS = tuple(_PARTITIONERS)


def initial_owners(
    num_samples: int,
    num_nodes: int,
    seed: int,
    partition: str = "sample",
    groups: np.ndarray | None = None,
) -> np.ndarray:
    """The node (0..num_nodes-1) that owns each sample in epoch 0 (int32).

    ``sample`` cuts a seeded permutation into balanced blocks: node m owns
    block m. ``shard`` deals whole groups (``groups[i]`` is sample i's group:
    its tar shard, npy file or folder) so that node loads stay within one group
    of each other; it keeps each node's PFS reads to files of its own.

    Raises:
        ValueError: a negative size, fewer than one node, an unknown
            partition, or ``groups`` missing or of the wrong length for ``shard``.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must not be negative, not {num_samples}")
    if num_nodes < 1:
        raise ValueError(f"a job needs at least one node, not {num_nodes}")
    partitioner = _PARTITIONERS.get(partition)
    if partitioner is None:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, not {partition!r}")
    return partitioner(num_samples, num_nodes, seed, groups)


@dataclass(frozen=True)
class JobPlan:
    """What placement needs to know of a job; every party builds the same one.

    Built from the directory's job record (:func:`dataquay.client.jobs.job_plan`),
    so the trainers and the daemons of a job agree on every order without
    exchanging any.

    Attributes:
        num_samples: ids are 0..num_samples-1.
        num_nodes: M, the nodes whose caches hold the dataset.
        ranks_per_node: g; rank r runs on node r // g. 0 while no rank has
            joined to say: ownership needs no ranks, only rank orders do.
        seed: the job's shuffle seed.
        mode: a key of :data:`MODES`.
        q: the fraction of its samples a node exchanges per epoch (``partial``,
            which needs 0 < q <= 1).
        drop_last: drop the tail that does not divide over the ranks instead
            of padding it with repeated ids.
        partition: a key of :data:`PARTITIONS`.
        groups: the group of every sample, for the ``shard`` partition.
        batch_size: b, the ids each rank reads per step; ``locality`` splits
            global batches of W * b and needs b >= 1, other modes ignore it.

    Raises:
        ValueError: a field outside its range, named in the message.
    """

    num_samples: int
    num_nodes: int
    ranks_per_node: int
    seed: int
    mode: str = "global"
    q: float = 0.0
    drop_last: bool = False
    partition: str = "sample"
    groups: np.ndarray | None = field(default=None, compare=False, repr=False)
    batch_size: int = 0

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, not {self.partition!r}")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must not be negative, not {self.num_samples}")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be at least 1, not {self.num_nodes}")
        if self.ranks_per_node < 0:
            raise ValueError(f"ranks_per_node must not be negative, not {self.ranks_per_node}")
        if self.seed < 0:
            raise ValueError(f"seed must not be negative, not {self.seed}")
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"q must be in [0, 1], not {self.q}")
        if self.batch_size < 0:
            raise ValueError(f"batch_size must not be negative, not {self.batch_size}")
        check_mode_settings(self.mode, self.q, self.batch_size)
        if self.partition == "shard":
            object.__setattr__(self, "groups", _check_groups(self.groups, self.num_samples))

    @property
    def world_size(self) -> int:
        """Ranks in the job: M nodes times g ranks per node (0 while g is unknown)."""
        return self.num_nodes * self.ranks_per_node


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
        return initial_owners(plan.num_samples, plan.num_nodes, plan.seed, plan.partition, plan.groups)


class _Global(_StaticOwners):
    """One global permutation per epoch, dealt over all ranks; bytes never move.

    The training maths of a single-node DistributedSampler with the job's world
    size, while the initial partition spreads the bytes: most reads are peer
    hits (a partitioned cache).
    """

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        order = epoch_permutation(plan.num_samples, plan.seed, epoch)
        return rank_split(order, rank, plan.world_size, plan.drop_last)

    def rank_length(self, plan: JobPlan) -> int:
        return samples_per_rank(plan.num_samples, plan.world_size, plan.drop_last)


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
    """Before each epoch every node trades a fraction ``q`` of what it owns.

    Node m gives away round(q * owned) of its samples, picked at random (key
    seed, epoch, m); the pooled picks are permuted (key seed, epoch) and dealt
    back in node order, each node receiving as many as it gave, so node loads
    never change and ranks read their node's owned set as in ``local``.
    ``q`` = 1 is a full global reshuffle of the owners.
    """

    owners_move = True

    def check_settings(self, q: float, batch_size: int) -> None:
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q must be in (0, 1] for mode partial (the fraction exchanged per epoch), not {q}")

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
            raise ValueError(
                f"batch_size must be at least 1 for mode locality (the per-rank batch), not {batch_size}"
            )

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        if epoch_owners is None:
            epoch_owners = self.owners(plan, epoch, None)
        node, local = divmod(rank, plan.ranks_per_node)
        return _locality_node(plan, epoch, epoch_owners, node)[:, local :: plan.ranks_per_node].ravel()

    def rank_length(self, plan: JobPlan) -> int:
        return _global_batches(plan) * plan.batch_size


#: The placement modes by name, as a job's ``mode`` names them.
MODES: dict[str, Mode] = {"global": _Global(), "local": _Local(), "partial": _Partial(), "locality": _Locality()}


def check_mode_settings(mode: str, q: float, batch_size: int) -> None:
    """Refuses settings that ``mode`` cannot run with, before any plan exists.

    The directory calls it when a job is created, so that a job every rank
    would fail to plan is never recorded.

    Raises:
        ValueError: an unknown mode, or a setting it needs out of range
            (``q`` for partial, ``batch_size`` for locality), named.
    """
    chosen = MODES.get(mode)
    if chosen is None:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    chosen.check_settings(q, batch_size)


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
    _check_epoch(epoch)
    if previous is not None and len(previous) != plan.num_samples:
        raise ValueError(f"previous owners have {len(previous)} entries for {plan.num_samples} samples")
    return MODES[plan.mode].owners(plan, epoch, previous)


def rank_order(plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None = None) -> np.ndarray:
    """The ids rank ``rank`` of ``plan`` reads in ``epoch``, in reading order (int64).

    Every rank gets :func:`rank_length` ids. ``epoch_owners`` (this epoch's
    :func:`owners`) saves their computation in modes that need them.

    Raises:
        ValueError: a negative epoch, a rank outside 0..world_size-1, or
            ranks per node not known yet.
    """
    _check_epoch(epoch)
    _check_rank(plan, rank)
    return MODES[plan.mode].rank_order(plan, epoch, rank, epoch_owners)


def rank_length(plan: JobPlan) -> int:
    """How many ids every rank of ``plan`` reads per epoch.

    Raises:
        ValueError: the plan's ranks per node are not known yet.
    """
    _check_ranks_known(plan)
    return MODES[plan.mode].rank_length(plan)


def node_of_rank(plan: JobPlan, rank: int) -> int:
    """The node (0..M-1) rank ``rank`` runs on: ranks fill nodes g at a time.

    Raises:
        ValueError: a rank outside 0..world_size-1, or ranks per node not known yet.
    """
    _check_rank(plan, rank)
    return rank // plan.ranks_per_node


def owned_ids(epoch_owners: np.ndarray, node: int) -> np.ndarray:
    """The ids ``node`` owns in an owner array from :func:`owners`, ascending (int64)."""
    return np.flatnonzero(np.asarray(epoch_owners) == node).astype(np.int64, copy=False)


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
    _check_epoch(epoch)
    if epoch == 0:
        before = after = owners(plan, 0)
    else:
        before = owners(plan, epoch - 1) if previous is None else np.asarray(previous)
        after = owners(plan, epoch, before)
    ids = np.flatnonzero(before != after).astype(np.int64, copy=False)
    return Moves(ids, before[ids].astype(np.int32, copy=False), after[ids].astype(np.int32, copy=False))


def node_steps(plan: JobPlan, epoch: int, node: int) -> list[np.ndarray]:
    """What ``node``'s ranks read at each step of ``epoch``: per step, the
    ``plan.batch_size`` ids of each of its ranks, rank after rank (int64).

    For a daemon that fetches the samples its ranks will need from other
    nodes a few steps ahead of them.

    Raises:
        ValueError: a negative epoch, ranks per node not known yet, no batch
            size, or a node outside 0..M-1.
    """
    _check_epoch(epoch)
    _check_ranks_known(plan)
    MODES["locality"].check_settings(plan.q, plan.batch_size)
    if not 0 <= node < plan.num_nodes:
        raise ValueError(f"node must be in 0..{plan.num_nodes - 1}, not {node}")
    epoch_owners = owners(plan, epoch)
    if plan.mode == "locality":
        return list(_locality_node(plan, epoch, epoch_owners, node))
    g, b = plan.ranks_per_node, plan.batch_size
    orders = [rank_order(plan, epoch, rank, epoch_owners) for rank in range(node * g, (node + 1) * g)]
    return [np.concatenate([order[start : start + b] for order in orders])
            for start in range(0, rank_length(plan), b)]


class BatchBalance(NamedTuple):
    """What ``locality``'s balancer does to each global batch of an epoch."""

    transfers: np.ndarray  #: int64 (source, target) node pairs per batch, at most M-1
    moved: np.ndarray  #: int64 samples that cross the network per batch (the sum of deficits)
    imbalance: np.ndarray  #: float64 ``moved`` as a percentage of the global batch W * b


def locality_balance(plan: JobPlan, epoch: int) -> BatchBalance:
    """The network cost of each global batch of ``epoch`` under mode ``locality``.

    For simulators and the exchange engine: the split itself is
    :func:`rank_order`'s. Describes ``plan``'s batch size whatever its mode.

    Raises:
        ValueError: a negative epoch, ranks per node not known yet, or no
            batch size.
    """
    _check_epoch(epoch)
    _check_ranks_known(plan)
    MODES["locality"].check_settings(plan.q, plan.batch_size)
    counts = _batch_counts(plan, epoch, owners(plan, epoch))[2]
    batch, _, _, amount = _greedy_transfers(counts, plan.ranks_per_node * plan.batch_size)
    num_batches = len(counts)
    moved = np.bincount(batch, weights=amount, minlength=num_batches).astype(np.int64)
    return BatchBalance(
        np.bincount(batch, minlength=num_batches).astype(np.int64),
        moved,
        moved * 100.0 / (plan.world_size * plan.batch_size),
    )


def _node_share(plan: JobPlan, loads: np.ndarray) -> int:
    """Ids per rank when each node deals what it owns: the largest node's share
    padded, or with ``drop_last`` the smallest node's, so all ranks step alike."""
    g = plan.ranks_per_node
    if plan.drop_last:
        return int(loads.min()) // g
    return -(-int(loads.max()) // g)


def _deal_within_node(plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray) -> np.ndarray:
    """Rank ``rank``'s share of its node's permuted owned set, as ``local`` deals it.

    A node that owns nothing (fewer samples or shards than nodes) pads from
    the epoch's global permutation, reading from peers, so its ranks step too.
    """
    node, local = divmod(rank, plan.ranks_per_node)
    length = _node_share(plan, np.bincount(epoch_owners, minlength=plan.num_nodes))
    owned = owned_ids(epoch_owners, node)
    if len(owned):
        order = _generator(plan.seed, _NODE_ORDER_KEY, epoch, node).permutation(owned)
    else:
        order = epoch_permutation(plan.num_samples, plan.seed, epoch)
    return np.resize(order, length * plan.ranks_per_node)[local :: plan.ranks_per_node]


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
    given = np.rint(plan.q * loads).astype(np.int64)
    picks = [
        starts[node] + _generator(plan.seed, _EXCHANGE_PICKS_KEY, epoch, node).choice(
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
    current[_generator(plan.seed, _EXCHANGE_POOL_KEY, epoch).permutation(pool)] = np.repeat(
        np.arange(plan.num_nodes, dtype=np.int32), given
    )
    return current


def _global_batches(plan: JobPlan) -> int:
    """Global batches of W * b per epoch: the partial last one dropped or padded."""
    global_batch = plan.world_size * plan.batch_size
    if plan.drop_last:
        return plan.num_samples // global_batch
    return -(-plan.num_samples // global_batch)


def _batch_counts(plan: JobPlan, epoch: int, epoch_owners: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch's ids in global batch order (padded or cut to whole batches),
    each id's (batch, owner) as one key, batch * M + owner, and how many of
    each batch every node owns (batches x nodes)."""
    num_batches, width = _global_batches(plan), plan.world_size * plan.batch_size
    order = np.resize(epoch_permutation(plan.num_samples, plan.seed, epoch), num_batches * width)
    key = np.arange(len(order), dtype=np.int64) // width * plan.num_nodes
    key += epoch_owners[order]
    counts = np.bincount(key, minlength=num_batches * plan.num_nodes).reshape(num_batches, plan.num_nodes)
    return order, key, counts


def _greedy_transfers(counts: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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


def _locality_node(plan: JobPlan, epoch: int, epoch_owners: np.ndarray, node: int) -> np.ndarray:
    """``node``'s share of every global batch of ``epoch`` (batches x g*b ids).

    A node keeps the first g*b of its samples in batch order and gives the
    rest, in order, to its transfers in the order the balancer made them; a
    receiver appends what it receives, in the same order, after its own. Only
    the groups that send to ``node`` are sorted, so one node costs O(N).
    """
    num_nodes, share = plan.num_nodes, plan.ranks_per_node * plan.batch_size
    order, key, counts = _batch_counts(plan, epoch, epoch_owners)
    own = counts[:, node]
    slots = np.empty((len(counts), share), dtype=np.int64)
    mine = np.flatnonzero(key % num_nodes == node)
    batch_of_mine = mine // (plan.world_size * plan.batch_size)
    place = np.arange(len(mine)) - np.repeat(np.cumsum(own) - own, own)
    kept = place < share
    slots[batch_of_mine[kept], place[kept]] = order[mine[kept]]

    batch, source, sink, amount = _greedy_transfers(counts, share)
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


def _check_ranks_known(plan: JobPlan) -> None:
    if not plan.ranks_per_node:
        raise ValueError("the job has no ranks per node yet: the first rank to join sets them")


def _check_rank(plan: JobPlan, rank: int) -> None:
    _check_ranks_known(plan)
    _check_world(rank, plan.world_size)


def _check_epoch(epoch: int) -> None:
    if epoch < 0:
        raise ValueError(f"epoch must not be negative, not {epoch}")


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
