"""Who owns which sample in a job, as this daemon computes it.

Ownership is never looked up: it follows from the job's settings (kept by the
directory, copied here) through the pure functions of
:mod:`dataquay.client.placement`. An epoch's owner array costs one
permutation of N ids, so it is computed once per (job, dataset version, epoch)
and kept.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.placement import owned_ids, owners
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.membership import DirectoryLink
from dataquay.server.registry import Registered

#: Owner arrays kept; a daemon serves few jobs at a time.
KEPT_EPOCHS = 8


@dataclass(frozen=True)
class Placement:
    """One epoch of a job, seen from one node."""

    job: jpb.Job
    owners: np.ndarray  # node index in job.spec.nodes, per sample id
    node_index: int     # this node's index in the job, -1 when it is not in it

    @property
    def nodes(self) -> list[str]:
        return list(self.job.spec.nodes)

    def owned(self) -> np.ndarray:
        """The ids this node owns, sorted."""
        if self.node_index < 0:
            return np.empty(0, dtype=np.int64)
        return owned_ids(self.owners, self.node_index)


class Placements:
    """Owner arrays of the jobs this daemon serves, computed on first use."""

    def __init__(self, link: DirectoryLink, node_name: str) -> None:
        self.link = link
        self.node_name = node_name
        self._kept: dict[tuple[str, str, int], Placement] = {}

    async def placement(self, job_id: str, entry: Registered, epoch: int | None = None) -> Placement:
        """The job's placement for ``epoch`` (default: the job's current epoch).

        Raises:
            UnknownJobError: neither this node nor the directory knows the job.
            DataquayError: the job was started on another version of the dataset.
        """
        job = await self.link.job(job_id)
        epoch = job.epoch if epoch is None else epoch
        key = (job_id, entry.record.manifest_id, epoch)
        kept = self._kept.get(key)
        if kept is not None and kept.job.created_unix == job.created_unix:
            return kept
        plan = job_plan(job, entry.manifest)
        nodes = list(job.spec.nodes)
        index = nodes.index(self.node_name) if self.node_name in nodes else -1
        before = self._kept.get((job_id, entry.record.manifest_id, epoch - 1))
        previous = before.owners if before is not None and before.job.created_unix == job.created_unix else None
        # Off the loop: a permutation of 10^7 ids takes a good part of a second,
        # and modes whose owners move step from the previous epoch's.
        owner = await asyncio.get_running_loop().run_in_executor(None, owners, plan, epoch, previous)
        kept = self._kept[key] = Placement(job, owner, index)
        while len(self._kept) > KEPT_EPOCHS:
            del self._kept[next(iter(self._kept))]
        return kept
