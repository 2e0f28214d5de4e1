"""Which nodes of a job count as lost, and who holds their share meanwhile.

(In modes whose owners move, the job record says which nodes are absent in
which epoch, :mod:`dataquay.server.planning.absences`; the holders follow
from them by :func:`healed_holders` as below.)

A node the directory has listed as down for longer than the grace period
(``--heal-after``) is lost: its share of a job's samples is held by the
others until it is back. Who takes what is a pure function of the job's
settings and the set of lost nodes, so every surviving node computes the same
holders without a word to the others: each sample of a lost node goes where
the stable placement on the surviving nodes puts it
(:func:`~dataquay.client.placement.initial_owners`), and every other sample
keeps its holder. Only holders change, never owners: the ranks' plan of every
epoch stays what it was, so no sample is lost or read twice; what changes is
which node a miss is asked of.

The grace period is measured from the directory's own record of the node's
last heartbeat, so every node counts the same nodes lost at about the same
time; nodes that disagree for a moment only ask a peer that answers
"missing", and the read goes to the PFS as it would without healing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from dataquay.client.placement import JobPlan, initial_owners
from dataquay.protos import jobs_pb2 as jpb


def lost_nodes(job: jpb.Job, listed: Mapping[str, jpb.NodeStatus], heal_after: float, now: float) -> tuple[str, ...]:
    """The job's nodes listed as down for at least ``heal_after`` seconds at
    ``now`` (unix time), and those it names that never registered, ``heal_after``
    after the job was created; sorted. None when ``heal_after`` is 0 (healing
    off). In modes whose owners move, these are what this node reports to
    the directory, which records the job's absent nodes
    (:mod:`dataquay.server.planning.absences`)."""
    return lost_nodes_until(job, listed, heal_after, now)[0]


def lost_nodes_until(
    job: jpb.Job, listed: Mapping[str, jpb.NodeStatus], heal_after: float, now: float
) -> tuple[tuple[str, ...], float]:
    """:func:`lost_nodes`, and until when (unix time) it stands while ``job``
    and ``listed`` do: when the next of the job's down or unregistered nodes
    will have been so for ``heal_after``. Every read asks which nodes are lost,
    and the answer takes a pass over the job's nodes."""
    if heal_after <= 0:
        return (), math.inf
    lost = []
    until = math.inf
    for name in job.spec.nodes:
        status = listed.get(name)
        if status is None:
            since = job.created_unix
        elif status.state == jpb.NODE_DOWN:
            since = status.last_heartbeat_unix
        else:
            continue
        if now - since >= heal_after:
            lost.append(name)
        else:
            until = min(until, since + heal_after)
    # A job that lost every node has no one to heal it.
    return (tuple(sorted(lost)) if len(lost) < len(job.spec.nodes) else ()), until


def healed_holders(plan: JobPlan, holders: np.ndarray, lost: tuple[str, ...]) -> np.ndarray:
    """``holders`` (node indices into ``plan.nodes``) with the samples of the
    ``lost`` nodes given to the survivors by the stable placement on them.

    Samples that no cache holds (-1, see :mod:`~dataquay.server.planning.spill`)
    stay so.

    Raises:
        ValueError: every node of the plan is lost.
    """
    if not lost:
        return holders
    nodes = list(plan.nodes)
    survivors = [name for name in nodes if name not in lost]
    if not survivors:
        raise ValueError(f"all {len(nodes)} nodes of the job are lost; none can hold their samples")
    settings = plan.settings
    on_survivors = initial_owners(plan.num_samples, survivors, settings.partition, plan.groups, settings.dataset)
    index = np.array([nodes.index(name) for name in survivors], dtype=holders.dtype)
    lost_index = np.array([nodes.index(name) for name in lost], dtype=holders.dtype)
    moved = np.isin(holders, lost_index)
    healed = holders.copy()
    healed[moved] = index[on_survivors[moved]]
    return healed
