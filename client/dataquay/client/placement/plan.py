"""A job as placement sees it: the settings every party plans its epochs from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dataquay.client.placement.modes import check_mode_settings
from dataquay.client.placement.orders import check_world
from dataquay.client.placement.partition import PARTITIONS, check_groups


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
            object.__setattr__(self, "groups", check_groups(self.groups, self.num_samples))

    @property
    def world_size(self) -> int:
        """Ranks in the job: M nodes times g ranks per node (0 while g is unknown)."""
        return self.num_nodes * self.ranks_per_node


def check_ranks_known(plan: JobPlan) -> None:
    """Raises ValueError while no rank has set the plan's ranks per node."""
    if not plan.ranks_per_node:
        raise ValueError("the job has no ranks per node yet: the first rank to join sets them")


def check_rank(plan: JobPlan, rank: int) -> None:
    """Raises ValueError for a rank outside the plan's world, or while its ranks per node are unknown."""
    check_ranks_known(plan)
    check_world(rank, plan.world_size)
