"""The Sampler: rank and world size from the launcher's environment, and the
DistributedSampler contract across ranks and epochs."""

from __future__ import annotations

import importlib.util
import json
import re
import time

import pytest

from dataquay.client.env import Topology, topology
from dataquay.client.placement import epoch_order
from dataquay.client.sampler import Sampler

_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


def test_topology_prefers_torchrun_variables_then_slurm_then_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert topology() == Topology(rank=0, world_size=1, local_rank=0, local_world_size=1)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert topology() == Topology(5, 8, 1, 4)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert topology() == Topology(3, 16, 3, 8)
    assert topology({"WORLD_SIZE": "2"}) == Topology(0, 2, 0, 1)


@pytest.mark.parametrize("value", ["two", "-1", "4(x2)"])
def test_malformed_variable_is_named_in_the_error(value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"WORLD_SIZE={value!r}")):
        topology({"WORLD_SIZE": value})


def test_sampler_reads_rank_and_world_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    sampler = Sampler(10)
    assert (sampler.rank, sampler.world_size) == (1, 3)
    assert Sampler(10, rank=0).rank == 0
    assert Sampler(10, world_size=2).world_size == 2


@pytest.mark.parametrize(("rank", "world"), [(3, 3), (-1, 2), (0, 0)])
def test_rank_outside_the_world_is_refused(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="rank|world size"):
        Sampler(10, rank=rank, world_size=world)


def test_ranks_cover_the_epoch_with_equal_counts_and_reshuffle_per_epoch() -> None:
    samplers = [Sampler(103, rank=r, world_size=4, seed=7) for r in range(4)]
    first = [list(s) for s in samplers]
    assert all(len(ids) == len(s) == 26 for ids, s in zip(first, samplers))
    assert set().union(*first) == set(range(103))
    assert all(isinstance(i, int) for i in first[0])
    assert [list(s) for s in samplers] == first
    for s in samplers:
        s.set_epoch(1)
    second = [list(s) for s in samplers]
    assert second != first and set().union(*second) == set(range(103))
    again = Sampler(103, rank=2, world_size=4, seed=7)
    again.set_epoch(1)
    assert list(again) == second[2]
    with pytest.raises(ValueError, match="epoch"):
        again.set_epoch(-1)


def test_drop_last_and_no_shuffle() -> None:
    ranks = [Sampler(10, rank=r, world_size=4, shuffle=False, drop_last=True) for r in range(4)]
    assert [list(s) for s in ranks] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(len(s) == 2 for s in ranks)
    assert list(Sampler(0, rank=0, world_size=2)) == []


def test_a_restarted_sampler_resumes_the_epoch_where_it_stopped_in_the_same_order() -> None:
    settings = {"rank": 1, "world_size": 4, "seed": 7}
    whole = Sampler(103, **settings)
    whole.set_epoch(2)
    sampler = Sampler(103, **settings)
    sampler.set_epoch(2)
    ids = iter(sampler)
    head = [next(ids) for _ in range(10)]
    state = json.loads(json.dumps(sampler.state_dict()))
    assert state == {
        "epoch": 2,
        "position": 10,
        "consumed": 40,
        "num_samples": 103,
        "world_size": 4,
        "rank": 1,
        "seed": 7,
        "shuffle": 1,
        "drop_last": 0,
    }
    restarted = Sampler(103, **settings)
    restarted.load_state_dict(state)
    restarted.set_epoch(2)
    tail = list(restarted)
    assert head + tail == list(whole)
    assert (len(restarted), len(tail)) == (26, 16)
    assert restarted.state_dict()["position"] == 0
    restarted.set_epoch(3)
    whole.set_epoch(3)
    assert list(restarted) == list(whole)


