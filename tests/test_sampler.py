"""The Sampler: rank and world size from the launcher's environment, and the
DistributedSampler contract across ranks and epochs."""

from __future__ import annotations

import re

import pytest

from dataquay.client.env import Topology, topology
from dataquay.client.sampler import Sampler

_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


def test_topology_prefers_torchrun_variables_then_slurm_then_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
