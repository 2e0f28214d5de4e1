"""The LRU baseline of the cache-policy benchmark: it must be a real LRU, or
the comparison with the daemon's insert-once cache says nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataquay.server.tools.lru_baseline import LruCache, expected_lru_hit_fraction


def _value(sample_id: int, size: int) -> bytes:
    return bytes([sample_id]) * size


def test_lru_evicts_least_recently_used_and_stays_within_capacity(tmp_path: Path) -> None:
    with LruCache(tmp_path / "lru", capacity=30) as cache:
        cache.put_many([(1, _value(1, 10)), (2, _value(2, 10)), (3, _value(3, 10))])
        assert cache.keys() == [1, 2, 3]
        assert cache.used_bytes == 30

        assert cache.get_many([1]) == [_value(1, 10)]  # 1 becomes the most recently used
        cache.put_many([(4, _value(4, 10))])
        assert cache.keys() == [3, 1, 4]
        assert cache.get_many([2]) == [None]

        cache.put_many([(5, _value(5, 20))])  # needs two slots: 3, then 1 go
        assert cache.keys() == [4, 5]
        assert cache.used_bytes == 30
        assert cache.get_many([1, 3, 4, 5]) == [None, None, _value(4, 10), _value(5, 20)]
        assert cache.keys() == [4, 5]

        cache.put_many([(6, _value(6, 31))])  # larger than the cache: not kept, nothing evicted
        assert cache.keys() == [4, 5]
        assert cache.used_bytes == 30


def test_lru_read_batch_reads_only_misses_and_inserts_them(tmp_path: Path) -> None:
    asked: list[list[int]] = []

    def read_misses(ids: list[int]) -> list[bytes]:
        asked.append(ids)
        return [_value(i, 8) for i in ids]

    with LruCache(tmp_path / "lru", capacity=24) as cache:
        values, hits = cache.read_batch([7, 8], read_misses)
        assert (values, hits) == ([_value(7, 8), _value(8, 8)], 0)

        values, hits = cache.read_batch([8, 9, 7], read_misses)
        assert (values, hits) == ([_value(8, 8), _value(9, 8), _value(7, 8)], 2)
        assert asked == [[7, 8], [9]]
        assert cache.keys() == [8, 7, 9]  # the batch's hits were touched before its miss went in

        cache.read_batch([10], read_misses)
        assert cache.keys() == [7, 9, 10]
        assert cache.used_bytes <= cache.capacity


def test_scan_of_twice_the_capacity_leaves_only_the_last_capacity_worth(tmp_path: Path) -> None:
    with LruCache(tmp_path / "lru", capacity=4 * 16) as cache:
        for sample_id in range(8):
            cache.put_many([(sample_id, _value(sample_id, 16))])
            assert cache.used_bytes <= cache.capacity
        assert cache.keys() == [4, 5, 6, 7]
        assert cache.get_many(list(range(8))) == [None] * 4 + [_value(i, 16) for i in range(4, 8)]


def test_expected_lru_hit_fraction() -> None:
    assert expected_lru_hit_fraction(0.5) == pytest.approx(0.1534, abs=1e-4)
    assert expected_lru_hit_fraction(1.0) == 1.0
    assert expected_lru_hit_fraction(0.0) == 0.0
