"""How much cache a node needs: what its samples take in LMDB, and the exchange's headroom.

A cache's capacity is the LMDB map size, so the question "does a node's share
fit?" is about LMDB pages, not payload bytes. The store writes one value per
sample (an 8-byte checksum, then the payload) under an 8-byte key. LMDB 0.9
then takes, per value:

- a leaf node of 8 header bytes, the key and the value, 2-byte aligned, plus a
  2-byte slot; a node larger than half a page's room (2038 bytes at 4 KiB, so
  payloads above 2014 bytes) puts its value on overflow pages of its own,
  ceil((value + 16) / page) of them, and keeps only its page number in the leaf;
- leaves that split in halves when full: under random inserts (staging in the
  first epoch's order, the exchange's arrivals) a leaf holds on average ln 2 of
  the nodes it could, and branch pages (18 bytes per child) likewise;
- while a write transaction commits, copies of every leaf and branch page it
  touches, and the pages the previous one freed: the map's high-water mark
  (what hits the capacity) stays above the tree (what ``status`` reports as
  used) by about two transactions' worth of those pages, which for small
  values is tens of MiB.

Pure functions over numpy arrays; no I/O.
"""

from __future__ import annotations

import math

import numpy as np

from dataquay.client.placement import MODES, JobPlan, owners
from dataquay.client.wire.records import CHECKSUM_BYTES
from dataquay.server.node.cache.write_queue import BATCH_BYTES, BATCH_ITEMS

MiB = 1 << 20
#: LMDB's page size on the machines dataquay runs on (the OS page).
PAGE_SIZE = 4096
#: The exchange's headroom on top of a node's share when owners move:
#: what arrives for the next epoch before what leaves is deleted, and the
#: writer's pages while both churn.
EXCHANGE_HEADROOM_FRACTION = 0.05
EXCHANGE_HEADROOM_BYTES = 16 * MiB
#: See :func:`refill_margin`.
REFILL_BYTES = 256 * 1024
#: How far below :func:`stored_bytes` a staging run counts the pages of what it reads.
CHARGE_MARGIN = 0.03
#: Epochs that ``stage --job`` looks ahead for a node's largest share.
LOOKAHEAD_EPOCHS = 8

_KEY_BYTES = 8
_PAGE_HEADER = 16
_NODE_HEADER = 8
_SLOT = 2
_PGNO = 8
#: Nodes per leaf under random inserts, as a fraction of what a leaf holds.
_RANDOM_FILL = math.log(2)
#: Leaves that hold only 2 or 3 nodes split into fixed halves, so their average
#: (measured with LMDB 0.9) is not ln 2 of the most.
_SMALL_LEAF_NODES = {2: 1.5, 3: 2.0}


