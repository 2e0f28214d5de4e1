"""A job as placement sees it: the settings every party plans its epochs from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dataquay.client.placement.orders import check_world
from dataquay.client.placement.partition import check_groups, node_names

if TYPE_CHECKING:
    from dataquay.client.job_settings import JobSettings


@dataclass(frozen=True)
class JobPlan:
    """What placement needs to know of a job; every party builds the same one.

    Built from the directory's job record (:func:`dataquay.client.jobs.job_plan`),
    so the trainers and the daemons of a job agree on every order without
    exchanging any. The job's settings say how it shuffles; the plan adds the
    sizes they apply to, which the settings leave to the dataset and the
    directory.

    Attributes:
        settings: the job's settings, checked (:meth:`JobSettings.check`).
        num_samples: ids are 0..num_samples-1.
        num_nodes: M, the nodes whose caches hold the dataset.
        groups: the group of every sample, for the ``shard`` partition.

    Raises:
        ValueError: a field or setting outside its range, named in the message.
    """

    settings: JobSettings
    num_samples: int
    num_nodes: int
    groups: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_samples < 0:
            raise ValueError(f"num_samples must not be negative, not {self.num_samples}")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be at least 1, not {self.num_nodes}")
        if self.settings.nodes and len(self.settings.nodes) != self.num_nodes:
            raise ValueError(f"num_nodes is {self.num_nodes} but the settings name {len(self.settings.nodes)} nodes")
        self.settings.check()
        if self.settings.partition == "shard":
            object.__setattr__(self, "groups", check_groups(self.groups, self.num_samples))

    @property
    def nodes(self) -> tuple[str, ...]:
        """The names placement hashes: the job's nodes, or "0".."M-1" where the settings name none."""
        return self.settings.nodes or node_names(self.num_nodes)

    @property
    def world_size(self) -> int:
        """Ranks in the job: M nodes times g ranks per node (0 while g is unknown)."""
        return self.num_nodes * self.settings.ranks_per_node


def check_ranks_known(plan: JobPlan) -> None:
    """Raises ValueError while no rank has set the plan's ranks per node."""
    if not plan.settings.ranks_per_node:
        raise ValueError("the job has no ranks per node yet: the first rank to join sets them")


def check_rank(plan: JobPlan, rank: int) -> None:
    """Raises ValueError for a rank outside the plan's world, or while its ranks per node are unknown."""
    check_ranks_known(plan)
    check_world(rank, plan.world_size)
