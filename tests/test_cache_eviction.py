"""The cache manager's policy, pure: least recently used first among what no
live job pins and no one used within the minimum age, whole holdings then a
part of the last; admission says what fits; quotas name the one passed. And
the manager over a real store: an exchange's arrivals past a quota refused,
a pinned holding kept when an exchange needs room."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_runs import with_store

from dataquay.client.wire.records import encode_value
from dataquay.server.config import ConfigFile, DaemonConfig
from dataquay.server.errors import CacheQuotaError, ConfigError
from dataquay.server.manifest_build import build_manifest
from dataquay.server.node.cache.eviction import Holdings, admit, partial_ids, plan_evictions
from dataquay.server.node.cache.manager import Admitted, CacheManager
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.quotas import Quota, exceeded, parse_quotas
from dataquay.server.registry import Registered, Registry
from dataquay.server.tools.synthetic import make_files_dataset

DAY = 86400.0
NOW = 100 * DAY


def holdings(nbytes: list[int], days_unused: list[float], pinned: list[bool]) -> Holdings:
    return Holdings(np.array(nbytes, dtype=np.int64), NOW - np.array(days_unused) * DAY, np.array(pinned, dtype=bool))


def test_the_least_recently_used_unpinned_holdings_go_first_and_the_last_in_part() -> None:
    held = holdings([100, 200, 300, 400], days_unused=[5, 9, 30, 7], pinned=[False, False, True, False])
    plan = plan_evictions(held, 250, NOW, min_age=DAY)
    assert [(e.index, e.nbytes, e.whole) for e in plan] == [(1, 200, True), (3, 50, False)]


def test_a_holding_used_within_the_minimum_age_or_pinned_never_goes() -> None:
    held = holdings([100, 100, 100], days_unused=[0.5, 40, 2], pinned=[False, True, False])
    plan = plan_evictions(held, 1000, NOW, min_age=DAY)
    assert [e.index for e in plan] == [2]


def test_orphans_of_pinned_holdings_go_after_the_unpinned_ones_oldest_holding_first() -> None:
    held = Holdings(
        np.array([100, 400, 300, 200], dtype=np.int64),
        NOW - np.array([9.0, 3, 30, 0.1]) * DAY,
        np.array([False, True, True, True]),
        orphans=np.array([0, 150, 100, 0], dtype=np.int64),
    )
    plan = plan_evictions(held, 300, NOW, min_age=DAY)
    assert [(e.index, e.nbytes, e.whole, e.orphans) for e in plan] == [
        (0, 100, True, False),
        (2, 100, False, True),
        (1, 100, False, True),
    ]
    # Never more than the orphans, however much is asked.
    assert sum(e.nbytes for e in plan_evictions(held, 10_000, NOW, min_age=DAY)) == 100 + 150 + 100


def test_admission_says_what_fits_after_what_it_evicts() -> None:
    held = holdings([100, 200], days_unused=[3, 4], pinned=[False, False])
    admitted = admit(500, 250, held, NOW, min_age=DAY)
    assert admitted.fits == 500 and [e.index for e in admitted.evictions] == [1, 0]
    assert admitted.evictions[-1].nbytes == 50 and not admitted.evictions[-1].whole
    short = admit(1000, 250, held, NOW, min_age=DAY)
    assert short.fits == 550 and short.short == 450
    assert admit(100, 250, held, NOW, min_age=DAY).evictions == ()


@given(
    st.lists(st.tuples(st.integers(0, 10**9), st.floats(0, 60), st.booleans()), max_size=30),
    st.integers(-10, 10**10),
    st.floats(0, 10),
)
def test_a_plan_takes_only_evictable_bytes_and_no_more_than_asked(
    rows: list[tuple[int, float, bool]], room: int, min_age_days: float
) -> None:
    held = holdings([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    plan = plan_evictions(held, room, NOW, min_age_days * DAY)
    taken = sum(e.nbytes for e in plan)
    assert taken <= max(room, 0)
    for e in plan:
        assert not held.pinned[e.index] and NOW - held.last_use[e.index] >= min_age_days * DAY
        assert e.nbytes <= held.nbytes[e.index]
    last_uses = [held.last_use[e.index] for e in plan]
    assert last_uses == sorted(last_uses)
    evictable = int(held.nbytes[~held.pinned & (NOW - held.last_use >= min_age_days * DAY)].sum())
    assert taken == min(max(room, 0), evictable)


def test_a_partial_eviction_takes_the_highest_ids_until_enough() -> None:
    ids = partial_ids(np.array([1, 4, 7, 9]), np.array([10, 10, 10, 10]), 15)
    assert ids.tolist() == [9, 7]


def test_quotas_parse_and_the_one_passed_is_named() -> None:
    quotas = parse_quotas("user:1001=1K, group:77=3K")
    assert quotas == (Quota("user", 1001, 1024, "user:1001=1K"), Quota("group", 77, 3072, "group:77=3K"))
    owners = np.array([1001, 1002, 1001])
    groups = [frozenset({77}), frozenset({77}), frozenset()]
    nbytes = np.array([600, 2000, 300])
    passed = exceeded(quotas, 1001, frozenset({77}), 200, owners, groups, nbytes)
    assert passed == (quotas[0], 900)
    passed = exceeded(quotas, 1002, frozenset({77}), 600, owners, groups, nbytes)
    assert passed == (quotas[1], 2600)
    assert exceeded(quotas, 1002, frozenset({77}), 400, owners, groups, nbytes) is None
    assert exceeded(quotas, 1003, frozenset(), 10**12, owners, groups, nbytes) is None


@pytest.mark.parametrize("text", ["alice=1G", "user:=1G", "host:x=1G", "user:1001", "user:nosuchuser-x=1G"])
def test_a_bad_quota_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="KIND:NAME=SIZE|no user named|expected"):
        parse_quotas(text)


def test_exchanged_samples_past_their_owners_quota_are_refused_and_a_pinned_holding_never_makes_room(
    tmp_path: Path,
) -> None:
    root = make_files_dataset(tmp_path / "pfs", 16, sizes=(4096,), classes=2)
    registry = Registry(tmp_path / "state")
    registry.load()
    entry, _ = registry.add("a", build_manifest(root), replace=False)
    db = entry.record.cache_db
    pins: dict[str, list[str]] = {}

    async def scenario(store: Store) -> None:
        manager = CacheManager(store, registry, tmp_path / "state", 0.0, parse_quotas("user:4242=70K"), lambda: pins)
        await store.open_dataset(db)
        admitted = await manager.admit(entry, np.arange(16), 4242, frozenset({4242}))
        assert admitted.fits == admitted.need and not admitted.evicted
        await store.put_many([PendingWrite(db.encode(), i, encode_value(bytes(4096))) for i in range(16)])
        await store.flush()
        refusal = r"over the user quota user:4242=70K \(cache_quotas\): it has 6.0 KiB"
        with pytest.raises(CacheQuotaError, match=refusal):
            manager.check_arrivals(db, 8192)
        manager.check_arrivals(db, 4096)
        pins[db] = ["job-1"]
        assert await manager.make_room(1 << 20) == 0 and store.dataset_usage(db)[0] == 16
        pins.clear()
        assert await manager.make_room(1 << 20) > 0 and store.dataset_usage(db)[0] == 0
        assert manager.evicted_samples == 16 and manager.evicted_bytes == 16 * 4096

    with_store(tmp_path / "cache", 8 << 20, scenario)


def test_a_bad_quota_in_the_config_file_is_named_with_its_key(tmp_path: Path) -> None:
    path = tmp_path / "dataquay.toml"
    path.write_text('[daemon]\ncache_quotas = "user:0=1G,vision=1T"\nevict_min_age = "7d"\n')
    with pytest.raises(ConfigError, match=r"\[daemon\] cache_quotas = .*'vision=1T' is not KIND:NAME=SIZE"):
        DaemonConfig.from_sources({}, env={}, file=ConfigFile.load(path, "--config"))
    path.write_text('[daemon]\ncache_quotas = "user:0=1G,group:0=1T"\nevict_min_age = "7d"\n')
    config = DaemonConfig.from_sources({}, env={}, file=ConfigFile.load(path, "--config"))
    assert config.evict_min_age == 7 * DAY and len(parse_quotas(config.cache_quotas)) == 2


def test_two_stagings_admitted_at_once_each_get_the_room_they_were_told(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    registry.load()
    size = 64 * 1024
    added = {
        name: registry.add(name, build_manifest(make_files_dataset(tmp_path / name, n, sizes=(size,), seed=i)), False)
        for i, (name, n) in enumerate((("old", 80), ("a", 24), ("b", 24)))
    }
    entries = {name: entry for name, (entry, _) in added.items()}
    running: dict[str, float] = {}

    async def scenario(store: Store) -> None:
        manager = CacheManager(store, registry, tmp_path / "state", 0.0, (), dict, lambda: running)
        old = entries["old"]
        await manager.admit(old, np.arange(80), 0, frozenset())
        await store.open_dataset(old.record.cache_db)
        name = old.record.cache_db.encode()
        await store.put_many([PendingWrite(name, i, encode_value(bytes(size))) for i in range(80)])
        await store.flush()

        async def stage(name: str) -> Admitted:
            admitted = await manager.admit(entries[name], np.arange(24), 0, frozenset())
            running[entries[name].record.cache_db] = 1.0  # as the stager's run, started at once, reports
            return admitted

        first, second = await asyncio.gather(stage("a"), stage("b"))
        assert first.fits == first.need and second.fits == second.need
        running.clear()
        assert manager.free(False) >= first.need + second.need
        assert [e.holding.datasets for e in (*first.evicted, *second.evicted)] == [("old",)]

    with_store(tmp_path / "cache", 8 << 20, scenario)


def test_a_cache_evicted_in_part_and_restaged_round_after_round_holds_every_sample_it_admits(tmp_path: Path) -> None:
    """Four datasets of 32 KiB samples take turns in a cache with room for
    three, beside a pinned one of small samples (whose leaves take more pages
    per byte): each staging evicts part of the least recently used. A partial
    eviction frees the pages it planned, as the evicted tree counts them, and
    free pages scattered by the rounds before never refuse a sample admitted."""
    registry = Registry(tmp_path / "state")
    registry.load()
    rng = np.random.default_rng(7)

    def add(name: str, samples: int, size: int, seed: int) -> Registered:
        root = make_files_dataset(tmp_path / name, samples, sizes=(size,), seed=seed)
        return registry.add(name, build_manifest(root), False)[0]

    async def stage(store: Store, manager: CacheManager, entry: Registered) -> Admitted:
        db, ids, sizes = entry.record.cache_db, np.arange(len(entry.manifest)), entry.manifest.sample_length
        admitted = await manager.admit(entry, ids, 0, frozenset())
        await store.open_dataset(db)
        missing = rng.permutation(ids[~store.cached_mask(db, ids)])
        for start in range(0, len(missing), 8):  # as staging commits: a few at a time, in a shuffled order
            chunk = missing[start : start + 8].tolist()
            await store.put_many([PendingWrite(db.encode(), i, encode_value(bytes(int(sizes[i])))) for i in chunk])
            await store.flush()
        assert store.cached_mask(db, ids).all() and not store.full and store.inserts_dropped == 0
        return admitted

    small = add("small", 4000, 100, 0)
    turns = [add(name, 48, 32 * 1024, seed) for seed, name in enumerate("abcd", start=1)]

    async def scenario(store: Store) -> None:
        manager = CacheManager(store, registry, tmp_path / "state", 0.0)
        await stage(store, manager, small)
        manager.pin("small", True)
        partial = 0
        for turn in range(12):
            trees = {e.record.cache_db: store.tree_bytes(e.record.cache_db) for e in turns}
            admitted = await stage(store, manager, turns[turn % len(turns)])
            assert admitted.fits == admitted.need, f"turn {turn}"
            for evicted in admitted.evicted:
                if not evicted.whole:
                    partial += 1
                    freed = trees[evicted.holding.cache_db] - store.tree_bytes(evicted.holding.cache_db)
                    assert freed >= evicted.nbytes, f"turn {turn}"
        assert partial >= 6

    with_store(tmp_path / "cache", 7 << 20, scenario)
