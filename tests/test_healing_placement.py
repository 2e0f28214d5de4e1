"""Who holds a lost node's share (pure): the same on every node, only the lost
share moves, balanced over the survivors; and which nodes count as lost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan, owners
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.node.cluster.healing import healed_holders, lost_nodes, lost_nodes_until
from dataquay.server.planning.spill import NO_HOLDER

NAMES = tuple(f"node-{i:02d}" for i in range(16))
N = 100_000


def plan(mode: str = "global", names: tuple[str, ...] = NAMES) -> JobPlan:
    return JobPlan(JobSettings(dataset="imgs", mode=mode, nodes=names, batch_size=8), N, len(names))


@pytest.mark.parametrize("mode", ["global", "local", "locality"])
def test_only_the_lost_share_moves_and_the_survivors_share_it_evenly(mode: str) -> None:
    job = plan(mode)
    held = owners(job, 0)
    lost = ("node-03", "node-11")
    healed = healed_holders(job, held, lost)
    lost_index = [NAMES.index(name) for name in lost]
    moved = healed != held
    assert np.array_equal(moved, np.isin(held, lost_index)), "a sample of a survivor moved"
    assert not np.isin(healed, lost_index).any()
    shares = np.bincount(healed, minlength=len(NAMES))[[i for i in range(len(NAMES)) if i not in lost_index]]
    assert shares.max() / shares.mean() < 1.02 and shares.min() / shares.mean() > 0.98
    # Every node computes the same holders, whatever order it lists the lost nodes in.
    assert np.array_equal(healed_holders(job, held, tuple(reversed(lost))), healed)


def test_the_lost_share_goes_where_the_stable_placement_on_the_survivors_puts_it() -> None:
    job = plan()
    held = owners(job, 0)
    survivors = tuple(name for name in NAMES if name != "node-05")
    on_survivors = owners(plan(names=survivors), 0)
    healed = healed_holders(job, held, ("node-05",))
    lost = held == NAMES.index("node-05")
    assert [NAMES[i] for i in healed[lost][:50]] == [survivors[i] for i in on_survivors[lost][:50]]


def test_uncached_samples_stay_uncached_and_all_lost_is_refused() -> None:
    job = plan(names=NAMES[:3])
    held = owners(job, 0)
    held[:10] = NO_HOLDER
    healed = healed_holders(job, held, (NAMES[0],))
    assert (healed[:10] == NO_HOLDER).all() and not (healed == 0).any()
    with pytest.raises(ValueError, match="all 3 nodes of the job are lost"):
        healed_holders(job, held, NAMES[:3])


def status(name: str, state: jpb.NodeState, heartbeat: float) -> jpb.NodeStatus:
    return jpb.NodeStatus(info=jpb.NodeInfo(name=name), state=state, last_heartbeat_unix=heartbeat)


def test_a_node_is_lost_after_the_grace_period_and_never_with_healing_off() -> None:
    job = jpb.Job(
        spec=jpb.JobSpec(job_id="j", dataset="imgs", mode="global", nodes=["a", "b", "c", "d"]), created_unix=100.0
    )
    listed = {
        "a": status("a", jpb.NODE_UP, 1000.0),
        "b": status("b", jpb.NODE_DOWN, 990.0),  # down 10 s
        "c": status("c", jpb.NODE_DOWN, 999.0),  # down 1 s
    }  # d never registered since the job was created
    assert lost_nodes(job, listed, 5.0, 1000.0) == ("b", "d")
    assert lost_nodes(job, listed, 0.0, 1000.0) == ()
    assert lost_nodes(job, listed, 5.0, 1004.0) == ("b", "c", "d")
    every = {name: status(name, jpb.NODE_DOWN, 0.0) for name in "abcd"}
    assert lost_nodes(job, every, 5.0, 1000.0) == (), "a job with no node left has no one to heal it"
    job.spec.mode = "partial"
    assert lost_nodes(job, listed, 5.0, 1000.0) == ("b", "d"), "what a node of a partial job reports"


def test_the_lost_nodes_stand_until_the_next_down_node_passes_its_grace_period() -> None:
    job = jpb.Job(spec=jpb.JobSpec(job_id="j", dataset="imgs", nodes=["a", "b", "c", "d"]), created_unix=100.0)
    listed = {
        "a": status("a", jpb.NODE_UP, 1000.0),
        "b": status("b", jpb.NODE_DOWN, 990.0),
        "c": status("c", jpb.NODE_DOWN, 999.0),
        "d": status("d", jpb.NODE_DOWN, 998.0),
    }
    # c and d are down but within their grace; d's ends first, at 1003.
    assert lost_nodes_until(job, listed, 5.0, 1000.0) == (("b",), 1003.0)
    assert lost_nodes_until(job, listed, 5.0, 1003.0) == (("b", "d"), 1004.0)
    assert lost_nodes_until(job, listed, 5.0, 1004.0) == (("b", "c", "d"), math.inf)
    assert lost_nodes_until(job, listed, 0.0, 1000.0) == ((), math.inf), "healing off: nothing ever is"
    unregistered = jpb.Job(spec=jpb.JobSpec(job_id="k", dataset="imgs", nodes=["a", "e"]), created_unix=999.0)
    assert lost_nodes_until(unregistered, listed, 5.0, 1000.0) == ((), 1004.0), "from the job's creation"
