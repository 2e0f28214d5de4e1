"""Which sample ids the cache holds, per dataset: a bit per id, in memory.

The cache is asked which of a window of ids it holds all the time: by the
stager, by the prefetch's scan of each new epoch, by both ends of the
exchange. Answered from LMDB, every id is a tree search that releases and
takes back the GIL, which the bulk path's threads are waiting for; answered
here it is a few numpy operations over the whole window.

Only the store's writer changes the bits, once the transaction that changed
the keys has committed, so a set bit always names a committed key. They are
built from the keys when the cache opens.
"""

from __future__ import annotations

import numpy as np

_NONE = np.zeros(0, dtype=np.uint8)
#: Set bits of each byte value.
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def ids_of_keys(keys: bytes) -> np.ndarray:
    """The sample ids of concatenated LMDB sample keys (8 bytes, big-endian each)."""
    return np.frombuffer(keys, dtype=">u8").astype(np.int64)


class CachedIds:
    """A bit set of sample ids per dataset's sub-database, by its name.

    Written by one thread, read by any: a reader that races a write sees the
    set as it was before the write or after it.
    """

    def __init__(self) -> None:
        self._bits: dict[bytes, np.ndarray] = {}

    def reset(self, name: bytes, ids: np.ndarray) -> None:
        """Makes ``ids`` all that the dataset holds."""
        held = np.zeros(int(ids.max()) + 1 if len(ids) else 0, dtype=bool)
        held[ids] = True
        self._bits[name] = np.packbits(held, bitorder="little")

    def add(self, name: bytes, ids: np.ndarray) -> None:
        if not len(ids):
            return
        bits = self._bits.get(name, _NONE)
        need = (int(ids.max()) >> 3) + 1
        if need > len(bits):  # a grown copy, published whole: readers of the old set see it as it was
            bits = np.concatenate((bits, np.zeros(max(need, 2 * len(bits)) - len(bits), dtype=np.uint8)))
        np.bitwise_or.at(bits, ids >> 3, _bit_of(ids))
        self._bits[name] = bits

    def remove(self, name: bytes, ids: np.ndarray) -> None:
        bits = self._bits.get(name)
        if bits is None:
            return
        ids = ids[ids < 8 * len(bits)]
        np.bitwise_and.at(bits, ids >> 3, ~_bit_of(ids))

    def drop(self, name: bytes) -> None:
        self._bits.pop(name, None)

    def ids(self, name: bytes) -> np.ndarray:
        """The ids the dataset holds, sorted."""
        bits = self._bits.get(name)
        if bits is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(np.unpackbits(bits, bitorder="little")).astype(np.int64)

    def count(self, name: bytes) -> int:
        """How many ids the dataset holds: a metrics scrape's question, in a byte per 8 ids."""
        bits = self._bits.get(name)
        return 0 if bits is None else int(_POPCOUNT[bits].sum(dtype=np.int64))

    def mask(self, name: bytes, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` the dataset holds."""
        bits = self._bits.get(name)
        ids = np.asarray(ids, dtype=np.int64)
        if bits is None or not len(bits):
            return np.zeros(len(ids), dtype=bool)
        byte = ids >> 3
        inside = (byte < len(bits)) & (ids >= 0)
        return inside & ((np.take(bits, byte, mode="clip") & _bit_of(ids)) != 0)


def _bit_of(ids: np.ndarray) -> np.ndarray:
    return np.left_shift(1, ids & 7).astype(np.uint8)
