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
from typing import Protocol

import numpy as np

# Keys of the kinds of draw, far above any epoch, so that no key can equal an
# epoch permutation's [seed, epoch].
_INITIAL_SAMPLES_KEY = 0x5143_0001
_INITIAL_GROUPS_KEY = 0x5143_0002


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
        q: the fraction of its samples a node exchanges per epoch (``partial``).
        drop_last: drop the tail that does not divide over the ranks instead
            of padding it with repeated ids.
        partition: a key of :data:`PARTITIONS`.
        groups: the group of every sample, for the ``shard`` partition.

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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
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


class _Global:
    """One global permutation per epoch, dealt over all ranks; bytes never move.

    The training maths of a single-node DistributedSampler with the job's world
    size, while the initial partition spreads the bytes: most reads are peer
    hits (a partitioned cache).
    """

    def owners(self, plan: JobPlan, epoch: int, previous: np.ndarray | None) -> np.ndarray:
        return initial_owners(plan.num_samples, plan.num_nodes, plan.seed, plan.partition, plan.groups)

    def rank_order(self, plan: JobPlan, epoch: int, rank: int, epoch_owners: np.ndarray | None) -> np.ndarray:
        order = epoch_permutation(plan.num_samples, plan.seed, epoch)
        return rank_split(order, rank, plan.world_size, plan.drop_last)

    def rank_length(self, plan: JobPlan) -> int:
        return samples_per_rank(plan.num_samples, plan.world_size, plan.drop_last)


#: The placement modes by name, as a job's ``mode`` names them.
MODES: dict[str, Mode] = {"global": _Global()}


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
