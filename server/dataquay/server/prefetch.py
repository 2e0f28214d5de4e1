"""Fetching, ahead of the ranks, the samples they will read from other nodes.

In modes ``global`` and ``locality`` a node's ranks read at every step
samples that other nodes own (most of them under ``global``, the global
batch's imbalance under ``locality``). Their order is known in advance
(:func:`dataquay.client.placement.node_steps`, given the job's batch size), so
the daemon fetches the next ``depth`` steps' transfers from their owners while
the ranks are still on the current one, and keeps them in memory until they
are read: they are not this node's to cache. How far the ranks got is the
step of the latest id they asked for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.placement import node_steps
from dataquay.server.jobs import Placement
from dataquay.server.registry import Registered
from dataquay.server.tasks import Spawn

log = logging.getLogger("dataquay.prefetch")

Fetched = dict[int, tuple[str, bytes | memoryview, int]]
Fetch = Callable[[Registered, Placement, np.ndarray], Awaitable[Fetched]]

#: Steps fetched ahead of the furthest step read.
DEPTH = 4
#: Bytes held at most; beyond it, transfers are read when asked for.
MAX_BYTES = 256 << 20


@dataclass
class _Epoch:
    """One job's epoch as this node's ranks walk it."""

    epoch: int
    incoming: list[np.ndarray]  # per step: ids this node's ranks read that other nodes own
    step_of: np.ndarray         # per sample id: the step this node's ranks read it at, -1 if none
    next_step: int = 1          # first step not requested yet (step 0 is read on demand)
    held: Fetched = field(default_factory=dict)


#: Modes whose ranks read from other nodes at every step.
PREFETCHED_MODES = frozenset({"global", "locality"})


class TransferPrefetcher:
    """Holds the next steps' transfers of the jobs this node serves (in
    :data:`PREFETCHED_MODES`, with a batch size).

    Args:
        fetch: gets ids from their owners (the read path's own peer fetch).
        spawn: runs a background task owned by the daemon.
    """

    def __init__(self, fetch: Fetch, spawn: Spawn, depth: int = DEPTH, max_bytes: int = MAX_BYTES) -> None:
        self.fetch = fetch
        self.spawn = spawn
        self.depth = depth
        self.max_bytes = max_bytes
        self.served = 0
        self._epochs: dict[str, _Epoch] = {}
        self._planning: set[tuple[str, int]] = set()
        self._held_bytes = 0

    def take(self, job_id: str, epoch: int, ids: np.ndarray) -> Fetched:
        """The prefetched samples among ``ids``, handed over (they leave the buffer)."""
        state = self._epochs.get(job_id)
        if state is None or state.epoch != epoch or not state.held:
            return {}
        out = {i: state.held.pop(i) for i in ids.tolist() if i in state.held}
        self._held_bytes -= sum(len(data) for _, data, _ in out.values())
        self.served += len(out)
        return out

    def ahead(self, entry: Registered, placement: Placement, ids: np.ndarray) -> None:
        """Notes that this node's ranks read ``ids`` and starts fetching what
        they need in the next steps; returns at once."""
        job_id = placement.job.spec.job_id
        state = self._epochs.get(job_id)
        if state is None or state.epoch != placement.epoch:
            key = (job_id, placement.epoch)
            if key not in self._planning and (state is None or state.epoch < placement.epoch):
                self._planning.add(key)
                self.spawn(self._plan(entry, placement), f"prefetch-plan-{job_id}-{placement.epoch}")
            return
        reached = int(state.step_of[ids].max()) if len(ids) else -1
        first, last = max(state.next_step, reached + 1), min(reached + self.depth, len(state.incoming) - 1)
        if first > last or self._held_bytes >= self.max_bytes:
            return
        state.next_step = last + 1
        wanted = np.concatenate(state.incoming[first : last + 1])
        if len(wanted):
            self.spawn(self._get(entry, placement, state, wanted), f"prefetch-{job_id}-{placement.epoch}-{first}")

    async def _plan(self, entry: Registered, placement: Placement) -> None:
        job_id = placement.job.spec.job_id
        try:
            plan = job_plan(placement.job, entry.manifest)
            steps = await asyncio.get_running_loop().run_in_executor(
                None, node_steps, plan, placement.epoch, placement.node_index
            )
        finally:
            self._planning.discard((job_id, placement.epoch))
        step_of = np.full(plan.num_samples, -1, dtype=np.int64)
        step_of[np.concatenate(steps)] = np.repeat(np.arange(len(steps)), [len(step) for step in steps])
        foreign = [placement.owners[step] != placement.node_index for step in steps]
        old = self._epochs.get(job_id)
        if old is not None:
            if old.epoch >= placement.epoch:
                return
            self._held_bytes -= sum(len(data) for _, data, _ in old.held.values())
        self._epochs[job_id] = _Epoch(placement.epoch, [row[mask] for row, mask in zip(steps, foreign)], step_of)

    async def _get(self, entry: Registered, placement: Placement, state: _Epoch, ids: np.ndarray) -> None:
        got = await self.fetch(entry, placement, ids)
        if self._epochs.get(placement.job.spec.job_id) is not state:
            return  # the job moved on to another epoch meanwhile
        state.held.update(got)
        self._held_bytes += sum(len(data) for _, data, _ in got.values())
