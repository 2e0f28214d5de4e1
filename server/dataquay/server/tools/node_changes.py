"""How :mod:`.simulate` models a node that leaves a running job and one that
joins it, as the daemons handle each: which samples change holder, and
whether each comes over the network from its old holder or from the PFS
(its old holder is gone).

- Modes whose owners never move heal
  (:mod:`dataquay.server.node.cluster.healing`): the share of the node that
  left goes where the stable placement on the others puts it, a node that
  joins takes its share of the stable placement from whoever held it, and
  nothing else moves (:func:`static_change`).
- Modes whose owners move keep their owners, and with them every rank's
  reads: the node that left is absent from the job's holders
  (:mod:`dataquay.server.planning.absences`), its share held by the others
  by the same stable placement, and the exchange moves samples between
  holders (:func:`holder_moves`). The absent node's share is read from the
  PFS once, by its new holders; when it is back it takes its share from
  them. A node new to such a job re-forms it on the new node set
  (:func:`~dataquay.client.placement.reform`), as resuming it there would.

Plain functions over owner arrays (node indexes per sample id), no I/O.
"""

from __future__ import annotations

import numpy as np

from dataquay.client.placement import MODES, JobPlan, Moves, owners, reform
from dataquay.server.node.cluster.healing import healed_holders


def static_change(before: JobPlan, after: JobPlan, current: np.ndarray, epoch: int) -> tuple[np.ndarray, Moves]:
    """The holders on ``after``'s nodes of the epoch before ``epoch`` (which
    ``current`` holds), and the samples whose holder changed: their source
    indexes ``after``'s nodes (-1 where the holder left), their target too.
    In a mode whose owners move, ``after`` re-forms the job (a node new to it)."""
    index = {name: node for node, name in enumerate(after.nodes)}
    survivor = np.array([index.get(name, -1) for name in before.nodes], dtype=np.int32)
    old = survivor[current]
    if MODES[after.settings.mode].owners_move:
        new = reform(before, after, epoch - 1, current)
    else:
        new = _healed(before, after, current, survivor)
    ids = np.flatnonzero(old != new).astype(np.int64)
    return new, Moves(ids, old[ids], new[ids])


def _healed(before: JobPlan, after: JobPlan, current: np.ndarray, survivor: np.ndarray) -> np.ndarray:
    left = tuple(name for name in before.nodes if name not in after.nodes)
    new = survivor[healed_holders(before, current, left)] if left else survivor[current]
    joined = [node for node, name in enumerate(after.nodes) if name not in before.nodes]
    if joined:
        stable = owners(after, 0)
        takes = np.isin(stable, joined)
        new[takes] = stable[takes]
    return new.astype(current.dtype, copy=False)


def absent_holders(plan: JobPlan, epoch_owners: np.ndarray, absent: tuple[str, ...]) -> np.ndarray:
    """The holders of an epoch of a job whose owners move, with ``absent`` nodes left out."""
    return healed_holders(plan, epoch_owners, absent) if absent else epoch_owners


def holder_moves(
    plan: JobPlan, before: np.ndarray, after: np.ndarray, left: tuple[str, ...], back: tuple[str, ...]
) -> tuple[Moves, Moves]:
    """What changes holder from ``before`` to ``after`` (holders of two epochs
    in a row): everything the exchange ships, its sources -1 where the old
    holder ``left`` at this epoch (read from the PFS); and, of those, what
    the node change moved: the share of the nodes that left, and the share
    the nodes ``back`` take."""
    ids = np.flatnonzero(before != after).astype(np.int64)
    sources, targets = before[ids].astype(np.int32), after[ids].astype(np.int32)
    nodes = list(plan.nodes)
    gone = np.isin(sources, [nodes.index(name) for name in left])
    sources[gone] = -1
    changed = gone | np.isin(targets, [nodes.index(name) for name in back])
    return Moves(ids, sources, targets), Moves(ids[changed], sources[changed], targets[changed])