def _node_max(page_size: int) -> int:
    """LMDB's ``me_nodemax``: the largest leaf node that keeps its value inline."""
    return ((page_size - _PAGE_HEADER) // 2 & ~1) - _SLOT


def _nodes_per_page(capacity: np.ndarray) -> np.ndarray:
    """Average nodes per page under random inserts, for pages that hold at most ``capacity``."""
    average = capacity * _RANDOM_FILL
    for most, nodes in _SMALL_LEAF_NODES.items():
        average = np.where(capacity == most, nodes, average)
    return average


def _tree_pages(payload_sizes: np.ndarray, page_size: int) -> tuple[float, float, float]:
    """(overflow, leaf, branch) pages of a sub-database holding values of these payload sizes."""
    values = np.asarray(payload_sizes, dtype=np.int64) + CHECKSUM_BYTES
    room = page_size - _PAGE_HEADER
    inline = _NODE_HEADER + _KEY_BYTES + values <= _node_max(page_size)
    overflow = float(np.where(inline, 0, (values + _PAGE_HEADER - 1) // page_size + 1).sum())
    node = np.where(inline, _NODE_HEADER + _KEY_BYTES + values, _NODE_HEADER + _KEY_BYTES + _PGNO) + _SLOT
    node += node & 1
    leaves = float((1.0 / _nodes_per_page(room // node)).sum())
    per_branch = float(_nodes_per_page(np.array(room // (_NODE_HEADER + _KEY_BYTES + _SLOT)))[()])
    branches, level = 0.0, leaves
    while level > 1:
        level = math.ceil(level / per_branch)
        branches += level
    return overflow, math.ceil(leaves), branches


def value_bytes(value_sizes: np.ndarray, page_size: int = PAGE_SIZE) -> np.ndarray:
    """Bytes of pages each value (checksum included) takes, at most: its overflow
    pages and leaf node, or its node in a leaf half full. What a write is charged
    against the room left, before LMDB says what it took."""
    values = np.asarray(value_sizes, dtype=np.int64)
    inline = _NODE_HEADER + _KEY_BYTES + values <= _node_max(page_size)
    overflow = ((values + _PAGE_HEADER - 1) // page_size + 1) * page_size + _NODE_HEADER + _KEY_BYTES + _PGNO
    return np.where(inline, 2 * (_NODE_HEADER + _KEY_BYTES + values + _SLOT), overflow)


def stored_bytes(payload_sizes: np.ndarray, page_size: int = PAGE_SIZE) -> int:
    """Bytes of LMDB pages (branch, leaf and overflow) that values of these
    payload sizes take in one sub-database, written in random order as the store
    writes them. Within a few percent of LMDB's own page counts."""
    if not len(payload_sizes):
        return 0
    return int(sum(_tree_pages(payload_sizes, page_size))) * page_size


def write_slack_bytes(payload_sizes: np.ndarray, page_size: int = PAGE_SIZE) -> int:
    """Bytes the map's high-water mark stays above :func:`stored_bytes` of the
    same values: the leaf and branch pages the last two write transactions copied.

    LMDB copies every page a transaction touches, and reuses the pages the
    copies replaced only two transactions later. A transaction of k random
    inserts into a tree of L leaves touches L(1 - exp(-k/L)) of them and, in
    practice, every branch; it takes the store's largest batch (``BATCH_ITEMS``
    values or ``BATCH_BYTES``), so this estimates from above.
    """
    count = len(payload_sizes)
    if not count:
        return 0
    _, leaves, branches = _tree_pages(payload_sizes, page_size)
    mean_value = float(np.mean(payload_sizes)) + CHECKSUM_BYTES
    batch = max(1, min(BATCH_ITEMS, int(BATCH_BYTES // mean_value)))
    last = count - (count - 1) // batch * batch
    touched = 0.0
    for before, inserted in ((count - last, last), (count - last - batch, batch)):
        if before > 0:
            tree = leaves * before / count
            touched += tree * -math.expm1(-inserted / tree) + branches * before / count
    return math.ceil(touched) * page_size


def cached_bytes(payload_sizes: np.ndarray, page_size: int = PAGE_SIZE) -> int:
    """The map a cache holding these values fills: the tree and the writer's slack."""
    return stored_bytes(payload_sizes, page_size) + write_slack_bytes(payload_sizes, page_size)


def refill_margin(capacity: int) -> int:
    """How far below a full map its live bytes must fall before inserting
    resumes, and so how short of its capacity staging stops: REFILL_BYTES, or
    a 16th of a smaller cache, so that one freed page does not mean one more try."""
    return min(REFILL_BYTES, capacity // 16)


def exchange_reserve(capacity: int) -> int:
    """Bytes of a cache that staging and reads leave free for the exchange's
    arrivals when owners move: a 16th of the cache, EXCHANGE_HEADROOM_BYTES at most."""
    return min(EXCHANGE_HEADROOM_BYTES, capacity // 16)


def short_of_share(capacity: int, owned_lengths: np.ndarray) -> bool:
    """Whether a cache of ``capacity`` bytes (0: unbounded), less the
    exchange's reserve, cannot hold samples of ``owned_lengths``: a node's
    share of an epoch whose owners move. Such a cache takes in a sample only
    once its sender's ranks have read it, and keeps no read that the exchange
    would pass on."""
    return bool(capacity) and stored_bytes(owned_lengths) > capacity - exchange_reserve(capacity)


def exchange_staging_limit(capacity: int) -> int:
    """Bytes of pages a cache fills before inserts that leave room for the
    exchange stop: its capacity less the exchange's reserve and the refill
    margin. What a short cache holds when owners move, for the daemon and for
    the simulator alike."""
    return capacity - exchange_reserve(capacity) - refill_margin(capacity)


def within_room(ids: np.ndarray, position: np.ndarray, charges: np.ndarray, room: int) -> np.ndarray:
    """The first of ``ids`` by ``position`` whose ``charges`` add up to no
    more than ``room`` (``charges`` is indexed by sample id), and the one
    after them: what a staging run reads, so that it reads from the PFS few
    samples it will find no room for, and the cache finds the one it has no
    room for (it says full from then on, as status shows). None of them
    when there is no room at all: the cache is full already."""
    if room <= 0:
        return ids[:0]
    order = ids[np.argsort(position[ids], kind="stable")]
    fits = int(np.searchsorted(np.cumsum(charges[order]), room, side="right"))
    return np.sort(order[: fits + 1])


def staging_charges(sample_length: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per sample id, the cache bytes it takes as staging of ``ids`` counts
    them: its value's share of the pages :func:`stored_bytes` counts for them
    all, less :data:`CHARGE_MARGIN`, so that a run reads no less than fits
    (the count is within a few percent of LMDB's) and stops where the cache
    says full."""
    values = sample_length + CHECKSUM_BYTES
    pages_per_byte = stored_bytes(sample_length[ids]) / int(values[ids].sum())
    return values * (pages_per_byte * (1 - CHARGE_MARGIN))


def cache_need(share_bytes: int, mode: str, q: float) -> int:
    """The capacity a node needs to keep its share of ``share_bytes`` (as
    :func:`cached_bytes` counts them) cached in every epoch.

    The share itself for modes whose owners never move; with ``partial`` and
    q > 0, 1.05 x the share + 16 MiB: the exchange brings the next epoch's
    samples while the node still holds the ones it gives away.

    Raises:
        KeyError: an unknown mode.
    """
    if MODES[mode].owners_move and q > 0:
        return math.ceil(share_bytes * (1 + EXCHANGE_HEADROOM_FRACTION)) + EXCHANGE_HEADROOM_BYTES
    return share_bytes


def node_shares(
    plan: JobPlan, payload_sizes: np.ndarray, epochs: int = LOOKAHEAD_EPOCHS, page_size: int = PAGE_SIZE
) -> np.ndarray:
    """Each node's share in :func:`cached_bytes`, epoch by epoch (int64, epochs x nodes).

    Nodes keep their sample counts in every mode, but not their bytes when
    samples differ in size and owners move: ``partial`` has a row for each of
    epochs 0..epochs-1, other modes one row (their owners never change).
    """
    rows = epochs if MODES[plan.settings.mode].owners_move else 1
    shares = np.zeros((rows, plan.num_nodes), dtype=np.int64)
    current = owners(plan, 0)
    for epoch in range(rows):
        if epoch:
            current = owners(plan, epoch, current)
        order = np.argsort(current, kind="stable")
        bounds = np.searchsorted(current[order], np.arange(plan.num_nodes + 1))
        for node in range(plan.num_nodes):
            shares[epoch, node] = cached_bytes(payload_sizes[order[bounds[node] : bounds[node + 1]]], page_size)
    return shares
