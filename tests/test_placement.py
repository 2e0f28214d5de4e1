"""Placement is pure: the same arguments give the same split in every process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import (
    MODES,
    PARTITIONS,
    JobPlan,
    drawn_fraction,
    epoch_order,
    epoch_permutation,
    initial_owners,
    leaving_fraction,
    locality_balance,
    locality_epoch,
    moves,
    node_of_rank,
    node_orders,
    node_reads,
    node_steps,
    owned_ids,
    owners,
    rank_indices,
    rank_length,
    rank_order,
    rank_split,
    samples_per_rank,
)
from dataquay.client.placement.modes import _exchange_picks
from dataquay.client.placement.partition import canonical_partitions

sizes = st.integers(min_value=0, max_value=700)
worlds = st.integers(min_value=1, max_value=17)
seeds = st.integers(min_value=0, max_value=2**32)
epochs = st.integers(min_value=0, max_value=1000)


def all_ranks(n: int, world: int, seed: int, epoch: int, drop_last: bool) -> list[np.ndarray]:
    return [rank_indices(n, r, world, seed=seed, epoch=epoch, drop_last=drop_last) for r in range(world)]


@given(sizes, worlds, seeds, epochs)
def test_without_drop_last_every_sample_is_read_and_only_padding_repeats(
    n: int, world: int, seed: int, epoch: int
) -> None:
    parts = all_ranks(n, world, seed, epoch, drop_last=False)
    per_rank = -(-n // world)
    assert all(len(p) == per_rank == samples_per_rank(n, world) for p in parts)
    counts = Counter(np.concatenate(parts).tolist())
    assert set(counts) == set(range(n))
    padding = per_rank * world - n
    assert sum(c - 1 for c in counts.values()) == padding
    assert padding < world


@given(sizes, worlds, seeds, epochs)
def test_with_drop_last_no_sample_repeats_and_only_the_uneven_tail_is_dropped(
    n: int, world: int, seed: int, epoch: int
) -> None:
    parts = all_ranks(n, world, seed, epoch, drop_last=True)
    assert all(len(p) == n // world == samples_per_rank(n, world, drop_last=True) for p in parts)
    read = np.concatenate(parts)
    assert len(set(read.tolist())) == len(read) == n - n % world


@given(sizes, worlds, seeds, epochs, st.booleans())
def test_ranks_take_turns_along_one_epoch_order(n: int, world: int, seed: int, epoch: int, drop: bool) -> None:
    order = epoch_order(n, seed, epoch)
    parts = all_ranks(n, world, seed, epoch, drop)
    interleaved = np.stack(parts, axis=1).ravel()
    k = min(n, len(interleaved))
    assert np.array_equal(interleaved[:k], order[:k])


@settings(max_examples=25)
@given(st.integers(min_value=1, max_value=500), seeds, epochs)
def test_epochs_and_seeds_reshuffle(n: int, seed: int, epoch: int) -> None:
    first = epoch_permutation(n, seed, epoch)
    assert sorted(first.tolist()) == list(range(n))
    assert first.dtype == np.int64
    if n >= 20:
        assert not np.array_equal(first, epoch_permutation(n, seed, epoch + 1))
        assert not np.array_equal(first, epoch_permutation(n, seed + 1, epoch))
    assert np.array_equal(epoch_order(n, seed, epoch, shuffle=False), np.arange(n))


def test_every_process_computes_the_same_split() -> None:
    args = [(1000, 3, 8, 12345, 7, False), (999, 0, 4, 0, 0, True), (10, 5, 6, 2**31, 3, False)]
    script = (
        "import json, sys\n"
        "from dataquay.client.placement import rank_indices\n"
        "print(json.dumps([rank_indices(n, r, w, seed=s, epoch=e, drop_last=d).tolist()"
        " for n, r, w, s, e, d in json.loads(sys.argv[1])]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    here = [rank_indices(n, r, w, seed=s, epoch=e, drop_last=d).tolist() for n, r, w, s, e, d in args]
    assert json.loads(out) == here


def test_split_is_torch_distributed_sampler_compatible() -> None:
    # DistributedSampler pads by repeating from the start and then strides.
    order = np.array([4, 0, 3, 1, 2])
    assert rank_split(order, 0, 3).tolist() == [4, 1]
    assert rank_split(order, 1, 3).tolist() == [0, 2]
    assert rank_split(order, 2, 3).tolist() == [3, 4]
    assert rank_split(order, 2, 3, drop_last=True).tolist() == [3]
    assert rank_split(np.array([7]), 3, 4).tolist() == [7]


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (0, 0)])
def test_invalid_rank_or_world_size_is_refused(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="rank|world size"):
        rank_split(np.arange(4), rank, world)
    with pytest.raises(ValueError, match="rank|world size"):
        rank_indices(4, rank, world, seed=0, epoch=0)


# ------------------------------------------------------------------ cluster jobs

nodes = st.integers(min_value=1, max_value=1024)
#: Few epochs: ``partial`` replays every exchange since epoch 0.
job_epochs = st.integers(min_value=0, max_value=12)
large_sizes = st.integers(min_value=1, max_value=10**6)


def random_groups(num_samples: int, num_groups: int, skew: float, seed: int) -> np.ndarray:
    """Group ids 0..num_groups-1 of uneven sizes (the larger ``skew``, the more uneven)."""
    rng = np.random.default_rng(seed)
    weights = rng.pareto(skew, num_groups) + 1.0 if skew else np.ones(num_groups)
    return rng.choice(num_groups, size=num_samples, p=weights / weights.sum()).astype(np.int32)


#: Up to 256 nodes: a placement costs O(partitions x nodes); 1024 nodes has its own test.
placed_nodes = st.integers(min_value=1, max_value=256)


@settings(max_examples=30, deadline=None)
@given(large_sizes, placed_nodes)
def test_sample_partition_shares_stay_within_a_partition_and_m_samples_of_n_over_m(n: int, m: int) -> None:
    owner = initial_owners(n, m)
    assert owner.dtype == np.int32 and owner.shape == (n,)
    assert 0 <= owner.min() and owner.max() < m
    loads = np.bincount(owner, minlength=m)
    largest = canonical_partitions(n)[1].max()
    # Each node refuses what would take it past ceil(n/m), so the slack of
    # at most m - 1 samples is all a node can lack; a partition every node
    # refused goes to the least loaded one.
    assert loads.max() <= -(-n // m) + largest
    assert loads.max() - loads.min() <= largest + m - 1


@settings(max_examples=30, deadline=None)
@given(large_sizes, placed_nodes, st.integers(min_value=1, max_value=20_000), st.sampled_from([0.0, 1.5, 0.5]), seeds)
def test_shard_partition_never_splits_a_group_and_balances_within_the_largest(
    n: int, m: int, num_groups: int, skew: float, seed: int
) -> None:
    groups = random_groups(n, min(num_groups, n), skew, seed)
    owner = initial_owners(n, m, "shard", groups)
    assert owner.dtype == np.int32 and 0 <= owner.min() and owner.max() < m
    order = np.argsort(groups, kind="stable")
    starts = np.r_[True, groups[order][1:] != groups[order][:-1]]
    first_owner_of_group = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    assert np.array_equal(owner[order], owner[order][first_owner_of_group])
    loads = np.bincount(owner, minlength=m)
    assert loads.max() - loads.min() <= np.bincount(groups).max() + m - 1


def plan_of(
    num_samples: int, num_nodes: int, ranks_per_node: int, seed: int, groups: np.ndarray | None = None, **settings: Any
) -> JobPlan:
    """A plan of these sizes and settings, the settings not given at their defaults."""
    return JobPlan(JobSettings(seed=seed, ranks_per_node=ranks_per_node, **settings), num_samples, num_nodes, groups)


@st.composite
def job_plans(draw: st.DrawFn, max_samples: int, max_nodes: int, max_g: int, modes: list[str]) -> JobPlan:
    n = draw(st.integers(min_value=1, max_value=max_samples))
    partition = draw(st.sampled_from(PARTITIONS))
    mode = draw(st.sampled_from(modes))
    settings = JobSettings(
        mode=mode,
        q=draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=mode == "partial")),
        seed=draw(seeds),
        drop_last=draw(st.booleans()),
        partition=partition,
        batch_size=draw(st.integers(min_value=1, max_value=16)),
        ranks_per_node=draw(st.integers(min_value=1, max_value=max_g)),
    )
    return JobPlan(
        settings,
        num_samples=n,
        num_nodes=draw(st.integers(min_value=1, max_value=max_nodes)),
        groups=random_groups(n, draw(st.integers(min_value=1, max_value=n)), 1.5, 0) if partition == "shard" else None,
    )


def all_rank_orders(plan: JobPlan, epoch: int) -> list[np.ndarray]:
    epoch_owners = owners(plan, epoch)
    return [rank_order(plan, epoch, r, epoch_owners) for r in range(plan.world_size)]


@settings(max_examples=60, deadline=None)
@given(job_plans(5000, 32, 8, sorted(MODES)), job_epochs)
def test_every_mode_reads_each_sample_once_per_epoch_with_equal_rank_counts(plan: JobPlan, epoch: int) -> None:
    parts = all_rank_orders(plan, epoch)
    assert all(len(p) == rank_length(plan) and p.dtype == np.int64 for p in parts)
    counts = np.bincount(np.concatenate(parts), minlength=plan.num_samples)
    assert len(counts) == plan.num_samples
    if plan.settings.drop_last:
        assert counts.max(initial=0) <= 1
    else:
        assert counts.min() >= 1


@settings(max_examples=40, deadline=None)
@given(job_plans(5000, 32, 8, ["global"]), epochs)
def test_global_mode_drops_or_pads_only_the_uneven_tail(plan: JobPlan, epoch: int) -> None:
    n, world = plan.num_samples, plan.world_size
    read = np.concatenate(all_rank_orders(plan, epoch))
    if plan.settings.drop_last:
        assert len(read) == len(np.unique(read)) == n - n % world
    else:
        assert len(read) == world * -(-n // world) and len(np.unique(read)) == n


@settings(max_examples=25, deadline=None)
@given(job_plans(10**6, 1024, 8, ["global"]), epochs, st.data())
def test_global_mode_is_the_single_node_sampler_over_the_whole_world(
    plan: JobPlan, epoch: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=plan.world_size - 1))
    expected = rank_indices(
        plan.num_samples, rank, plan.world_size, seed=plan.settings.seed, epoch=epoch, drop_last=plan.settings.drop_last
    )
    got = rank_order(plan, epoch, rank)
    assert got.dtype == np.int64 and np.array_equal(got, expected)
    assert node_of_rank(plan, rank) == rank // plan.settings.ranks_per_node


@pytest.mark.parametrize("mode", ["global", "local", "locality"])
def test_modes_that_never_move_bytes_keep_the_initial_owners_every_epoch(mode: str) -> None:
    groups = np.arange(10_000, dtype=np.int32) // 37
    for partition in PARTITIONS:
        plan = plan_of(10_000, 7, 2, seed=5, mode=mode, partition=partition, groups=groups, batch_size=4)
        first = owners(plan, 0)
        assert np.array_equal(first, initial_owners(10_000, 7, partition, groups))
        assert np.array_equal(owners(plan, 9), first)
        assert np.array_equal(owners(plan, 9, previous=first), first)
        assert len(moves(plan, 9).ids) == 0
        owned = [owned_ids(first, node) for node in range(7)]
        assert all(np.all(np.diff(ids) > 0) for ids in owned)
        assert np.array_equal(np.sort(np.concatenate(owned)), np.arange(10_000))


@settings(max_examples=40, deadline=None)
@given(job_plans(3000, 16, 4, sorted(MODES)), st.integers(min_value=1, max_value=8))
def test_owners_stepped_from_the_previous_epoch_equal_the_replay(plan: JobPlan, epoch: int) -> None:
    stepped = owners(plan, 0)
    for e in range(1, epoch + 1):
        stepped = owners(plan, e, previous=stepped)
    assert stepped.dtype == np.int32 and np.array_equal(stepped, owners(plan, epoch))
    last = plan.world_size - 1
    assert np.array_equal(rank_order(plan, epoch, last, stepped), rank_order(plan, epoch, last))


@settings(max_examples=40, deadline=None)
@given(job_plans(5000, 32, 4, ["partial"]), st.integers(min_value=1, max_value=12))
def test_partial_mode_trades_round_q_of_each_node_and_keeps_node_counts(plan: JobPlan, epoch: int) -> None:
    m = plan.num_nodes
    before = owners(plan, epoch - 1)
    loads = np.bincount(before, minlength=m)
    picks, given = _exchange_picks(plan, epoch, before)
    assert np.array_equal(given, np.rint(plan.settings.q * loads))  # rint rounds half to even, as round() does
    assert len(np.unique(picks)) == len(picks)
    assert np.array_equal(np.bincount(before[picks], minlength=m), given)
    after = owners(plan, epoch, previous=before)
    assert np.array_equal(np.bincount(after, minlength=m), loads)
    assert np.array_equal(np.bincount(after[picks], minlength=m), given)
    moved = moves(plan, epoch, previous=before)
    assert np.array_equal(moved.ids, np.flatnonzero(before != after))
    assert np.array_equal(moved.sources, before[moved.ids]) and np.array_equal(moved.targets, after[moved.ids])
    assert np.isin(moved.ids, picks).all()
    sent, received = np.bincount(moved.sources, minlength=m), np.bincount(moved.targets, minlength=m)
    assert np.array_equal(sent, received) and np.all(sent <= given)


def test_partial_mode_with_q_1_reshuffles_every_owner() -> None:
    plan = plan_of(50_000, 8, 1, seed=4, mode="partial", q=1.0)
    before, after = owners(plan, 0), owners(plan, 1)
    assert np.array_equal(np.bincount(after), np.bincount(before))
    # A full reshuffle keeps a sample on its node with probability 1/M.
    assert abs(np.mean(before == after) - 1 / 8) < 0.01


@pytest.mark.parametrize(("q_leaving", "nodes"), [(0.1, 4), (0.375, 4), (0.3, 16), (0.5, 2)])
def test_q_leaving_is_the_fraction_that_leaves_each_node_under_the_real_exchange(q_leaving: float, nodes: int) -> None:
    q = drawn_fraction(q_leaving, nodes)
    assert leaving_fraction(q, nodes) == pytest.approx(q_leaving)
    plan = plan_of(40_000, nodes, 1, seed=9, mode="partial", q=q)
    left = np.bincount(moves(plan, 1).sources, minlength=nodes) / np.bincount(owners(plan, 0), minlength=nodes)
    assert np.abs(left - q_leaving).max() < 0.02


@pytest.mark.parametrize(("q_leaving", "nodes"), [(0.0, 4), (0.8, 4), (0.6, 2), (0.1, 1)])
def test_more_leaving_than_a_full_reshuffle_moves_is_refused(q_leaving: float, nodes: int) -> None:
    with pytest.raises(ValueError, match=r"q_leaving must be in \(0, .*\] with \d+ nodes?"):
        drawn_fraction(q_leaving, nodes)
    assert drawn_fraction(0.75, 4) == 1.0  # the most that can leave: a full reshuffle


@settings(max_examples=40, deadline=None)
@given(job_plans(5000, 32, 4, ["local", "partial"]), job_epochs)
def test_local_and_partial_ranks_read_what_their_node_owns(plan: JobPlan, epoch: int) -> None:
    g = plan.settings.ranks_per_node
    epoch_owners = owners(plan, epoch)
    loads = np.bincount(epoch_owners, minlength=plan.num_nodes)
    assert rank_length(plan) == (loads.min() // g if plan.settings.drop_last else -(-loads.max() // g))
    for rank in range(plan.world_size):
        node = rank // g
        read = rank_order(plan, epoch, rank, epoch_owners)
        if loads[node]:
            assert np.all(epoch_owners[read] == node)


@settings(max_examples=40, deadline=None)
@given(job_plans(5000, 16, 4, ["locality"]), job_epochs)
def test_locality_mode_splits_the_global_batches_where_their_bytes_are(plan: JobPlan, epoch: int) -> None:
    n, m, g, b = plan.num_samples, plan.num_nodes, plan.settings.ranks_per_node, plan.settings.batch_size
    width = plan.world_size * b
    steps = np.stack(all_rank_orders(plan, epoch)).reshape(plan.world_size, -1, b)
    num_batches = steps.shape[1]
    assert num_batches == (n // width if plan.settings.drop_last else -(-n // width))
    batches = steps.transpose(1, 0, 2).reshape(num_batches, width)  # rank-major: node m holds g*b in a row
    expected = np.resize(epoch_permutation(n, plan.settings.seed, epoch), num_batches * width)
    expected = expected.reshape(num_batches, width)
    assert np.array_equal(np.sort(batches, axis=1), np.sort(expected, axis=1))
    full = n // width
    as_global = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, mode="global"))
    global_steps = np.stack(all_rank_orders(as_global, epoch))
    global_batches = global_steps[:, : full * b].reshape(plan.world_size, full, b).transpose(1, 0, 2)
    assert np.array_equal(np.sort(batches[:full], axis=1), np.sort(global_batches.reshape(full, width), axis=1))

    epoch_owners = owners(plan, epoch)
    balance = locality_balance(plan, epoch)
    assert len(balance.transfers) == num_batches and np.all(balance.transfers <= m - 1)
    owned = np.bincount(
        (np.arange(num_batches)[:, None] * m + epoch_owners[expected]).ravel(), minlength=num_batches * m
    ).reshape(num_batches, m)
    deficits = np.maximum(g * b - owned, 0).sum(axis=1)
    foreign = (epoch_owners[batches] != np.repeat(np.arange(m), g * b)).sum(axis=1)
    assert np.array_equal(balance.moved, deficits) and np.array_equal(foreign, deficits)
    assert np.allclose(balance.imbalance, deficits * 100 / width)


def test_locality_mode_over_a_million_samples_and_64_nodes() -> None:
    plan = plan_of(10**6, 64, 4, seed=2, mode="locality", batch_size=16)
    balance = locality_balance(plan, 3)
    assert len(balance.transfers) == -(-(10**6) // (64 * 4 * 16)) and balance.transfers.max() <= 63
    assert balance.imbalance.mean() < 20
    for rank in (0, plan.world_size - 1):
        assert len(rank_order(plan, 3, rank)) == rank_length(plan) == len(balance.transfers) * 16


def reference_locality_split(plan: JobPlan, epoch: int) -> tuple[np.ndarray, list[int], list[int]]:
    """Mode locality's split as its docstrings state it, one batch at a time:
    every node's share of every batch (nodes x batches x g*b), and per batch
    the balancer's transfers and the samples they move."""
    m, g, b = plan.num_nodes, plan.settings.ranks_per_node, plan.settings.batch_size
    share, width = g * b, plan.world_size * b
    num_batches = plan.num_samples // width if plan.settings.drop_last else -(-plan.num_samples // width)
    order = np.resize(epoch_permutation(plan.num_samples, plan.settings.seed, epoch), num_batches * width)
    epoch_owners = owners(plan, epoch)
    slots = np.empty((m, num_batches, share), dtype=np.int64)
    transfers, moved = [], []
    for index, batch in enumerate(order.reshape(num_batches, width)):
        held = [batch[epoch_owners[batch] == node].tolist() for node in range(m)]
        taken = [ids[:share] for ids in held]
        given = [share] * m
        surplus = [len(ids) - share for ids in held]
        transfers.append(0)
        moved.append(0)
        while any(surplus):
            source, sink = surplus.index(max(surplus)), surplus.index(min(surplus))
            amount = min(surplus[source], -surplus[sink])
            taken[sink] += held[source][given[source] : given[source] + amount]
            given[source] += amount
            surplus[source] -= amount
            surplus[sink] += amount
            transfers[-1] += 1
            moved[-1] += amount
        slots[:, index] = taken
    return slots, transfers, moved


