"""The LRU cache that the cache-policy benchmark (``bench/cache_policy.py``)
holds the daemon's insert-once cache against, and what theory says it hits.

It must be a real LRU, or the comparison says nothing; it lives here, not in
the benchmark script, so that the tests can hold it to that.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import lmdb

#: Room the map gets beyond the capacity (see :class:`LruCache`).
_MAP_SLACK_BYTES = 16 << 20


class LruCache:
    """An LMDB environment capped at ``capacity`` payload bytes that evicts the
    least recently used samples to make room for a new one.

    An index of sample id -> payload size, least recently used first, decides
    what goes; LMDB holds the bytes, so a hit is a real LMDB read and an
    eviction a real delete.
    """

    def __init__(self, path: Path, capacity: int) -> None:
        self.capacity = capacity
        self.used_bytes = 0
        self._index: OrderedDict[int, int] = OrderedDict()
        path.mkdir(parents=True, exist_ok=True)
        # Freed pages are reused only in later transactions, and a large value
        # needs a contiguous run of them: the map gets room beyond the capacity.
        self._env = lmdb.open(str(path), map_size=4 * capacity + _MAP_SLACK_BYTES, sync=False, metasync=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._env.close()

    def keys(self) -> list[int]:
        """The cached sample ids, least recently used first."""
        return list(self._index)

    def get_many(self, ids: Sequence[int]) -> list[bytes | None]:
        """The cached bytes of each id (None for a miss); a hit becomes the most recently used."""
        out: list[bytes | None] = []
        with self._env.begin() as txn:
            for sample_id in ids:
                value = txn.get(_key(sample_id))
                if value is not None:
                    self._index.move_to_end(sample_id)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[int, bytes]]) -> None:
        """Inserts each (id, bytes) in one transaction, evicting least recently
        used samples until it fits; a value larger than the whole cache is not kept."""
        with self._env.begin(write=True) as txn:
            for sample_id, value in items:
                if sample_id in self._index:
                    self._index.move_to_end(sample_id)
                    continue
                size = len(value)
                if size > self.capacity:
                    continue
                while self.used_bytes + size > self.capacity:
                    evicted, evicted_size = self._index.popitem(last=False)
                    txn.delete(_key(evicted))
                    self.used_bytes -= evicted_size
                txn.put(_key(sample_id), value)
                self._index[sample_id] = size
                self.used_bytes += size

    def read_batch(
        self, ids: Sequence[int], read_misses: Callable[[list[int]], list[bytes]]
    ) -> tuple[list[bytes], int]:
        """A batch as a trainer would get it: cached bytes for hits, ``read_misses``
        (the PFS) for the rest, which are then inserted. Returns (bytes in order, hits)."""
        found = self.get_many(ids)
        missing = [sample_id for sample_id, value in zip(ids, found) if value is None]
        fetched = dict(zip(missing, read_misses(missing))) if missing else {}
        self.put_many(list(fetched.items()))
        values = [value if value is not None else fetched[sample_id] for sample_id, value in zip(ids, found)]
        return values, len(ids) - len(missing)


def _key(sample_id: int) -> bytes:
    return sample_id.to_bytes(8, "big")


def expected_lru_hit_fraction(capacity_fraction: float) -> float:
    """LRU's hit fraction after the first epoch under independent uniform permutations.

    A sample read at fraction ``a`` of one epoch and ``b`` of the next is
    separated from its reuse by the rest of the first epoch and the start of
    the next, which together cover ``1 - a·(1 - b)`` of the dataset. It is still
    cached if that is below c: P(u·v > 1 - c) for independent uniform u, v,
    which is c + (1 - c)·ln(1 - c).
    """
    c = capacity_fraction
    return 1.0 if c >= 1 else c + (1 - c) * math.log(1 - c)
