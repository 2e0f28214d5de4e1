"""The planner's loops in Python and numpy, for an install where the C
extension ``_coding`` was not built: the same packets, slower
(bench/experiments/coded_planning.py). The arrays are those of
:mod:`dataquay.server.node.exchange.coding`.
"""

from __future__ import annotations

import itertools

import numpy as np

WORD_BITS = 64
_EVEN_BITS = np.uint64(0x5555555555555555)
#: Tables unpacked into member bits at a time (bounds the planner's memory at large node counts).
_CHUNK = 16384


def greedy(
    keys: np.ndarray,
    table_start: np.ndarray,
    group_decoder: np.ndarray,
    group_count: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    parent: np.ndarray,
    member: np.ndarray,
    child: np.ndarray,
    out: np.ndarray,
) -> None:
    """Moves rows of tables into gaps of their children, and each moved sample's table into ``out``.

    Args:
        keys: each table's member bitset (uint64 rows).
        table_start: each table's first (table, column) group, and one past
            the last; groups are sorted by table, then decoder.
        group_decoder: each group's column (decoder).
        group_count: each group's samples.
        order: the needed samples by (table, decoder); group g is
            ``order[starts[g]:starts[g] + group_count[g]]``.
        starts: each group's first position in ``order``.
        parent, member, child: the DAG's edges (child = parent less member),
            in the order the parents are reduced: by layer from the largest
            tables down, each parent's edges together.
        out: each needed sample's table, Lee et al.'s on entry.
    """
    sizes = _popcount(keys)
    columns = _Columns(group_decoder, group_count, table_start, sizes)
    moves: list[tuple[int, int, int, int]] = []
    bounds = np.flatnonzero(np.diff(parent, prepend=-1, append=-1)).tolist()
    parents, members, kids = parent.tolist(), member.tolist(), child.tolist()
    for lo, hi in itertools.pairwise(bounds):
        moves += _reduce_table(parents[lo], dict(zip(members[lo:hi], kids[lo:hi], strict=True)), columns)
    if not moves:
        return
    num_nodes = keys.shape[1] * WORD_BITS
    group_key = np.repeat(np.arange(len(keys), dtype=np.int64), np.diff(table_start)) * num_nodes + group_decoder
    src, decoder, dst, count = (np.array(column, dtype=np.int64) for column in zip(*moves, strict=True))
    src_group, dst_group = (_find(group_key, t * num_nodes + decoder) for t in (src, dst))
    pools: dict[tuple[int, int], list[int]] = {}
    lists = order.tolist(), starts.tolist(), group_count.tolist()
    for move in zip(
        src.tolist(),
        dst.tolist(),
        decoder.tolist(),
        count.tolist(),
        src_group.tolist(),
        dst_group.tolist(),
        strict=True,
    ):
        taken = _pool(pools, move[0], move[2], move[4], *lists)
        given = _pool(pools, move[1], move[2], move[5], *lists)
        given.extend(taken[len(taken) - move[3] :])
        del taken[len(taken) - move[3] :]
    for (table, _), ids in pools.items():
        out[ids] = table


class _Columns:
    """The column counts of the tables the greedy touches, built on first use
    (from Python lists: the greedy reads a few at a time, where numpy's per-call cost dominates)."""

    def __init__(
        self, group_decoder: np.ndarray, group_count: np.ndarray, table_start: np.ndarray, sizes: np.ndarray
    ) -> None:
        self._decoder, self._count = group_decoder.tolist(), group_count.tolist()
        self._start, self._sizes = table_start.tolist(), sizes.tolist()
        self._tables: dict[int, tuple[int, int, dict[int, int]]] = {}

    def cols(self, table: int) -> dict[int, int]:
        return self.table(table)[2]

    def table(self, table: int) -> tuple[int, int, dict[int, int]]:
        """``table``'s members less one, its rows and its columns. The rows are
        what a child keeps: gap filling never changes them, and a child is
        reduced itself only after its parents (a lower layer)."""
        found = self._tables.get(table)
        if found is None:
            lo, hi = self._start[table], self._start[table + 1]
            cols = dict(zip(self._decoder[lo:hi], self._count[lo:hi], strict=True))
            found = self._tables[table] = (self._sizes[table] - 1, max(cols.values()), cols)
        return found