def assert_locality_split_is_the_reference(plan: JobPlan, epoch: int) -> None:
    slots, transfers, moved = reference_locality_split(plan, epoch)
    g = plan.settings.ranks_per_node
    epoch_owners = owners(plan, epoch)
    split = locality_epoch(plan, epoch, epoch_owners)
    for node in range(plan.num_nodes):
        assert split.node_slots(node).tobytes() == slots[node].tobytes()
        for rank in range(node * g, (node + 1) * g):
            assert split.rank_order(rank).tobytes() == slots[node][:, rank - node * g :: g].ravel().tobytes()
    for rank in {0, plan.world_size // 2, plan.world_size - 1}:
        assert rank_order(plan, epoch, rank, epoch_owners).tobytes() == split.rank_order(rank).tobytes()
    imbalance = np.array(moved, dtype=np.int64) * 100.0 / (plan.world_size * plan.settings.batch_size)
    for balance in (split.balance(), locality_balance(plan, epoch), locality_balance(plan, epoch, epoch_owners)):
        assert balance.transfers.tolist() == transfers and balance.moved.tolist() == moved
        assert balance.imbalance.tobytes() == imbalance.tobytes()


@settings(max_examples=40, deadline=None)
@given(job_plans(3000, 12, 4, ["locality"]), job_epochs)
def test_locality_split_is_the_batch_by_batch_balancer(plan: JobPlan, epoch: int) -> None:
    assert_locality_split_is_the_reference(plan, epoch)


@pytest.mark.parametrize(
    ("num_samples", "num_nodes", "ranks_per_node", "batch_size", "drop_last"),
    [(100_003, 64, 2, 8, False), (30_000, 300, 1, 2, True)],
)
def test_locality_split_of_many_batches_is_the_batch_by_batch_balancer(
    num_samples: int, num_nodes: int, ranks_per_node: int, batch_size: int, drop_last: bool
) -> None:
    settings = {"mode": "locality", "batch_size": batch_size, "drop_last": drop_last}
    plan = plan_of(num_samples, num_nodes, ranks_per_node, seed=11, **settings)
    assert_locality_split_is_the_reference(plan, 5)


def test_locality_epoch_refuses_a_bad_node_rank_or_owners() -> None:
    plan = plan_of(1000, 4, 2, seed=1, mode="locality", batch_size=4)
    split = locality_epoch(plan, 0)
    with pytest.raises(ValueError, match="node must be in 0..3, not 4"):
        split.node_slots(4)
    with pytest.raises(ValueError, match="rank 8 is not in 0..7"):
        split.rank_order(8)
    with pytest.raises(ValueError, match="epoch owners have 999 entries for 1000 samples"):
        locality_epoch(plan, 0, owners(plan, 0)[:-1])


def test_jobs_on_one_dataset_share_holders_whatever_their_seeds() -> None:
    groups = np.arange(100_000, dtype=np.int32) // 100
    for partition in PARTITIONS:
        one = owners(plan_of(100_000, 16, 1, seed=1, partition=partition, groups=groups, dataset="imnet"), 0)
        other_seed = owners(plan_of(100_000, 16, 1, seed=2, partition=partition, groups=groups, dataset="imnet"), 0)
        other_dataset = owners(plan_of(100_000, 16, 1, seed=1, partition=partition, groups=groups, dataset="c4"), 0)
        assert np.array_equal(one, other_seed)
        assert not np.array_equal(one, other_dataset)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_a_million_samples_over_1024_nodes(partition: str) -> None:
    n, m, g = 10**6, 1024, 4
    groups = random_groups(n, 10_000, 1.5, 0)
    plan = plan_of(n, m, g, seed=3, partition=partition, groups=groups)
    loads = np.bincount(owners(plan, 0), minlength=m)
    assert loads.sum() == n
    largest = canonical_partitions(n)[1].max() if partition == "sample" else np.bincount(groups).max()
    assert loads.max() - loads.min() <= largest + m - 1
    for rank in (0, 1, plan.world_size - 1):
        assert len(rank_order(plan, 2, rank)) == rank_length(plan) == -(-n // plan.world_size)


def fingerprints(plans: list[dict[str, Any]]) -> list[str]:
    """A hash of the owners and of some ranks' orders of each plan."""
    out = []
    for fields in plans:
        plan = plan_of(**fields, groups=random_groups(fields["num_samples"], 10_000, 1.5, 0))
        digest = hashlib.sha256(owners(plan, 1).tobytes())
        digest.update(moves(plan, 1).ids.tobytes())
        for rank in (0, plan.world_size // 2, plan.world_size - 1):
            digest.update(rank_order(plan, 1, rank).tobytes())
        out.append(digest.hexdigest())
    return out


def test_every_process_computes_the_same_owners_and_orders() -> None:
    plans = [
        {"num_samples": 10**6, "num_nodes": 1024, "ranks_per_node": 2, "seed": 7, "partition": "sample"},
        {"num_samples": 10**6, "num_nodes": 1024, "ranks_per_node": 2, "seed": 7, "partition": "shard"},
        {"num_samples": 12_345, "num_nodes": 5, "ranks_per_node": 3, "seed": 2**40, "drop_last": True},
        {"num_samples": 10**5, "num_nodes": 64, "ranks_per_node": 2, "seed": 7, "mode": "local", "partition": "shard"},
        {"num_samples": 10**5, "num_nodes": 64, "ranks_per_node": 2, "seed": 7, "mode": "partial", "q": 0.3},
        {"num_samples": 10**5, "num_nodes": 64, "ranks_per_node": 2, "seed": 7, "mode": "locality", "batch_size": 8},
    ]
    script = (
        "import json, sys\n"
        "from test_placement import fingerprints\n"
        "print(json.dumps(fingerprints(json.loads(sys.argv[1]))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(plans)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])},
    ).stdout
    assert json.loads(out) == fingerprints(plans)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mode": "sideways"}, "mode"),
        ({"partition": "stripe"}, "partition"),
        ({"num_samples": -1}, "num_samples"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"ranks_per_node": -1}, "ranks_per_node"),
        ({"seed": -2}, "seed"),
        ({"q": 1.5}, "q"),
        ({"mode": "partial"}, r"q must be in \(0, 1\] for mode partial"),
        ({"mode": "locality"}, "batch_size must be at least 1 for mode locality"),
        ({"batch_size": -1}, "batch_size must not be negative"),
        ({"partition": "shard"}, "shard partition needs the group"),
        ({"partition": "shard", "groups": np.zeros(3, dtype=np.int32)}, "one group per sample"),
        ({"partition": "shard", "groups": np.full(10, -1)}, "negative"),
    ],
)
def test_a_bad_plan_field_is_named(fields: dict[str, Any], named: str) -> None:
    base = {"num_samples": 10, "num_nodes": 2, "ranks_per_node": 1, "seed": 0}
    with pytest.raises(ValueError, match=named):
        plan_of(**{**base, **fields})


