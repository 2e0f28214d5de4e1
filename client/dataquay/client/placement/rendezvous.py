"""Stable placement: canonical partitions of a dataset onto named nodes.

A dataset is cut into at most :data:`CANONICAL_PARTITIONS` partitions that
depend on the dataset alone, never on the nodes. Each partition ranks the
nodes by a rendezvous (highest random weight) hash of (dataset, partition,
node name) and goes to the first node in its ranking that has room. With room
unlimited this is plain rendezvous hashing: a partition changes holder only
when its holder leaves or a new node outranks it, 1/M of them per change.
Room is the balanced share (every node within one partition of N/M), so a
change also shifts the few partitions that the new shares displace; with many
more partitions than nodes these stay a small fraction of 1/M
(``bench/placement_moves.py``).

The matching is a deferred acceptance: partitions propose to nodes in their
ranking order, and each node keeps its highest-weight proposals that fit.
Where partitions have one size this is the unique stable matching of the
weights; in any case each round is a function of the weights, the sizes and
the node names alone, so every party computes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import xxhash

#: Partitions per dataset (fewer when it has fewer samples or groups). Many
#: more than nodes keeps the shares balanced and the moves near 1/M; 2**16
#: bounds a placement's cost at O(2**16 * M) hashes.
CANONICAL_PARTITIONS = 1 << 16
# Rows of the weight matrix hashed at a time, so that a thousand nodes need
# tens of MB, not a dense partitions-by-nodes matrix.
_CHUNK_CELLS = 1 << 22
# Top choices per partition hashed up front; deeper ones are hashed on demand.
_DEPTH = 16
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_EXHAUSTED = np.uint64(0)


def name_keys(names: Sequence[str]) -> np.ndarray:
    """The 64-bit key of each node name (uint64), the same in every process."""
    return np.array([xxhash.xxh64_intdigest(name.encode()) for name in names], dtype=np.uint64)


def dataset_key(dataset: str) -> int:
    """The 64-bit key of a dataset's partitions: its name, hashed."""
    return xxhash.xxh64_intdigest(b"dataquay-partitions\0" + dataset.encode())


def _mix(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer: a bijection whose every output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51_AFD7_ED55_8CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CE_B9FE_1A85_EC53)
    return x ^ (x >> np.uint64(33))


def partition_keys(key: int, num_partitions: int) -> np.ndarray:
    """The hash key of each partition of the dataset keyed ``key`` (uint64)."""
    return _mix(np.arange(num_partitions, dtype=np.uint64) * _GOLDEN ^ np.uint64(key))


