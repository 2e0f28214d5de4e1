"""Where the samples a node owns but cannot cache go: the spill placement.

The caches of a job together are one cache (CoorDL's (Mohan et al., VLDB 2021) Partitioned MinIO):
a node whose ``--cache-size`` is below its share need not read the rest from
the PFS every epoch while another node's cache has room to spare. Each node
keeps the samples it owns that fit, in a seeded priority order; the rest of
every share (the node's overflow) is held by nodes with room left, filled in
turn in the same order; what fits nowhere is read from the PFS.

Like ownership, this is computed, never looked up: every daemon of the job
gets the same holders from the owners, the sample sizes and the capacities
the directory lists. Only for modes whose owners never move; under
``partial`` a node's share changes every epoch and the exchange decides what
it holds.

Pure functions over numpy arrays; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dataquay.client.placement.orders import SPILL_PRIORITY_KEY, keyed_generator
from dataquay.server.planning.capacity import PAGE_SIZE, cached_bytes, refill_margin

#: Holder of a sample no cache has room for: read from the PFS.
NO_HOLDER = -1


def usable_bytes(capacity: int) -> int:
    """What staging fills of a cache of ``capacity``: it stops this short of
    the map's size (see :class:`dataquay.server.node.cache.space.CacheSpace`)."""
    return capacity - refill_margin(capacity)


def spill_priority(num_samples: int, seed: int) -> np.ndarray:
    """Each sample's place in the order nodes keep and take samples (int64,
    0 first); one order for every epoch, so that what a node holds never changes."""
    priority = np.empty(num_samples, dtype=np.int64)
    priority[keyed_generator(seed, SPILL_PRIORITY_KEY).permutation(num_samples)] = np.arange(num_samples)
    return priority


def _fitting(base: np.ndarray, candidates: np.ndarray, room: int, page_size: int) -> int:
    """How many of ``candidates`` (payload sizes, in order) a cache already
    holding ``base`` takes within ``room`` bytes, as :func:`cached_bytes` counts them."""

    def fits(count: int) -> bool:
        return cached_bytes(np.concatenate([base, candidates[:count]]), page_size) <= room

    if not len(candidates) or not fits(1):
        return 0
    low, high = 1, 2  # low fits; grow high until it does not, then halve the gap
    while high <= len(candidates) and fits(high):
        low, high = high, 2 * high
    high = min(high, len(candidates) + 1)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def spill_holders(
    owners: np.ndarray, payload_sizes: np.ndarray, capacities: Sequence[int], seed: int, page_size: int = PAGE_SIZE
) -> np.ndarray:
    """The node holding each sample (int32; :data:`NO_HOLDER` for none).

    Node m keeps the longest prefix, in :func:`spill_priority` order, of the
    samples it owns whose pages fit in :func:`usable_bytes` of
    ``capacities[m]``. The samples it cannot keep, of all nodes, are dealt in
    that order to the nodes that kept their whole share, each filled to its
    usable bytes before the next (lowest rank first). A capacity of 0 or less
    means not known (the node is not listed at the directory): that node
    keeps its whole share, as without spilling, and takes no one else's.

    Args:
        owners: the node owning each sample (0..M-1).
        payload_sizes: each sample's payload bytes.
        capacities: each node's cache capacity in bytes, in node-rank order (M entries).
        seed: the job's seed, for the priority order.
    """
    owners = np.asarray(owners)
    sizes = np.asarray(payload_sizes, dtype=np.int64)
    priority = spill_priority(len(owners), seed)
    holders = owners.astype(np.int32, copy=True)
    order = np.lexsort((priority, owners))
    bounds = np.searchsorted(owners[order], np.arange(len(capacities) + 1))
    overflow: list[np.ndarray] = []
    takers: list[tuple[int, np.ndarray]] = []
    for node, capacity in enumerate(capacities):
        if capacity <= 0:
            continue
        mine = order[bounds[node] : bounds[node + 1]]
        kept = _fitting(np.empty(0, dtype=np.int64), sizes[mine], usable_bytes(capacity), page_size)
        if kept < len(mine):
            overflow.append(mine[kept:])
        else:
            takers.append((node, mine))
    if not overflow:
        return holders
    spilled = np.concatenate(overflow)
    spilled = spilled[np.argsort(priority[spilled], kind="stable")]
    holders[spilled] = NO_HOLDER
    start = 0
    for node, mine in takers:
        if start == len(spilled):
            break
        taken = _fitting(sizes[mine], sizes[spilled[start:]], usable_bytes(capacities[node]), page_size)
        holders[spilled[start : start + taken]] = node
        start += taken
    return holders