def test_mode_settings_are_checked_before_any_plan_exists() -> None:
    JobSettings(mode="partial", q=1.0).check()
    JobSettings(mode="locality", batch_size=1).check()
    with pytest.raises(ValueError, match="mode must be one of global, local, partial, locality"):
        JobSettings(mode="sideways").check()
    with pytest.raises(ValueError, match="q must be in"):
        JobSettings(mode="partial").check()


def test_bad_partition_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        initial_owners(10, 0)
    with pytest.raises(ValueError, match="partition must be one of sample, shard"):
        initial_owners(10, 2, "stripe")
    with pytest.raises(ValueError, match="Manifest.shard_groups"):
        initial_owners(10, 2, "shard")
    with pytest.raises(ValueError, match=r"node names must differ: \['a'\] repeat"):
        initial_owners(10, ["a", "b", "a"])
    plan = plan_of(10, 2, 2, seed=0)
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        rank_order(plan, 0, 4)
    with pytest.raises(ValueError, match="epoch"):
        owners(plan, -1)
    with pytest.raises(ValueError, match="previous owners have 3 entries for 10 samples"):
        owners(plan, 1, previous=np.zeros(3, dtype=np.int32))


def test_plans_compare_and_hash_by_their_settings() -> None:
    groups = np.zeros(4, dtype=np.int32)
    assert plan_of(4, 2, 1, 0, partition="shard", groups=groups) == plan_of(
        4, 2, 1, 0, partition="shard", groups=groups.copy()
    )
    assert hash(plan_of(4, 2, 1, 0)) == hash(plan_of(4, 2, 1, 0))
    assert plan_of(4, 2, 1, 0) != plan_of(4, 2, 1, 1)
    assert plan_of(4, 2, 3, 0).world_size == 6


