"""A node that leaves or joins moves the holder of about 1/M of the samples, in every mode."""

from __future__ import annotations

import numpy as np
import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan, initial_owners, moves, owners, reform

#: Many samples per canonical partition, as a real dataset has.
SAMPLES = 1_000_000
#: Moves allowed per change, in units of the ideal 1/M: rendezvous hashing
#: moves exactly the ideal; the balanced shares add what they displace.
SLACK = 1.3


def node_set(count: int, seed: int) -> list[str]:
    """``count`` node names as a site has them, in no particular order."""
    rng = np.random.default_rng(seed)
    return [f"nid{number:06d}" for number in rng.choice(1_000_000, size=count, replace=False)]


def holders(plan: JobPlan, epoch: int = 0) -> np.ndarray:
    """The name of the node holding each sample."""
    return np.array(plan.nodes)[owners(plan, epoch)]


def plan_on(
    names: list[str], mode: str = "global", partition: str = "sample", groups: np.ndarray | None = None
) -> JobPlan:
    settings = JobSettings(
        dataset="imnet",
        mode=mode,
        q=0.5 if mode == "partial" else 0.0,
        seed=3,
        partition=partition,
        batch_size=4,
        nodes=tuple(names),
        ranks_per_node=1,
    )
    return JobPlan(settings, SAMPLES, len(names), groups)


@pytest.mark.parametrize("m", [4, 8, 16, 32, 64])
def test_a_node_leaving_moves_only_about_one_mth_of_the_samples(m: int) -> None:
    for seed in range(2):
        names = node_set(m, seed)
        before = holders(plan_on(names))
        gone = names[seed % m]
        after = holders(plan_on([name for name in names if name != gone]))
        moved = before != after
        assert moved.mean() <= SLACK / m
        # All of the departed node's samples move, and few others.
        assert np.all(moved[before == gone])


@pytest.mark.parametrize("m", [4, 8, 16, 32, 64])
def test_a_node_joining_takes_only_about_one_mth_of_the_samples(m: int) -> None:
    for seed in range(2):
        names = node_set(m, seed)
        before = holders(plan_on(names))
        # A spare whose name sorts last: the case that shifted every block.
        after = holders(plan_on([*names, "zz-spare"]))
        moved = before != after
        assert moved.mean() <= SLACK / (m + 1)
        assert np.mean(after == "zz-spare") >= 0.99 / (m + 1)


@pytest.mark.parametrize("m", [4, 16, 64])
def test_shares_stay_within_two_percent_of_an_even_split(m: int) -> None:
    for names in (node_set(m, 0), node_set(m - 1, 1), node_set(m + 1, 2)):
        loads = np.bincount(owners(plan_on(names), 0), minlength=len(names))
        assert loads.sum() == SAMPLES
        assert loads.max() <= 1.02 * -(-SAMPLES // len(names))
        assert loads.min() >= 0.98 * (SAMPLES // len(names))


@pytest.mark.parametrize("mode", ["global", "local", "locality", "partial"])
def test_every_mode_places_epoch_0_stably(mode: str) -> None:
    names = node_set(16, 7)
    before = holders(plan_on(names, mode))
    after = holders(plan_on(names[:-1], mode))
    assert (before != after).mean() <= SLACK / 16


def test_whole_shards_move_about_one_mth_of_the_bytes() -> None:
    rng = np.random.default_rng(0)
    groups = rng.integers(0, 20_000, SAMPLES).astype(np.int32)
    names = node_set(32, 3)
    before = holders(plan_on(names, partition="shard", groups=groups))
    after = holders(plan_on(names[1:], partition="shard", groups=groups))
    assert (before != after).mean() <= SLACK / 32
    # A shard never splits: every sample of a group moves with it.
    moved_groups = np.unique(groups[before != after])
    assert np.all((before != after)[np.isin(groups, moved_groups)])


def test_the_order_the_nodes_are_listed_in_changes_no_holder() -> None:
    names = node_set(24, 5)
    listed = list(reversed(names))
    assert np.array_equal(holders(plan_on(names)), holders(plan_on(listed)))


def test_plans_name_as_many_nodes_as_they_count() -> None:
    with pytest.raises(ValueError, match="num_nodes is 3 but the settings name 2 nodes"):
        JobPlan(JobSettings(nodes=("a", "b")), 10, 3)
    assert np.array_equal(initial_owners(1000, 4), initial_owners(1000, ["0", "1", "2", "3"]))


@pytest.mark.parametrize("change", ["leave", "join"])
def test_a_partial_job_re_formed_mid_run_moves_about_one_mth_then_exchanges_as_before(change: str) -> None:
    m, epoch = 16, 3
    names = node_set(m, 11)
    before = plan_on(names, "partial")
    after = plan_on(names[1:] if change == "leave" else [*names, "zz-spare"], "partial")
    held = owners(before, epoch)
    reformed = reform(before, after, epoch, held)
    was, now = np.array(before.nodes)[held], np.array(after.nodes)[reformed]
    moved = was != now
    assert moved.mean() <= SLACK / min(m, len(after.nodes))
    if change == "leave":
        assert np.array_equal(moved, was == names[0])  # the departed share moves, nothing else
    else:
        assert np.all(now[moved] == "zz-spare")  # only the spare takes, from every node
        assert len(np.unique(was[moved])) == m
    loads = np.bincount(reformed, minlength=len(after.nodes))
    assert loads.max() <= 1.02 * SAMPLES / len(after.nodes) and loads.min() >= 0.98 * SAMPLES / len(after.nodes)
    # The exchange steps on from the re-formed owners, keeping each node's count.
    stepped = owners(after, epoch + 1, previous=reformed)
    assert np.array_equal(np.bincount(stepped, minlength=len(after.nodes)), loads)
    assert len(moves(after, epoch + 1, previous=reformed).ids) > 0


def test_a_re_formed_job_keeps_its_samples_and_mode() -> None:
    names = node_set(4, 0)
    with pytest.raises(ValueError, match="keeps its samples and mode: 1000000 samples in mode partial"):
        reform(plan_on(names, "partial"), plan_on(names, "global"), 1)