def _pool(
    pools: dict[tuple[int, int], list[int]],
    table: int,
    decoder: int,
    group: int,
    order: list[int],
    starts: list[int],
    counts: list[int],
) -> list[int]:
    """The needed samples in (table, column) now: its group's at first (none if it had no group)."""
    found = pools.get((table, decoder))
    if found is None:
        found = pools[(table, decoder)] = order[starts[group] : starts[group] + counts[group]] if (group >= 0) else []
    return found


def _reduce_table(table: int, children: dict[int, int], columns: _Columns) -> list[tuple[int, int, int, int]]:
    """Moves whole last rows of ``table`` into the gaps of its ``children``
    (member left out -> child table) while they fit.

    Of the children with a gap in a column, the greedy prefers one whose row
    stays short of full: a row with an empty column is cached whole by that
    column's node, which can send it without a fetch (the module's sender
    rule), and then the one with the widest gap.

    Returns:
        the moves made, each (from table, column, to table, samples).
    """
    cols = columns.cols(table)
    kids = [(member, child, *columns.table(child)) for member, child in children.items()]
    moved: dict[tuple[int, int], int] = {}
    rows = max(cols.values())
    while rows:
        targets = []
        for column in [c for c, n in cols.items() if n == rows]:
            room, best = (False, 0), None
            for member, child, others, child_rows, child_cols in kids:
                if member == column:
                    continue
                held = child_cols.get(column)
                gap = child_rows - (held or 0)
                if gap <= 0 or (room[0] and gap <= room[1]):
                    continue
                # Short of full: some other column of the child holds no more than this one.
                short = len(child_cols) - (held is not None) < others or any(
                    n <= (held or 0) for k, n in child_cols.items() if k != column
                )
                key = (short, gap)
                if key > room:
                    room, best = key, (child, child_cols)
            if best is None:
                rows = 0
                break
            targets.append((column, *best))
        else:
            for column, child, child_cols in targets:
                cols[column] -= 1
                child_cols[column] = child_cols.get(column, 0) + 1
                moved[(column, child)] = moved.get((column, child), 0) + 1
            rows -= 1
    return [(table, column, child, count) for (column, child), count in moved.items()]