def test_a_restore_without_set_epoch_resumes_and_is_consumed_by_one_iteration() -> None:
    sampler = Sampler(50, rank=0, world_size=2, seed=1)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 4, "position": 20})
    assert list(sampler) == sampler.indices().tolist()[20:]
    assert list(sampler) == sampler.indices().tolist()
    sampler.load_state_dict({**sampler.state_dict(), "position": 5})
    iter(sampler)
    sampler.set_epoch(4)
    assert list(sampler) == sampler.indices().tolist()
    sampler.load_state_dict({**sampler.state_dict(), "position": 5})
    sampler.set_epoch(5)
    assert list(sampler) == sampler.indices().tolist()


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"num_samples": 104}, "saved with num_samples=103 but this sampler has num_samples=104"),
        ({"seed": 8}, "saved with seed=7 but this sampler has seed=8"),
        ({"shuffle": False}, "saved with shuffle=1 but this sampler has shuffle=0"),
        ({"drop_last": True}, "saved with drop_last=0 but this sampler has drop_last=1"),
    ],
)
def test_a_state_from_a_sampler_with_another_order_is_refused_naming_the_field(
    other: dict[str, int], message: str
) -> None:
    settings = {"num_samples": 103, "rank": 1, "world_size": 4, "seed": 7, **other}
    sampler = Sampler(**settings)
    with pytest.raises(ValueError, match=re.escape(message)):
        sampler.load_state_dict(Sampler(103, rank=1, world_size=4, seed=7).state_dict())
    assert (sampler.epoch, sampler.position) == (0, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": None}, "sampler state has no 'seed'"),
        ({"epoch": -1}, "non-negative int epoch, not -1"),
        ({"position": "3"}, "non-negative int position, not '3'"),
        ({"position": 27}, "position 27 is past the 26 ids of rank 1's epoch"),
        ({"consumed": 200, "rank": 0}, "consumed 200 ids at position 0: not inside the 103 ids of the epoch"),
    ],
)
def test_a_malformed_state_is_refused(change: dict[str, object], message: str) -> None:
    sampler = Sampler(103, rank=1, world_size=4, seed=7)
    state = {k: v for k, v in {**sampler.state_dict(), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        sampler.load_state_dict(state)


def test_a_cursor_saved_with_the_ids_consumed_resumes_there_not_where_the_iterator_is() -> None:
    sampler = Sampler(20, rank=0, world_size=1, seed=2)
    ids = iter(sampler)
    taken = [next(ids) for _ in range(9)]
    assert sampler.state_dict()["position"] == 9
    state = sampler.state_dict(consumed=5)
    assert state["position"] == 5 and sampler.position == 9
    resumed = Sampler(20, rank=0, world_size=1, seed=2)
    resumed.load_state_dict(state)
    assert taken[:5] + list(resumed) == list(Sampler(20, rank=0, world_size=1, seed=2))
    list(ids)  # the iterator is done; training used all 20: the next epoch starts at 0
    assert sampler.state_dict(consumed=20)["position"] == 0 and sampler.state_dict(consumed=17)["position"] == 17
    for bad in (-1, 21):
        with pytest.raises(ValueError, match=f"consumed={bad} is outside the 20 ids"):
            sampler.state_dict(consumed=bad)


def test_torch_sampler_forwards_the_cursor_that_stateful_dataloader_saves() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: the adapter needs it")
    from dataquay.client.torch import TorchSampler

    sampler = TorchSampler(Sampler(20, rank=0, world_size=1))
    ids = iter(sampler)
    head = [next(ids) for _ in range(5)]
    restarted = TorchSampler(Sampler(20, rank=0, world_size=1))
    restarted.load_state_dict(sampler.state_dict())
    assert head + list(restarted) == list(Sampler(20, rank=0, world_size=1))


def read_in_lockstep(samplers: list[Sampler], steps: int | None = None) -> list[int]:
    """What the ranks read, step by step, rank after rank: the job-wide order they deal."""
    iters = [iter(sampler) for sampler in samplers]
    read = []
    for _ in range(len(samplers[0]) - samplers[0].position if steps is None else steps):
        read.extend(next(ids) for ids in iters)
    return read


@pytest.mark.parametrize("resumed_world", [3, 6, 4, 1])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_job_resumed_on_another_world_size_reads_the_same_order_each_sample_once(
    resumed_world: int, drop_last: bool
) -> None:
    n, seed, epoch = 103, 7, 2
    ranks = [Sampler(n, rank=r, world_size=4, seed=seed, drop_last=drop_last) for r in range(4)]
    for sampler in ranks:
        sampler.set_epoch(epoch)
    head = read_in_lockstep(ranks, steps=10)
    states = [json.loads(json.dumps(sampler.state_dict())) for sampler in ranks]
    assert {state["consumed"] for state in states} == {40}
    resumed = [
        Sampler(n, rank=r, world_size=resumed_world, seed=seed, drop_last=drop_last) for r in range(resumed_world)
    ]
    for sampler in resumed:
        # Any rank's state: a launcher hands each new rank whichever it has.
        sampler.load_state_dict(states[sampler.rank % 4])
        sampler.set_epoch(epoch)
    tail = read_in_lockstep(resumed)
    order = epoch_order(n, seed, epoch).tolist()
    read = head + tail
    if drop_last:
        assert read == order[: len(read)] and len(read) == len(set(read)) > n - resumed_world - 4
    else:
        # Only the padding of the last step repeats ids.
        assert read[:n] == order and len(read) - n < max(resumed_world, 4)
    for sampler in resumed:
        sampler.set_epoch(epoch + 1)
    whole_next = read_in_lockstep(resumed)
    assert whole_next[: n - n % resumed_world] == epoch_order(n, seed, epoch + 1).tolist()[: n - n % resumed_world]


def test_a_state_saved_without_consumed_resumes_on_another_world_size() -> None:
    old = {
        "epoch": 1,
        "position": 5,
        "num_samples": 40,
        "world_size": 2,
        "rank": 0,
        "seed": 3,
        "shuffle": 1,
        "drop_last": 0,
    }
    resumed = [Sampler(40, rank=r, world_size=5, seed=3) for r in range(5)]
    for sampler in resumed:
        sampler.load_state_dict(old)
    assert read_in_lockstep(resumed) == epoch_order(40, 3, 1).tolist()[10:]


def test_a_loop_asking_for_its_order_every_step_computes_it_once_per_epoch() -> None:
    # The README's cluster loop calls indices() each step: at 1.28M samples
    # a permutation is ~100 ms, about 70 s an epoch if computed every time.
    sampler = Sampler(1_280_000, rank=3, world_size=8, seed=5)
    started = time.perf_counter()
    first = sampler.indices()
    for _ in range(100):
        assert sampler.indices() is first
    assert time.perf_counter() - started < 2.0
    assert not first.flags.writeable  # shared by every call: nobody may shuffle it in place
    fresh = Sampler(1_280_000, rank=3, world_size=8, seed=5)
    sampler.set_epoch(1)
    fresh.set_epoch(1)
    assert sampler.indices() is not first and (sampler.indices() == fresh.indices()).all()
    assert (sampler.indices(0) == first).all()
    # A resume on another world size deals the rest of the epoch anew: not the cached order.
    state = sampler.state_dict(consumed=1000)
    resumed = Sampler(1_280_000, rank=3, world_size=4, seed=5)
    resumed.indices(1)
    resumed.load_state_dict({**state, "world_size": 4, "rank": 3})
    resumed.set_epoch(1)
    assert len(resumed.indices()) == len(resumed) < len(Sampler(1_280_000, rank=3, world_size=4, seed=5))