def _weights(parts: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The rendezvous weight of each (partition, node), never 0 (0 marks a ranking used up)."""
    return _mix(parts[:, None] ^ nodes[None, :]) | np.uint64(1)


def _top_choices(keys: np.ndarray, nodes: np.ndarray, below: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Each partition's ``depth`` heaviest nodes of weight under its ``below``, heaviest
    first: (node, weight), each partitions x depth; weight 0 past its last node."""
    rows = max(1, _CHUNK_CELLS // len(nodes))
    choices = np.empty((len(keys), depth), dtype=np.intp)
    weights = np.empty((len(keys), depth), dtype=np.uint64)
    for start in range(0, len(keys), rows):
        block = _weights(keys[start : start + rows], nodes)
        block[block >= below[start : start + rows, None]] = _EXHAUSTED
        top = np.argpartition(block, len(nodes) - depth, axis=1)[:, len(nodes) - depth :]
        heavy = np.take_along_axis(block, top, axis=1)
        order = np.argsort(heavy, axis=1)[:, ::-1]
        choices[start : start + rows] = np.take_along_axis(top, order, axis=1)
        weights[start : start + rows] = np.take_along_axis(heavy, order, axis=1)
    return choices, weights


def _first_choices(keys: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each partition's heaviest node: (node, weight)."""
    rows = max(1, _CHUNK_CELLS // len(nodes))
    choice = np.empty(len(keys), dtype=np.intp)
    weight = np.empty(len(keys), dtype=np.uint64)
    for start in range(0, len(keys), rows):
        block = _weights(keys[start : start + rows], nodes)
        choice[start : start + rows] = block.argmax(axis=1)
        weight[start : start + rows] = np.take_along_axis(block, choice[start : start + rows, None], axis=1)[:, 0]
    return choice, weight


class _Matching:
    """The deferred acceptance in progress: who holds each partition, and each node's fill.

    Partitions propose in rounds, each to its heaviest node not yet asked;
    each asked node keeps its heaviest proposals while they fit in its room
    (a prefix of its holdings by weight, whatever the order proposals came
    in), and the let go propose again. A partition skips, within its round,
    every node that would surely let it go (full, and holding only heavier
    partitions): the outcome is the same, and the last partitions, which
    would bounce between full nodes for a round per node, settle in a few.
    """

    def __init__(self, keys: np.ndarray, nodes: np.ndarray, sizes: np.ndarray, room: int) -> None:
        self.keys, self.nodes, self.sizes, self.room = keys, nodes, sizes, room
        self.depth = min(_DEPTH, len(nodes))
        # Each row starts with the first choice alone, in its last column: most
        # partitions never need a second, and an argmax costs a fraction of a sort.
        self.choices = np.zeros((len(keys), self.depth), dtype=np.intp)
        self.weights = np.zeros((len(keys), self.depth), dtype=np.uint64)
        self.choices[:, -1], self.weights[:, -1] = _first_choices(keys, nodes)
        self.asked = np.full(len(keys), self.depth - 1, dtype=np.intp)  # choices of its row each used
        self.holder = np.full(len(keys), -1, dtype=np.intp)
        self.weight = np.zeros(len(keys), dtype=np.uint64)
        empty = sizes == 0
        self.holder[empty] = 0  # an empty partition holds nothing anywhere; node 0 names it
        self.weight[empty] = np.iinfo(np.uint64).max
        self.loads = np.zeros(len(nodes), dtype=np.int64)
        self.lightest = np.full(len(nodes), np.iinfo(np.uint64).max, dtype=np.uint64)

    def round(self, parts: np.ndarray) -> np.ndarray:
        """``parts`` propose; returns what the nodes they asked let go."""
        parts = self._propose(parts)
        let_go = self._let_go(np.unique(self.holder[parts]))
        self.holder[let_go] = -1
        return let_go

    def _propose(self, parts: np.ndarray) -> np.ndarray:
        """Moves each of ``parts`` to its next node that may keep it; returns those that found one."""
        placed = []
        while len(parts):
            used = self.asked[parts] == self.depth
            if used.any():
                self._refill(parts[used])
            at = self.asked[parts]
            node, weight = self.choices[parts, at], self.weights[parts, at]
            self.asked[parts] += 1
            live = weight != _EXHAUSTED
            parts, node, weight = parts[live], node[live], weight[live]
            sure_no = (weight < self.lightest[node]) & (self.loads[node] + self.sizes[parts] > self.room)
            ask = parts[~sure_no]
            self.holder[ask], self.weight[ask] = node[~sure_no], weight[~sure_no]
            placed.append(ask)
            parts = parts[sure_no]
        return np.concatenate(placed) if placed else parts

    def _refill(self, parts: np.ndarray) -> None:
        """The next choices of partitions that used their row: those lighter than the last."""
        last = self.weights[parts, self.depth - 1]
        self.choices[parts], self.weights[parts] = _top_choices(self.keys[parts], self.nodes, last, self.depth)
        self.asked[parts] = 0

    def _let_go(self, asked: np.ndarray) -> np.ndarray:
        """What the ``asked`` nodes let go, updating their loads and lightest holdings."""
        mask = np.zeros(len(self.nodes) + 1, dtype=bool)  # the last entry answers for holder -1
        mask[asked] = True
        held = np.flatnonzero(mask[self.holder])
        if not len(held):
            return held
        held = held[np.lexsort((~self.weight[held], self.holder[held]))]  # by node, heaviest first
        filled = np.cumsum(self.sizes[held])
        node_of = self.holder[held]
        starts = np.flatnonzero(np.r_[True, node_of[1:] != node_of[:-1]])
        offsets = np.repeat((filled - self.sizes[held])[starts], np.diff(np.r_[starts, len(held)]))
        over = filled - offsets > self.room
        kept = held[~over]
        self.loads[asked] = 0
        np.add.at(self.loads, self.holder[kept], self.sizes[kept])
        self.lightest[asked] = np.iinfo(np.uint64).max
        np.minimum.at(self.lightest, self.holder[kept], self.weight[kept])
        return held[over]


def _deferred_acceptance(keys: np.ndarray, sizes: np.ndarray, nodes: np.ndarray, room: int) -> np.ndarray:
    """Holder of each partition, or -1 where every node refused it."""
    matching = _Matching(keys, nodes, sizes, room)
    free = np.flatnonzero(sizes > 0)
    while len(free):
        free = matching.round(free)
    return matching.holder


def _place_refused(holder: np.ndarray, sizes: np.ndarray, nodes: np.ndarray) -> None:
    """Partitions every node refused (their room used by others, a rare tail)
    go to the least loaded node, largest first; ties go by partition id and
    node key, never by the order the nodes are listed in."""
    refused = np.flatnonzero(holder < 0)
    loads = np.bincount(holder[holder >= 0], weights=sizes[holder >= 0], minlength=len(nodes))
    for part in refused[np.argsort(-sizes[refused], kind="stable")].tolist():
        node = int(np.lexsort((nodes, loads))[0])
        holder[part] = node
        loads[node] += sizes[part]


@lru_cache(maxsize=16)
def _placed(key: int, sizes_bytes: bytes, names: tuple[str, ...]) -> np.ndarray:
    sizes = np.frombuffer(sizes_bytes, dtype=np.int64)
    room = -(-int(sizes.sum()) // len(names))
    nodes = name_keys(names)
    holder = _deferred_acceptance(partition_keys(key, len(sizes)), sizes, nodes, room)
    _place_refused(holder, sizes, nodes)
    placed = holder.astype(np.int32)
    placed.flags.writeable = False
    return placed


def place(key: int, sizes: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """The node (an index into ``names``) holding each partition (int32, read-only).

    Args:
        key: the dataset's key (:func:`dataset_key`).
        sizes: the samples in each partition; a node's share is at most
            ceil(sum / M) samples, beyond which it refuses partitions.
        names: the nodes, by name; only the names matter, not their order.

    Raises:
        ValueError: no nodes, or a node named twice.
    """
    names = tuple(names)
    if not names:
        raise ValueError("a placement needs at least one node")
    if len(set(names)) != len(names):
        raise ValueError(f"node names must differ: {sorted({n for n in names if names.count(n) > 1})} repeat")
    return _placed(int(key), np.ascontiguousarray(sizes, dtype=np.int64).tobytes(), names)
