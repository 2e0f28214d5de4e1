"""Which sample ids this rank reads, epoch by epoch.

A thin stateful wrapper over :mod:`dataquay.client.placement`: it holds the
job's settings and the current epoch, and takes rank and world size from the
launcher's environment when they are not given.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dataquay.client.env import topology
from dataquay.client.placement import rank_indices, samples_per_rank


class Sampler:
    """Ids of ``num_samples`` for one rank, reshuffled by :meth:`set_epoch`.

    Deals one job-wide order over ranks as torch's DistributedSampler does:
    every rank of the job, in any process, computes the same order from
    ``seed`` and the epoch, takes every ``world_size``-th id, and yields the
    same number of ids as every other rank.

    Args:
        num_samples: ids are 0..num_samples-1.
        rank: this process's rank; default RANK, else SLURM_PROCID, else 0.
        world_size: ranks in the job; default WORLD_SIZE, else SLURM_NTASKS,
            else 1.
        seed: the job's shuffle seed; the same on every rank.
        shuffle: False reads ids in order (evaluation).
        drop_last: drop the tail that does not divide evenly instead of
            padding it with repeated ids.

    Raises:
        ValueError: a negative size or seed, or a rank outside 0..world_size-1.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if rank is None or world_size is None:
            env = topology()
            rank = env.rank if rank is None else rank
            world_size = env.world_size if world_size is None else world_size
        if num_samples < 0:
            raise ValueError(f"num_samples must not be negative, not {num_samples}")
        if seed < 0:
            raise ValueError(f"seed must not be negative, not {seed}")
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, not {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next iteration yields.

        Call it with the same value on every rank before each epoch, or every
        epoch repeats epoch 0's order.
        """
        if epoch < 0:
            raise ValueError(f"epoch must not be negative, not {epoch}")
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """This rank's ids for the current epoch, in reading order (int64)."""
        return rank_indices(
            self.num_samples,
            self.rank,
            self.world_size,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return samples_per_rank(self.num_samples, self.world_size, self.drop_last)

    def __repr__(self) -> str:
        return (
            f"Sampler(num_samples={self.num_samples}, rank={self.rank}, world_size={self.world_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, epoch={self.epoch})"
        )
