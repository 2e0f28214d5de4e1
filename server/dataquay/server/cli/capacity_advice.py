"""Warnings, before a job runs, about caches too small for it (``stage --job``, ``simulate``).

A node whose cache cannot hold its share reads the rest from the PFS in every
epoch, unless (in modes whose owners never move) nodes with room hold it
for it (:mod:`dataquay.server.planning.spill`); under ``partial`` it also needs room
for the exchange, or what it gives away cannot be taken in by its new owner. Both are cheap to see from the
placement and the sample sizes, and expensive to find in the middle of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataquay.client.placement import MODES, JobPlan, owners
from dataquay.server.planning.capacity import LOOKAHEAD_EPOCHS, cache_need, node_shares
from dataquay.server.planning.spill import NO_HOLDER, spill_holders
from dataquay.server.sizes import format_bytes, size_flag


@dataclass(frozen=True)
class NodeRoom:
    """One node's cache against its share of a job.

    Attributes:
        name: the node's name, or its rank in a simulation.
        share: its largest share over the epochs looked at, as the cache counts bytes.
        need: the capacity that holds the share in every epoch (headroom included).
        capacity: the cache's capacity; None when not known (a node that is down).
    """

    name: str
    share: int
    need: int
    capacity: int | None

    @property
    def short(self) -> bool:
        return self.capacity is not None and self.capacity < self.need


@dataclass(frozen=True)
class JobRoom:
    """The caches of a job's nodes against what the job puts in them.

    Attributes:
        nodes: one entry per node, in node-rank order.
        dataset_bytes: what the whole dataset takes in the caches (epoch 0's shares).
        spilled: samples that short nodes' caches spill to nodes with room; None
            where nothing spills (owners move, or spilling was not worked out).
        uncached: samples no cache has room for, where ``spilled`` is known.
    """

    nodes: list[NodeRoom]
    dataset_bytes: int
    spilled: int | None = None
    uncached: int = 0

    @property
    def need(self) -> int:
        """The one capacity that holds every node's share."""
        return max(n.need for n in self.nodes)

    def warnings(self, flag: str, per_node: bool = True) -> list[str]:
        """With ``per_node``, one line per short node; a summary naming the
        ``flag`` value that would do on every node; and a line when all caches
        together hold less than the dataset takes."""
        lines = []
        short = [n for n in self.nodes if n.short]
        for n in short if per_node else ():
            assert n.capacity is not None
            lines.append(
                f"node {n.name}: cache {format_bytes(n.capacity)} cannot hold its share ({format_bytes(n.share)})"
                f"{_headroom(n)}; {flag} {size_flag(n.need)} would"
            )
        if short:
            largest = max(self.nodes, key=lambda n: n.need)
            lines.append(
                f"{len(short)} of {len(self.nodes)} nodes are short of cache (the largest share takes "
                f"{format_bytes(largest.share)}{_headroom(largest)}): {self._overflow()}; "
                f"{flag} {size_flag(self.need)} on every node holds every share"
            )
        capacities = [n.capacity for n in self.nodes if n.capacity is not None]
        total = sum(capacities)
        if len(capacities) == len(self.nodes) and total < self.dataset_bytes:
            lines.append(
                f"the {len(self.nodes)} caches hold {format_bytes(total)} in all, less than the "
                f"{format_bytes(self.dataset_bytes)} the dataset takes in them: about "
                f"{format_bytes(self.dataset_bytes - total)} will be read from the PFS every epoch"
            )
        return lines

    def _overflow(self) -> str:
        """Where the samples that do not fit in their owner's cache are read from."""
        if not self.spilled:
            return "samples that do not fit are read from the PFS instead"
        held = f"{self.spilled} samples that do not fit are held by caches with room and read from them"
        if self.uncached:
            return f"{held}, {self.uncached} more from the PFS"
        return f"the {len(self.nodes)} caches together hold the dataset: {held}, none from the PFS"


def _headroom(node: NodeRoom) -> str:
    return " plus the exchange's headroom" if node.need > node.share else ""


def job_room(
    plan: JobPlan,
    payload_sizes: np.ndarray,
    names: Sequence[str],
    capacities: Sequence[int | None],
    epochs: int = LOOKAHEAD_EPOCHS,
    spill: bool = False,
) -> JobRoom:
    """Each node's largest share over ``epochs`` and its need in ``plan``, next
    to its capacity; ``names`` and ``capacities`` are in node-rank order. With
    ``spill``, in modes whose owners never move, also what short caches spill
    to caches with room (a capacity not known counts as a node that keeps its share)."""
    shares = node_shares(plan, payload_sizes, epochs)
    mode, q = plan.settings.mode, plan.settings.q
    nodes = [
        NodeRoom(name, share, cache_need(share, mode, q), capacity)
        for name, share, capacity in zip(names, shares.max(axis=0).tolist(), capacities, strict=True)
    ]
    if not spill or MODES[mode].owners_move:
        return JobRoom(nodes, int(shares[0].sum()))
    epoch_owners = owners(plan, 0)
    holders = spill_holders(epoch_owners, payload_sizes, [c or 0 for c in capacities], plan.settings.seed)
    spilled = int(((holders != epoch_owners) & (holders != NO_HOLDER)).sum())
    return JobRoom(nodes, int(shares[0].sum()), spilled, int((holders == NO_HOLDER).sum()))
