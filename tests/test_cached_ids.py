"""The cache's in-memory set of held ids against LMDB's own keys: after
commits, deletes, a dropped dataset and a reopen. Real LMDB."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from store_runs import with_store
from test_store_room import write

from dataquay.server.node.cache.cached_ids import CachedIds
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite

MiB = 1 << 20


def keys_in_lmdb(store: Store, db: str) -> set[int]:
    """The ids LMDB holds, read key by key."""
    with store.env.begin(db=store.env.open_db(db.encode(), create=False)) as txn:
        return {int.from_bytes(key, "big") for key in txn.cursor().iternext(values=False)}


def test_the_bits_answer_membership_growth_and_removal() -> None:
    cached = CachedIds()
    assert not cached.mask(b"ds", np.arange(10)).any()
    cached.add(b"ds", np.array([0, 7, 8, 1000]))
    cached.add(b"ds", np.array([7, 70_000]))  # again, and past the set's end: it grows
    probe = np.array([0, 1, 7, 8, 9, 1000, 70_000, 70_001, 10**9, -1])
    assert cached.mask(b"ds", probe).tolist() == [True, False, True, True, False, True, True, False, False, False]
    cached.remove(b"ds", np.array([7, 1000, 10**9]))
    assert np.flatnonzero(cached.mask(b"ds", np.arange(80_000))).tolist() == [0, 8, 70_000]
    assert not cached.mask(b"other", np.array([0])).any()
    cached.reset(b"ds", np.array([3, 5]))
    assert np.flatnonzero(cached.mask(b"ds", np.arange(80_000))).tolist() == [3, 5]
    cached.drop(b"ds")
    assert not cached.mask(b"ds", np.array([3])).any()


def test_the_held_ids_follow_lmdb_through_commits_deletes_drops_and_a_reopen(tmp_path: Path) -> None:
    ids = np.arange(0, 3000, 7)
    gone = ids[::3]

    async def fill_and_delete(store: Store) -> None:
        await store.committed(await store.put_all(write(int(i)) for i in ids))
        assert await store.discard("ds", gone) == len(gone)
        usage = store.dataset_usage("ds")
        held = np.setdiff1d(ids, gone)[:50]
        await store.committed(await store.put_all(write(int(i)) for i in held))  # held already: left out
        assert store.dataset_usage("ds") == usage
        await store.open_dataset("other")
        await store.committed(await store.put_all([PendingWrite(b"other", 6, write(6).value)]))
        assert np.flatnonzero(store.cached_mask("ds", np.arange(4000))).tolist() == sorted(keys_in_lmdb(store, "ds"))
        assert len(keys_in_lmdb(store, "ds")) == len(ids) - len(gone)

    async def reopened(store: Store) -> None:
        held = sorted(set(ids.tolist()) - set(gone.tolist()))
        assert np.flatnonzero(store.cached_mask("ds", np.arange(4000))).tolist() == held
        assert store.cached_mask("other", np.array([5, 6])).tolist() == [False, True]
        assert await store.drop_dataset("other") == 1
        assert not store.cached_mask("other", np.array([6])).any()
        await store.open_dataset("other")  # afresh: nothing held
        assert not store.cached_mask("other", np.array([6])).any()

    with_store(tmp_path / "cache", 256 * MiB, fill_and_delete)
    with_store(tmp_path / "cache", 256 * MiB, reopened)


def test_the_count_of_held_ids_is_the_number_added_less_those_removed() -> None:
    held = CachedIds()
    held.add(b"ds", np.array([0, 7, 8, 1000, 70_000]))
    held.remove(b"ds", np.array([8, 5]))
    assert held.count(b"ds") == 4 and held.count(b"other") == 0
    assert held.ids(b"ds").tolist() == [0, 7, 1000, 70_000]
