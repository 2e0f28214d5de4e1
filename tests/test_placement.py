"""Placement is pure: the same arguments give the same split in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataquay.client.placement import (
    epoch_order,
    epoch_permutation,
    rank_indices,
    rank_split,
    samples_per_rank,
)

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
def test_ranks_take_turns_along_one_epoch_order(
    n: int, world: int, seed: int, epoch: int, drop: bool
) -> None:
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