def packet_rows(
    tables: np.ndarray, decoders: np.ndarray, sizes: np.ndarray, parts: np.ndarray, start: np.ndarray
) -> int:
    """The packets of the needed samples' tables, one per row: row r of a table
    XORs the r-th sample of each of its columns that has one, its columns'
    samples taken largest first, then by position.

    Args:
        tables, decoders, sizes: each needed sample's table, column and bytes.
        parts: written: the needed samples by (table, row, column), each
            packet's parts together.
        start: written: each packet's first part, then one past the last
            (``len(tables) + 1`` long; the packets fill its head).

    Returns:
        the number of packets.
    """
    order = np.lexsort((-sizes, decoders, tables))
    t, d = tables[order], decoders[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (t[1:] != t[:-1]) | (d[1:] != d[:-1])
    run_start = np.maximum.accumulate(np.where(new, np.arange(len(order)), 0))
    rank = np.arange(len(order), dtype=np.int64) - run_start
    parts[:] = order[np.lexsort((rank, t))]
    t, r = tables[parts], rank[np.lexsort((rank, t))]
    new[1:] = (t[1:] != t[:-1]) | (r[1:] != r[:-1])
    heads = np.flatnonzero(new)
    start[: len(heads)] = heads
    start[len(heads)] = len(parts)
    return len(heads)


def pick_bits(holders: np.ndarray, start: np.ndarray, samples: np.ndarray, spread: np.ndarray, out: np.ndarray) -> None:
    """A node that caches every sample of each group, or -1 where none does.

    Group g is ``samples[start[g]:start[g + 1]]`` (never empty); of the nodes
    that cache all of it, ``out[g]`` is the ``spread[g] % count``-th in
    ascending order, so that a rule that spreads its groups shares the work.
    """
    whole = np.bitwise_and.reduceat(holders[samples], start[:-1], axis=0) if len(out) else holders[:0]
    out[:] = -1
    counts = np.bitwise_count(whole).astype(np.int64)
    has = np.flatnonzero(counts.sum(axis=1))
    if not len(has):
        return
    counts = counts[has]
    rank = spread[has] % counts.sum(axis=1)
    upto = np.cumsum(counts, axis=1)
    word = (upto <= rank[:, None]).sum(axis=1)
    rank -= np.take_along_axis(upto - counts, word[:, None], axis=1)[:, 0]
    out[has] = word * WORD_BITS + _select_bit(whole[has, word], rank)


def _select_bit(words: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The position of the ``rank``-th (from 0) set bit of each uint64, which has more than ``rank``."""
    rank, position = rank.copy(), np.zeros(len(words), dtype=np.int64)
    words = words.copy()
    for width in (32, 16, 8, 4, 2, 1):
        low = words & np.uint64((1 << width) - 1)
        below = np.bitwise_count(low).astype(np.int64)
        high = rank >= below
        rank -= np.where(high, below, 0)
        words = np.where(high, words >> np.uint64(width), low)
        position += np.where(high, width, 0)
    return position


def table_hashes(
    holders: np.ndarray, samples: np.ndarray, decoders: np.ndarray, lookup: np.ndarray, out: np.ndarray
) -> None:
    """The set hash of each sample's table: ``holders[samples[i]]`` with bit
    ``decoders[i]`` set (none where it is negative), hashed as the XOR of
    ``lookup[byte position, byte value]`` over the bitset's bytes."""
    keys = holders[samples].copy()
    given = np.flatnonzero(decoders >= 0)
    keys[given, decoders[given] // WORD_BITS] |= np.left_shift(
        np.uint64(1), (decoders[given] % WORD_BITS).astype(np.uint64)
    )
    as_bytes = keys.view(np.uint8).reshape(len(keys), -1)
    out[:] = 0
    for position in range(as_bytes.shape[1]):
        out ^= lookup[position][as_bytes[:, position]]


def set_numbers(
    holders: np.ndarray, samples: np.ndarray, decoders: np.ndarray, out: np.ndarray, keys: np.ndarray, order: np.ndarray
) -> int:
    """Each sample's table, ``holders[samples[i]]`` with bit ``decoders[i]``
    set, into ``out``: the tables numbered in the order of their bitsets'
    bytes, as numpy's unique orders rows of bytes; their bitsets into the
    head of ``keys`` (as long as ``holders[samples]``); and the samples
    by (table, decoder, position) into ``order``.

    Returns:
        the number of tables.
    """
    rows = holders[samples].copy()
    rows[np.arange(len(rows)), decoders // WORD_BITS] |= np.left_shift(
        np.uint64(1), (decoders % WORD_BITS).astype(np.uint64)
    )
    distinct, out[:] = _unique_rows(rows)
    keys[: len(distinct)] = distinct
    order[:] = np.lexsort((decoders, out))
    return len(distinct)


def _unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct bitset rows and, per row of ``keys``, the index of its distinct row."""
    rows = np.ascontiguousarray(keys).view(np.dtype((np.void, keys.dtype.itemsize * keys.shape[1]))).ravel()
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    return keys[first], inverse.astype(np.int64)


def dag_edges(
    keys: np.ndarray, table_start: np.ndarray, group_decoder: np.ndarray, group_count: np.ndarray
) -> bytearray:
    """Every (parent, member, child) where table child is table parent less
    member, as int64 triples: by layer from the largest tables down to those
    of three members, then by parent, then by member; but those of parents
    that the greedy would not move a row of (:class:`_Initial`).

    Args:
        keys: the tables' member bitsets (uint64 rows), all distinct.
        table_start, group_decoder, group_count: the tables' columns, as
            :func:`greedy` takes them.
    """
    sizes = _popcount(keys)
    node_hashes = np.random.default_rng(0x5EED002).integers(
        1, np.iinfo(np.int64).max, size=keys.shape[1] * WORD_BITS, dtype=np.int64
    )
    hashes = _set_hashes(keys, node_hashes)
    half_hashes = (_set_hashes(keys & _EVEN_BITS, node_hashes), _set_hashes(keys & ~_EVEN_BITS, node_hashes))
    edges: list[tuple[np.ndarray, ...]] = [(np.zeros(0, dtype=np.int64),) * 3]
    for size in range(int(sizes.max(initial=0)), 2, -1):
        lower = np.flatnonzero(sizes == size - 1)
        lower = lower[np.argsort(hashes[lower])]
        edges.append(_children(keys, hashes, lower, _candidates(half_hashes, sizes, size), node_hashes))
    parent, member, child = (np.concatenate(column).astype(np.int64) for column in zip(*edges, strict=True))
    num_nodes = keys.shape[1] * WORD_BITS
    group_table = np.repeat(np.arange(len(keys), dtype=np.int64), np.diff(table_start))
    initial = _Initial(group_table, group_table * num_nodes + group_decoder, group_decoder, group_count, num_nodes)
    kept = initial.may_move(parent, member, child)
    return bytearray(np.stack([parent[kept], member[kept], child[kept]], axis=1).tobytes())


def _members(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The set bits of bitset rows, as ``np.nonzero`` of their unpacked bools
    gives them (by row, then node), found a lowest bit at a time per word:
    tables have a few members of up to thousands of nodes."""
    rows: list[np.ndarray] = []
    nodes: list[np.ndarray] = []
    for word in range(keys.shape[1]):
        at = np.flatnonzero(keys[:, word])
        left = keys[at, word]
        while len(at):
            lowest = left & (~left + np.uint64(1))
            rows.append(at)
            nodes.append(np.frexp(lowest.astype(np.float64))[1].astype(np.int64) - 1 + word * WORD_BITS)
            left ^= lowest
            more = left != 0
            at, left = at[more], left[more]
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    row, node = np.concatenate(rows), np.concatenate(nodes)
    by_row = np.argsort(row, kind="stable")
    return row[by_row], node[by_row]


def _popcount(keys: np.ndarray) -> np.ndarray:
    return np.bitwise_count(keys).sum(axis=1).astype(np.int64)


class _Initial:
    """The tables' columns before the greedy, to rule out in numpy the
    parents whose reduction would move nothing.

    Before a parent is reduced, its columns and its children's only grow
    (rows arrive from the layer above) and rows never change, so a column
    of the parent full at the start stays full and a child's column that
    has no gap at the start never gets one: a parent with a full column
    that no child can take from at the start stops at once in
    :func:`_reduce_table`, and skipping it changes nothing.
    """

    def __init__(
        self,
        group_table: np.ndarray,
        group_key: np.ndarray,
        group_decoder: np.ndarray,
        group_count: np.ndarray,
        num_nodes: int,
    ) -> None:
        self._key, self._decoder, self._count, self._num_nodes = group_key, group_decoder, group_count, num_nodes
        self._rows = np.maximum.reduceat(group_count, np.flatnonzero(np.diff(group_table, prepend=-1)))
        self._full = np.flatnonzero(group_count == self._rows[group_table])
        self._full_table = group_table[self._full]
        per_table = np.bincount(self._full_table, minlength=len(self._rows))
        self._full_count, self._full_start = per_table, np.cumsum(per_table) - per_table

    def may_move(self, parent: np.ndarray, member: np.ndarray, child: np.ndarray) -> np.ndarray:
        """Which (parent, member, child) edges belong to a parent whose every
        full column has a child, other than that column's, with a gap in it."""
        per_edge = self._full_count[parent]
        edge = np.repeat(np.arange(len(parent)), per_edge)
        within = np.arange(len(edge)) - np.repeat(np.cumsum(per_edge) - per_edge, per_edge)
        group = self._full[self._full_start[parent[edge]] + within]
        column = self._decoder[group]
        held = _find(self._key, child[edge] * self._num_nodes + column)
        gap = (column != member[edge]) & (np.where(held >= 0, self._count[held], 0) < self._rows[child[edge]])
        served = np.zeros(len(self._count), dtype=bool)
        served[group[gap]] = True
        stuck = np.zeros(len(self._rows), dtype=bool)
        stuck[self._full_table[~served[self._full]]] = True
        return ~stuck[parent]


def _candidates(half_hashes: tuple[np.ndarray, np.ndarray], sizes: np.ndarray, size: int) -> np.ndarray:
    """Tables of ``size`` members that may have a table one member smaller below them.

    A child lacks one member, so it agrees with its parent on the even bits or
    on the odd bits; a join on the hashes of each half finds every parent with
    a child (and, rarely, a table that has none, which :func:`_children`
    drops) without comparing tables pairwise.
    """
    upper, lower = np.flatnonzero(sizes == size), np.flatnonzero(sizes == size - 1)
    found = np.zeros(len(upper), dtype=bool)
    for hashes in half_hashes:
        found |= np.isin(hashes[upper], hashes[lower])
    return upper[found]


def _set_hashes(keys: np.ndarray, node_hashes: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each bitset row, the XOR of a random value per member:
    a set without member k hashes to its hash XOR k's value."""
    nodes = node_hashes.reshape(-1, 8)
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
    lookup = np.bitwise_xor.reduce(np.where(bits[None, :, :], nodes[:, None, :], 0), axis=2)
    hashes = np.empty(len(keys), dtype=np.int64)
    table_hashes(keys, np.arange(len(keys)), np.full(len(keys), -1), lookup, hashes)
    return hashes


def _children(
    keys: np.ndarray, hashes: np.ndarray, lower: np.ndarray, parents: np.ndarray, node_hash: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Every (parent, member, child) where table child is table parent less member
    (``lower``: the tables one member smaller than the parents, in the order of their hashes).

    The hashes pick the child; only those that match are compared bit for bit."""
    empty = (np.zeros(0, dtype=np.int64),) * 3
    if not len(lower):
        return empty
    sorted_hashes = hashes[lower]
    found: list[tuple[np.ndarray, ...]] = []
    for i in range(0, len(parents), _CHUNK):
        rows, members = _members(keys[parents[i : i + _CHUNK]])
        parent = parents[i : i + _CHUNK][rows]
        wanted = hashes[parent] ^ node_hash[members]
        at = np.minimum(np.searchsorted(sorted_hashes, wanted), len(lower) - 1)
        hit = np.flatnonzero(sorted_hashes[at] == wanted)
        parent, members, child = parent[hit], members[hit], lower[at[hit]]
        expect = keys[parent].copy()
        expect[np.arange(len(parent)), members // WORD_BITS] &= ~np.left_shift(
            np.uint64(1), (members % WORD_BITS).astype(np.uint64)
        )
        exact = (keys[child] == expect).all(axis=1)
        found.append((parent[exact], members[exact].astype(np.int64), child[exact]))
    if not found:
        return empty
    return tuple(np.concatenate(column) for column in zip(*found, strict=True))


def _find(sorted_keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The index of each wanted key in ``sorted_keys``, -1 where absent."""
    at = np.minimum(np.searchsorted(sorted_keys, wanted), len(sorted_keys) - 1)
    return np.where(sorted_keys[at] == wanted, at, -1)
