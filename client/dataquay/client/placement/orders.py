"""Job-wide orders of an epoch and their split over ranks, as DistributedSampler deals them.

Randomness is keyed, never drawn from a shared stream: each order comes from
its own ``SeedSequence`` built from the job seed, the epoch and what the order
is for (one of the keys below), so adding a new kind of draw (a node's
permutation of the samples it owns, the picks of a partial exchange) never
changes the orders that exist.
"""

from __future__ import annotations

import numpy as np

# Imported now: numpy loads its random module on first use, several ms that
# a daemon's first placement (an exchange offer waiting on it) would pay.
from numpy.random import PCG64, Generator, SeedSequence

#: The last epoch a job may reach. Moving placements are stepped epoch by
#: epoch, so an absurd epoch would stall whoever computes its owners.
MAX_EPOCH = 100_000
#: How far past a job's current epoch one may be named where owners move:
#: each epoch between is one step of the owners, about 30 ms (q 0.25) to
#: 90 ms (q 1) at a million samples over 64 nodes, so 32 steps cost every
#: daemon of the job a few seconds at most. An epoch further ahead is nearly
#: always a global step passed for an epoch.
MAX_EPOCHS_AHEAD = 32

# Keys of the kinds of draw, far above any epoch, so that no key can equal an
# epoch permutation's [seed, epoch].
INITIAL_SAMPLES_KEY = 0x5143_0001
INITIAL_GROUPS_KEY = 0x5143_0002
NODE_ORDER_KEY = 0x5143_0003
EXCHANGE_PICKS_KEY = 0x5143_0004
EXCHANGE_POOL_KEY = 0x5143_0005
SPILL_PRIORITY_KEY = 0x5143_0006


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded order of 0..num_samples-1 for ``epoch`` (int64)."""
    return keyed_generator(seed, epoch).permutation(num_samples).astype(np.int64, copy=False)


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
    check_world(0, world_size)
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
    check_world(rank, world_size)
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
    check_world(rank, world_size)
    return rank_split(epoch_order(num_samples, seed, epoch, shuffle), rank, world_size, drop_last)


def keyed_generator(seed: int, *key: int) -> Generator:
    """The generator of one kind of draw: the job's ``seed`` and the draw's ``key``."""
    # Two 32-bit words per value: SeedSequence splits a large int into as
    # many words as it needs, so [2**32 + 5, 0] would equal [5, 1].
    words = [word for value in (seed, *key) for word in (value & 0xFFFF_FFFF, value >> 32)]
    return Generator(PCG64(SeedSequence(words)))


def check_epoch(epoch: int) -> None:
    """Raises ValueError for a negative epoch."""
    if epoch < 0:
        raise ValueError(f"epoch must not be negative, not {epoch}")


def check_world(rank: int, world_size: int) -> None:
    """Raises ValueError for a world below one rank or a rank outside it."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
