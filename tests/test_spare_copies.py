"""UberShuffle's cache model: a node keeps what it owns and, up to capacity, spares it held before."""

from __future__ import annotations

import numpy as np

from dataquay.server.tools.spare_copies import balanced_owners, refill


def test_owners_are_balanced_to_within_one_sample() -> None:
    loads = np.bincount(balanced_owners(1003, 10, np.random.default_rng(1)), minlength=10)
    assert loads.sum() == 1003 and loads.max() - loads.min() == 1


def test_a_cache_keeps_all_it_owns_and_fills_up_with_spares_it_already_held() -> None:
    rng = np.random.default_rng(2)
    before = balanced_owners(1000, 4, rng)
    caches = refill([np.arange(1000)] * 4, before, 400, rng)
    after = balanced_owners(1000, 4, rng)
    refilled = refill(caches, after, 400, rng)
    for node, (old, new) in enumerate(zip(caches, refilled, strict=True)):
        owned = np.flatnonzero(after == node)
        assert len(new) == 400 and len(np.unique(new)) == 400
        assert np.isin(owned, new).all()
        assert np.isin(np.setdiff1d(new, owned), old).all()


def test_a_cache_no_larger_than_the_share_holds_only_the_share() -> None:
    rng = np.random.default_rng(3)
    owners = balanced_owners(100, 4, rng)
    caches = refill([np.arange(100)] * 4, owners, 10, rng)
    assert [sorted(c.tolist()) for c in caches] == [np.flatnonzero(owners == m).tolist() for m in range(4)]
