"""The spill placement: each node fills its own cache, the overflow goes to nodes with room."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dataquay.client.placement import initial_owners
from dataquay.server.planning.capacity import cached_bytes
from dataquay.server.planning.spill import NO_HOLDER, spill_holders, spill_priority, usable_bytes

KiB = 1 << 10


def _job(num_samples: int = 400, nodes: int = 4, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.random.default_rng(seed).integers(3 * KiB, 20 * KiB, num_samples)
    return initial_owners(num_samples, nodes), sizes


def _shares(owners: np.ndarray, sizes: np.ndarray, nodes: int) -> list[int]:
    return [cached_bytes(sizes[owners == node]) for node in range(nodes)]


def _within(holders: np.ndarray, sizes: np.ndarray, capacities: list[int]) -> None:
    for node, capacity in enumerate(capacities):
        if capacity > 0:
            assert cached_bytes(sizes[holders == node]) <= usable_bytes(capacity)


def test_nothing_spills_when_every_share_fits() -> None:
    owners, sizes = _job()
    capacities = [2 * share for share in _shares(owners, sizes, 4)]
    holders = spill_holders(owners, sizes, capacities, seed=7)
    assert np.array_equal(holders, owners)


def test_a_small_cache_spills_to_the_nodes_with_room_and_everything_is_cached() -> None:
    owners, sizes = _job()
    shares = _shares(owners, sizes, 4)
    capacities = [shares[0] // 3, *(2 * share for share in shares[1:])]
    holders = spill_holders(owners, sizes, capacities, seed=7)
    assert (holders != NO_HOLDER).all()
    _within(holders, sizes, capacities)
    spilled = (owners == 0) & (holders != 0)
    assert spilled.sum() > 100 // 2
    assert np.array_equal(holders[owners != 0], owners[owners != 0])  # the others keep all theirs
    # Node 0 keeps a prefix of its samples in priority order, and the first taker fills before the next.
    priority = spill_priority(len(owners), seed=7)
    assert priority[owners == 0][~spilled[owners == 0]].max() < priority[spilled].min()
    taken_by = holders[spilled][np.argsort(priority[spilled])]
    assert np.array_equal(taken_by, np.sort(taken_by))


def test_what_no_cache_has_room_for_is_read_from_the_pfs() -> None:
    owners, sizes = _job()
    shares = _shares(owners, sizes, 4)
    capacities = [shares[0] // 2, shares[1] // 2, shares[2] + shares[0] // 4, shares[3] + shares[3] // 8]
    holders = spill_holders(owners, sizes, capacities, seed=7)
    _within(holders, sizes, capacities)
    assert 0 < (holders == NO_HOLDER).sum() < (owners <= 1).sum()
    assert ((holders == 2) & (owners != 2)).any()
    assert set(np.unique(owners[holders == NO_HOLDER]).tolist()) <= {0, 1}


def test_a_node_of_unknown_capacity_keeps_its_share_and_takes_none() -> None:
    owners, sizes = _job()
    shares = _shares(owners, sizes, 4)
    capacities = [shares[0] // 3, 0, 0, 2 * shares[3]]
    holders = spill_holders(owners, sizes, capacities, seed=7)
    assert np.array_equal(holders[(owners == 1) | (owners == 2)], owners[(owners == 1) | (owners == 2)])
    assert set(np.unique(holders[owners == 0]).tolist()) <= {NO_HOLDER, 0, 3}
    assert ((owners == 0) & (holders == 3)).any()


def test_a_cache_too_small_for_one_sample_holds_nothing() -> None:
    owners, sizes = _job()
    holders = spill_holders(owners, sizes, [KiB, KiB, KiB, KiB], seed=7)
    assert (holders == NO_HOLDER).all()


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(1, 5),
    st.integers(0, 2**40),
    st.lists(st.integers(-1, 2_000_000), min_size=5, max_size=5),
)
def test_holders_are_deterministic_and_within_every_capacity(
    num_samples: int, nodes: int, seed: int, capacities: list[int]
) -> None:
    owners = initial_owners(num_samples, nodes)
    sizes = np.random.default_rng(seed).integers(1, 16 * KiB, num_samples)
    capacities = capacities[:nodes]
    holders = spill_holders(owners, sizes, capacities, seed)
    assert np.array_equal(holders, spill_holders(owners, sizes, capacities, seed))
    assert holders.dtype == np.int32 and holders.shape == owners.shape
    _within(holders, sizes, capacities)
    unknown = np.isin(owners, [n for n, c in enumerate(capacities) if c <= 0])
    assert np.array_equal(holders[unknown], owners[unknown])
    spilled = (holders != owners) & (holders != NO_HOLDER)
    for taker in np.unique(holders[spilled]).tolist():
        assert capacities[taker] > 0
        assert (holders[owners == taker] == taker).all()  # only a node that kept its whole share takes more