def test_large_seeds_do_not_alias_other_epochs() -> None:
    assert not np.array_equal(epoch_permutation(1000, 2**32 + 5, 0), epoch_permutation(1000, 5, 1))


@settings(max_examples=40, deadline=None)
@given(job_plans(3000, 8, 4, sorted(MODES)), job_epochs)
def test_node_orders_are_the_nodes_rank_orders_row_by_row(plan: JobPlan, epoch: int) -> None:
    epoch_owners = owners(plan, epoch)
    g = plan.settings.ranks_per_node
    for node in range(plan.num_nodes):
        rows = node_orders(plan, epoch, node, epoch_owners)
        assert rows.shape == (g, rank_length(plan)) and rows.dtype == np.int64
        for local in range(g):
            assert rows[local].tolist() == rank_order(plan, epoch, node * g + local, epoch_owners).tolist()
    assert node_orders(plan, epoch, 0).tolist() == node_orders(plan, epoch, 0, epoch_owners).tolist()
    with pytest.raises(ValueError, match="node must be in"):
        node_orders(plan, epoch, plan.num_nodes)


@settings(max_examples=40, deadline=None)
@given(job_plans(3000, 8, 4, sorted(MODES)), job_epochs)
def test_node_reads_name_the_rank_and_position_of_each_samples_first_read(plan: JobPlan, epoch: int) -> None:
    epoch_owners = owners(plan, epoch)
    g = plan.settings.ranks_per_node
    for node in range(plan.num_nodes):
        reads = node_reads(plan, epoch, node, epoch_owners)
        rows = node_orders(plan, epoch, node, epoch_owners)
        read_here = np.unique(rows)
        assert (reads.rank[read_here] >= node * g).all() and (reads.rank[read_here] < (node + 1) * g).all()
        assert (reads.rank[np.setdiff1d(np.arange(plan.num_samples), read_here)] == -1).all()
        for sample in read_here[:50].tolist():
            local = reads.rank[sample] - node * g
            assert rows[local, reads.position[sample]] == sample
            assert not any((rows[r, : reads.position[sample] if r == local else 0] == sample).any() for r in range(g))


@pytest.mark.parametrize("mode", ["global", "locality", "local"])
def test_node_steps_are_what_the_nodes_ranks_read_step_by_step(mode: str) -> None:
    plan = plan_of(1000, 3, 2, seed=7, mode=mode, batch_size=8)
    per_rank = [rank_order(plan, 1, rank) for rank in range(plan.world_size)]
    for node in range(plan.num_nodes):
        steps = node_steps(plan, 1, node)
        assert len(steps) == -(-rank_length(plan) // 8)
        ranks = per_rank[2 * node : 2 * node + 2]
        for index, step in enumerate(steps):
            start = 8 * index
            if mode == "locality":  # rank g*node + r reads columns r, r+g, ... of its node's step
                assert sorted(step.tolist()) == sorted(np.concatenate([r[start : start + 8] for r in ranks]).tolist())
            else:
                assert step.tolist() == np.concatenate([r[start : start + 8] for r in ranks]).tolist()
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        node_steps(plan_of(100, 2, 1, seed=0), 0, 0)
