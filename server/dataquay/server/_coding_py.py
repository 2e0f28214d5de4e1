"""The planner's loops in Python and numpy, for an install where the C
extension ``_coding`` was not built: the same packets, slower
(bench/coded_planning.py). The arrays are those of
:mod:`dataquay.server.node.exchange.coding`.
"""

from __future__ import annotations

import numpy as np

WORD_BITS = 64


def greedy(keys: np.ndarray, table_start: np.ndarray, group_decoder: np.ndarray, group_count: np.ndarray,
           order: np.ndarray, starts: np.ndarray, parent: np.ndarray, member: np.ndarray, child: np.ndarray,
           out: np.ndarray) -> None:
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
    sizes = np.bitwise_count(keys).sum(axis=1).astype(np.int64)
    columns = _Columns(group_decoder, group_count, table_start, sizes)
    moves: list[tuple[int, int, int, int]] = []
    bounds = np.flatnonzero(np.diff(parent, prepend=-1, append=-1)).tolist()
    parents, members, kids = parent.tolist(), member.tolist(), child.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        moves += _reduce_table(parents[lo], dict(zip(members[lo:hi], kids[lo:hi], strict=True)), columns)
    if not moves:
        return
    num_nodes = keys.shape[1] * WORD_BITS
    group_key = np.repeat(np.arange(len(keys), dtype=np.int64), np.diff(table_start)) * num_nodes + group_decoder
    src, decoder, dst, count = (np.array(column, dtype=np.int64) for column in zip(*moves, strict=True))
    src_group, dst_group = (_find(group_key, t * num_nodes + decoder) for t in (src, dst))
    pools: dict[tuple[int, int], list[int]] = {}
    lists = order.tolist(), starts.tolist(), group_count.tolist()
    for move in zip(src.tolist(), dst.tolist(), decoder.tolist(), count.tolist(), src_group.tolist(),
                    dst_group.tolist(), strict=True):
        taken = _pool(pools, move[0], move[2], move[4], *lists)
        given = _pool(pools, move[1], move[2], move[5], *lists)
        given.extend(taken[len(taken) - move[3]:])
        del taken[len(taken) - move[3]:]
    for (table, _), ids in pools.items():
        out[ids] = table


def _find(sorted_keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The index of each wanted key in ``sorted_keys``, -1 where absent."""
    at = np.minimum(np.searchsorted(sorted_keys, wanted), len(sorted_keys) - 1)
    return np.where(sorted_keys[at] == wanted, at, -1)


class _Columns:
    """The column counts of the tables the greedy touches, built on first use
    (from Python lists: the greedy reads a few at a time, where numpy's per-call cost dominates)."""

    def __init__(self, group_decoder: np.ndarray, group_count: np.ndarray, table_start: np.ndarray,
                 sizes: np.ndarray) -> None:
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


def _pool(pools: dict[tuple[int, int], list[int]], table: int, decoder: int, group: int, order: list[int],
          starts: list[int], counts: list[int]) -> list[int]:
    """The needed samples in (table, column) now: its group's at first (none if it had no group)."""
    found = pools.get((table, decoder))
    if found is None:
        found = pools[(table, decoder)] = order[starts[group]:starts[group] + counts[group]] if (
            group >= 0) else []
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
                    n <= (held or 0) for k, n in child_cols.items() if k != column)
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


def packet_rows(tables: np.ndarray, decoders: np.ndarray, sizes: np.ndarray, order: np.ndarray, parts: np.ndarray,
                start: np.ndarray) -> int:
    """The packets of the needed samples' tables, one per row: row r of a table
    XORs the r-th sample of each of its columns that has one.

    Args:
        tables, decoders, sizes: each needed sample's table, column and bytes.
        order: written: the needed samples by (table, column, largest first, id).
        parts: written: the needed samples by (table, row, column), each
            packet's parts together.
        start: written: each packet's first part, then one past the last
            (``len(tables) + 1`` long; the packets fill its head).

    Returns:
        the number of packets.
    """
    order[:] = np.lexsort((-sizes, decoders, tables))
    t, d = tables[order], decoders[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (t[1:] != t[:-1]) | (d[1:] != d[:-1])
    run_start = np.maximum.accumulate(np.where(new, np.arange(len(order)), 0))
    rank = np.arange(len(order), dtype=np.int64) - run_start
    parts[:] = order[np.lexsort((rank, t))]
    t, r = tables[parts], rank[np.lexsort((rank, t))]
    new[1:] = (t[1:] != t[:-1]) | (r[1:] != r[:-1])
    heads = np.flatnonzero(new)
    start[:len(heads)] = heads
    start[len(heads)] = len(parts)
    return len(heads)


def pick_bits(holders: np.ndarray, start: np.ndarray, samples: np.ndarray, spread: np.ndarray,
              out: np.ndarray) -> None:
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


def table_hashes(holders: np.ndarray, samples: np.ndarray, decoders: np.ndarray, lookup: np.ndarray,
                 out: np.ndarray) -> None:
    """The set hash of each sample's table: ``holders[samples[i]]`` with bit
    ``decoders[i]`` set (none where it is negative), hashed as the XOR of
    ``lookup[byte position, byte value]`` over the bitset's bytes."""
    keys = holders[samples].copy()
    given = np.flatnonzero(decoders >= 0)
    keys[given, decoders[given] // WORD_BITS] |= np.left_shift(np.uint64(1), (decoders[given] % WORD_BITS).astype(
        np.uint64))
    as_bytes = keys.view(np.uint8).reshape(len(keys), -1)
    out[:] = 0
    for position in range(as_bytes.shape[1]):
        out ^= lookup[position][as_bytes[:, position]]
