"""Fetching, ahead of the ranks, the samples they will read from other nodes.

In modes ``global`` and ``locality`` a node's ranks read at every step
samples that other nodes own (most of them under ``global``, the global
batch's imbalance under ``locality``). Their order is known in advance
(:func:`dataquay.client.placement.node_steps`, given the job's batch size), so
the daemon fetches the next ``depth`` steps' transfers from their owners (or
the nodes an owner's overflow spilled to) while
the ranks are still on the current one, and keeps them in memory until they
are read: they are not this node's to cache. Their bytes are reserved in the
node's prefetch budget (a :class:`~dataquay.server.limits.ByteBudget`) before
they are asked for; steps that do not fit are read when asked for. How far the ranks got is the
step of the latest id they asked for. Once they ask for the last steps of an
epoch, the first steps of the next one are fetched too, so that a new epoch
does not start by waiting for its peers; the first epoch's (or that of ranks
that come back) are fetched when the ranks join the job or enter the epoch.
A read of a sample whose fetch is under way waits for it instead of asking
its owner again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.placement import node_steps
from dataquay.server.errors import DataquayError
from dataquay.server.limits import ByteBudget
from dataquay.server.node.cluster.placements import Placement
from dataquay.server.registry import Registered
from dataquay.server.task_group import Spawn

log = logging.getLogger("dataquay.prefetch")

Fetched = dict[int, tuple[str, bytes | memoryview, int]]
Fetch = Callable[[Registered, Placement, np.ndarray], Awaitable[Fetched]]
#: The placement of a job (by id) over a dataset in a given epoch.
PlacementOf = Callable[[str, Registered, int], Awaitable[Placement]]

#: Steps fetched ahead of the furthest step read.
DEPTH = 4


@dataclass
class _Epoch:
    """One job's epoch as this node's ranks walk it."""

    placement: Placement
    incoming: list[np.ndarray]  # per step: ids this node's ranks read that other nodes own
    step_of: np.ndarray  # per sample id: the step this node's ranks read it at, -1 if none
    next_step: int = 1  # first step not requested yet
    held: Fetched = field(default_factory=dict)
    fetching: dict[int, asyncio.Future[None]] = field(default_factory=dict)  # per id, its fetch under way


#: Modes whose ranks read from other nodes at every step.
PREFETCHED_MODES = frozenset({"global", "locality"})


class TransferPrefetcher:
    """Holds the next steps' transfers of the jobs this node serves (in
    :data:`PREFETCHED_MODES`, with a batch size).

    Args:
        fetch: gets ids from their owners (the read path's own peer fetch).
        placement_of: the job's placement in another epoch (for the next one).
        spawn: runs a background task owned by the daemon.
        budget: the node's prefetch memory, shared with the overflow's reads.
    """

    def __init__(
        self, fetch: Fetch, placement_of: PlacementOf, spawn: Spawn, budget: ByteBudget, depth: int = DEPTH
    ) -> None:
        self.fetch = fetch
        self.placement_of = placement_of
        self.spawn = spawn
        self.budget = budget
        self.depth = depth
        self.served = 0
        #: Per job, the epochs planned: the one its ranks read and the next.
        self._epochs: dict[str, dict[int, _Epoch]] = {}
        self._planning: set[tuple[str, int]] = set()
        # Epochs being planned whose ranks read meanwhile: their first step is read on demand.
        self._read_early: set[tuple[str, int]] = set()
        # Next epochs asked for before they were planned: the most steps any read wanted of each.
        self._next_wanted: dict[tuple[str, int], int] = {}

    async def take(self, job_id: str, epoch: int, ids: np.ndarray) -> Fetched:
        """The prefetched samples among ``ids``, handed over (they leave the
        buffer), once those being fetched have arrived."""
        state = self._epochs.get(job_id, {}).get(epoch)
        if state is None:
            return {}
        under_way = {state.fetching[i] for i in ids.tolist() if i in state.fetching}
        if under_way:
            await asyncio.wait(under_way)
        if not state.held or self._epochs.get(job_id, {}).get(epoch) is not state:
            return {}  # nothing held, or the epoch was dropped (and its bytes given back) meanwhile
        out = {i: state.held.pop(i) for i in ids.tolist() if i in state.held}
        self.budget.give(_held_bytes(out))
        self.served += len(out)
        return out

    def ahead(self, entry: Registered, placement: Placement, ids: np.ndarray) -> None:
        """Notes that this node's ranks read ``ids`` and starts fetching what
        they need in the next steps; returns at once."""
        job_id, epoch = placement.job.spec.job_id, placement.epoch
        state = self._epochs.get(job_id, {}).get(epoch)
        if state is None:
            self._plan_soon(entry, placement)
            if (job_id, epoch) in self._planning:
                self._read_early.add((job_id, epoch))
            return
        reached = int(state.step_of[ids].max()) if len(ids) else -1
        last = self._fetch_steps(entry, state, reached + 1, reached + self.depth)
        beyond = reached + self.depth - (len(state.incoming) - 1)
        if last == len(state.incoming) - 1 and beyond > 0:
            upcoming = self._epochs.get(job_id, {}).get(epoch + 1)
            if upcoming is not None:
                self._fetch_steps(entry, upcoming, 0, beyond - 1)
                return
            # Planned once; the steps fetched when it is are those of the last read before.
            key = (job_id, epoch + 1)
            if key not in self._next_wanted and key not in self._planning:
                self.spawn(self._plan_next(entry, placement), f"prefetch-next-{job_id}-{epoch + 1}")
            self._next_wanted[key] = max(self._next_wanted.get(key, 0), beyond)

    def begin(self, entry: Registered, placement: Placement) -> None:
        """Fetches the first steps of ``placement``'s epoch before its ranks
        read it (they joined the job or entered the epoch); nothing if that
        epoch is planned already. Returns at once."""
        self._plan_soon(entry, placement, self.depth)

    def _plan_soon(self, entry: Registered, placement: Placement, then_steps: int = 0) -> None:
        job_id, epoch = placement.job.spec.job_id, placement.epoch
        if (job_id, epoch) not in self._planning and epoch > max(self._epochs.get(job_id, {}), default=-1):
            self._planning.add((job_id, epoch))
            self.spawn(self._plan(entry, placement, then_steps), f"prefetch-plan-{job_id}-{epoch}")

    def _fetch_steps(self, entry: Registered, state: _Epoch, after: int, upto: int) -> int:
        """Starts fetching the steps of ``state`` from ``after`` to ``upto`` not
        asked for yet, one fetch per step (a read waits only for its own), as
        far as the budget allows; returns the last step asked for so far."""
        job_id, epoch = state.placement.job.spec.job_id, state.placement.epoch
        for step in range(max(state.next_step, after), min(upto, len(state.incoming) - 1) + 1):
            wanted = state.incoming[step]
            reserved = int(entry.manifest.sample_length[wanted].sum())
            if not self.budget.reserve(reserved):
                break
            state.next_step = step + 1
            if len(wanted):
                done = asyncio.get_running_loop().create_future()
                state.fetching.update(dict.fromkeys(wanted.tolist(), done))
                self.spawn(self._get(entry, state, wanted, reserved, done), f"prefetch-{job_id}-{epoch}-{step}")
        return state.next_step - 1

    async def _plan_next(self, entry: Registered, current: Placement) -> None:
        key = (current.job.spec.job_id, current.epoch + 1)
        try:
            upcoming = await self.placement_of(key[0], entry, key[1])
        except DataquayError:
            self._next_wanted.pop(key, None)
            return  # the next epoch is read on demand
        self._plan_soon(entry, upcoming, self._next_wanted.get(key, 0))
        if key not in self._planning:  # planned already: later reads fetch from it
            self._next_wanted.pop(key, None)

    async def _plan(self, entry: Registered, placement: Placement, then_steps: int) -> None:
        job_id, epoch = placement.job.spec.job_id, placement.epoch
        try:
            plan = job_plan(placement.job, entry.manifest)
            steps = await asyncio.get_running_loop().run_in_executor(
                None, node_steps, plan, epoch, placement.node_index
            )
        finally:
            self._planning.discard((job_id, epoch))
            began = (job_id, epoch) in self._read_early
            self._read_early.discard((job_id, epoch))
            # Reads of the epoch before may have asked for more steps while it was planned.
            then_steps = max(then_steps, self._next_wanted.pop((job_id, epoch), 0))
        step_of = np.full(plan.num_samples, -1, dtype=np.int64)
        step_of[np.concatenate(steps)] = np.repeat(np.arange(len(steps)), [len(step) for step in steps])
        sources = placement.sources
        foreign = [sources[step] != placement.node_index for step in steps]
        incoming = [row[mask] for row, mask in zip(steps, foreign)]
        # Step 0 of an epoch its ranks already read is read on demand.
        state = _Epoch(placement, incoming, step_of, next_step=0 if then_steps and not began else 1)
        planned = self._epochs.setdefault(job_id, {})
        planned[epoch] = state
        for old in sorted(planned)[:-2]:
            self.budget.give(_held_bytes(planned.pop(old).held))
        if then_steps:
            self._fetch_steps(entry, state, 0, then_steps - 1)

    async def _get(
        self, entry: Registered, state: _Epoch, ids: np.ndarray, reserved: int, done: asyncio.Future[None]
    ) -> None:
        placement = state.placement
        kept = 0
        try:
            got = await self.fetch(entry, placement, ids)
            if self._epochs.get(placement.job.spec.job_id, {}).get(placement.epoch) is state:
                state.held.update(got)  # else the job moved on meanwhile
                kept = _held_bytes(got)
        finally:
            self.budget.give(reserved - kept)
            for i in ids.tolist():
                if state.fetching.get(i) is done:
                    del state.fetching[i]
            done.set_result(None)


def _held_bytes(held: Fetched) -> int:
    return sum(len(data) for _, data, _ in held.values())
