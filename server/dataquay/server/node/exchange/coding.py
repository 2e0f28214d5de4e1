"""Coded shuffling: which XOR packets carry an exchange where caches overlap (UberShuffle, Chung et al., SysML 2018).

A node needs the samples it owns in the new epoch and does not cache. The
uncoded exchange unicasts each of them. Where caches overlap, one packet
``x_a ^ x_b ^ ...`` multicast to the nodes that need its parts serves them all,
provided each of them caches every part but its own. The planner here is pure
(numpy in, numpy out, no I/O) so that every daemon of a job computes the same
packets from the same caches and owners, as placement does.

Schemes (:data:`SCHEMES`), each a rule for grouping the needed samples into
encoding tables; every row of a table is one packet:

- ``none``: one packet per needed sample (a table of one cell).
- ``coded`` (Lee et al.): a sample needed by node j and cached exactly on the
  node set K goes to table S = K + {j}, column j; a table sends as many packets
  as its fullest column holds, so its other columns' gaps are waste.
- ``uber`` (UberShuffle): the tables form a DAG, S -> S - {k}, along which a
  sample may move without breaking decoding (it stays cached on every other
  node of its new table). Layer by layer from the largest tables down, a
  table's last row is moved into gaps of its children's columns whenever all
  of that row fits, which removes a packet and adds none.

Who sends (:func:`plan`): the seed's master holds every sample; a dataquay node
holds only its cache, and in a coded table no node caches every part (each
member lacks its own). The rule: a node that caches all of a packet's parts
sends it; otherwise one of its decoders (the one whose part is smallest, when
sizes are given) sends it after fetching the one part it lacks, its own, by
unicast from a node that caches it, so such a packet costs two
transmissions. A part that no node caches at all (only a one-part
packet can have one) is read from the PFS by its decoder. Hence, against the
seed's count (:attr:`Load.packets`), :attr:`Load.transmissions` counts the
fetches too: coding pays where a row has three parts or more, or where a node
outside the table caches the whole row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

try:
    from dataquay.server._coding import dag_edges, greedy, packet_rows, pick_bits, set_numbers, table_hashes

    #: Whether the planner's loops are the C extension's (else numpy's and Python's, the same packets, slower).
    COMPILED = True
except ImportError:
    from dataquay.server._coding_py import dag_edges, greedy, packet_rows, pick_bits, set_numbers, table_hashes

    COMPILED = False

#: Bits per word of a holder bitset.
WORD_BITS = 64
#: Sender of a packet, or source of a fetch, that is the PFS: no node caches the part.
PFS = -1


def holder_bits(caches: Sequence[np.ndarray], num_samples: int) -> np.ndarray:
    """The bitset of nodes that cache each sample, from each node's cached ids.

    Returns:
        ``(num_samples, words)`` uint64; bit ``m % 64`` of word ``m // 64`` of
        row s is set when node m caches sample s.
    """
    words = max(1, -(-len(caches) // WORD_BITS))
    holders = np.zeros((num_samples, words), dtype=np.uint64)
    for node, ids in enumerate(caches):
        holders[np.asarray(ids, dtype=np.int64), node // WORD_BITS] |= np.uint64(1 << (node % WORD_BITS))
    return holders


def caches_sample(holders: np.ndarray, samples: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Whether each ``nodes[i]`` caches ``samples[i]`` (bool array)."""
    nodes = np.asarray(nodes, dtype=np.int64)
    words = holders[np.asarray(samples, dtype=np.int64), nodes // WORD_BITS]
    return ((words >> (nodes % WORD_BITS).astype(np.uint64)) & np.uint64(1)).astype(bool)


@dataclass(frozen=True)
class Needs:
    """What an exchange must deliver: every sample whose new owner does not cache it.

    Attributes:
        samples: the needed sample ids, ascending (int64).
        decoders: the node that needs each of them, its new owner (int64).
    """

    samples: np.ndarray
    decoders: np.ndarray


def needs(holders: np.ndarray, owners: np.ndarray) -> Needs:
    """The samples the new ``owners`` (one node per sample) lack in their caches."""
    owners = np.asarray(owners, dtype=np.int64)
    missing = ~caches_sample(holders, np.arange(len(owners)), owners)
    samples = np.flatnonzero(missing).astype(np.int64)
    return Needs(samples, owners[samples])


@dataclass(frozen=True)
class Packets:
    """An exchange's packets, their parts in one flat array (CSR-style).

    Packet p XORs the samples ``samples[start[p]:start[p+1]]`` (zero-padded to
    the longest) and is multicast by ``senders[p]`` to the part's decoders
    (``decoders[start[p]:start[p+1]]``); each decoder XORs away the other
    parts, which it caches, and keeps its own. Before sending, a sender that
    lacks a part fetches it: fetch i brings sample ``fetch_samples[i]`` of
    packet ``fetch_packets[i]`` from ``fetch_sources[i]`` (:data:`PFS`: read
    from the PFS) to that packet's sender; the sender is then that part's
    decoder, so the fetch delivers it.

    Attributes:
        start: ``num_packets + 1`` offsets into ``samples`` and ``decoders``.
        samples: each part's sample id.
        decoders: the node that needs each part.
        senders: each packet's sender (:data:`PFS` for a one-part packet that
            no node caches: its decoder reads it from the PFS).
        fetch_packets: the packet of each fetch.
        fetch_samples: the sample each fetch brings.
        fetch_sources: the node each fetch comes from (:data:`PFS` if none
            caches it).
    """

    start: np.ndarray
    samples: np.ndarray
    decoders: np.ndarray
    senders: np.ndarray
    fetch_packets: np.ndarray
    fetch_samples: np.ndarray
    fetch_sources: np.ndarray

    def __len__(self) -> int:
        return len(self.senders)

    @property
    def parts(self) -> np.ndarray:
        """Parts per packet."""
        return np.diff(self.start)

    @property
    def packet_of_part(self) -> np.ndarray:
        """The packet each part belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.parts)


@dataclass(frozen=True)
class Load:
    """What an exchange costs on the wire.

    Attributes:
        packets: packets, each sent once (the seed's count: a sender that
            caches everything, and the PFS's reads counted as packets).
        fetches: parts fetched by a sender that lacks them (peer or PFS).
        transmissions: packets and fetches that cross the network (the PFS
            reads left out): what :func:`plan`'s sender rule costs.
        bytes: bytes of those transmissions: a packet is as long as its
            longest part, a fetch as its sample.
        pfs_bytes: bytes read from the PFS (parts no node caches).
    """

    packets: int
    fetches: int
    transmissions: int
    bytes: int
    pfs_bytes: int


def _table_keys(holders: np.ndarray, need: Needs) -> np.ndarray:
    """Each needed sample's coded table: its holders plus its decoder."""
    keys = holders[need.samples].copy()
    keys[np.arange(len(keys)), need.decoders // WORD_BITS] |= np.left_shift(
        np.uint64(1), (need.decoders % WORD_BITS).astype(np.uint64)
    )
    return keys


def uncoded_tables(holders: np.ndarray, need: Needs, num_nodes: int) -> np.ndarray:
    """``none``: every needed sample is a table, and a packet, of its own."""
    return np.arange(len(need.samples), dtype=np.int64)


def coded_tables(holders: np.ndarray, need: Needs, num_nodes: int) -> np.ndarray:
    """``coded``: Lee et al.'s table of each needed sample, K + {j}.

    The tables are told apart by a hash of their member sets, checked bit for
    bit (a collision falls back to comparing the sets' bytes): at hundreds of
    nodes a set is several words, and sorting 64-bit hashes is what keeps this
    a small part of an epoch. The tables' numbers, hence the packets' order,
    follow the hashes; the packets are Lee et al.'s either way."""
    if not len(need.samples):
        return np.zeros(0, dtype=np.int64)
    hashes = _sample_hashes(holders, need.samples, need.decoders)
    by_hash = np.argsort(hashes)
    ordered = hashes[by_hash]
    new = np.ones(len(ordered), dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    tables = np.empty(len(ordered), dtype=np.int64)
    tables[by_hash] = np.cumsum(new) - 1
    # Neighbours of one hash must be one set: else two sets collided.
    alike = np.flatnonzero(~new[1:])
    sample_of = by_hash[alike], by_hash[alike + 1]
    keys = [_table_keys(holders, Needs(need.samples[at], need.decoders[at])) for at in sample_of]
    if not (keys[0] == keys[1]).all():
        return _set_numbers(holders, need)[0]
    return tables


def _set_numbers(holders: np.ndarray, need: Needs) -> tuple[np.ndarray, ...]:
    """Each needed sample's table, numbered in the order of the tables' member
    bitsets as bytes (:func:`set_numbers`), each table's bitset, and the
    needed samples by (table, decoder)."""
    tables, order = np.empty(len(need.samples), dtype=np.int64), np.empty(len(need.samples), dtype=np.int64)
    keys = np.empty((len(need.samples), holders.shape[1]), dtype=np.uint64)
    count = set_numbers(np.ascontiguousarray(holders), _int64(need.samples), _int64(need.decoders), tables, keys, order)
    return tables, keys[:count], order


def _groups(tables: np.ndarray, decoders: np.ndarray, num_tables: int, order: np.ndarray) -> tuple[np.ndarray, ...]:
    """The runs of each (table, column) in ``order``, the needed samples sorted by (table, decoder)."""
    t, d = tables[order], decoders[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (t[1:] != t[:-1]) | (d[1:] != d[:-1])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, len(order)))
    table_start = np.zeros(num_tables + 1, dtype=np.int64)
    np.cumsum(np.bincount(t[starts], minlength=num_tables), out=table_start[1:])
    return starts, d[starts], counts, table_start


def _sample_hashes(holders: np.ndarray, samples: np.ndarray, decoders: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each table, ``holders[samples]`` with its decoder's bit
    set: the XOR of a random value per member (:func:`table_hashes`)."""
    hashes = np.empty(len(samples), dtype=np.int64)
    table_hashes(
        np.ascontiguousarray(holders), _int64(samples), _int64(decoders), _byte_hashes(holders.shape[1] * 8), hashes
    )
    return hashes


def _node_hashes(num_nodes: int) -> np.ndarray:
    return np.random.default_rng(0x5EED002).integers(1, np.iinfo(np.int64).max, size=num_nodes, dtype=np.int64)


def _byte_hashes(num_bytes: int) -> np.ndarray:
    """``[position, byte value]`` -> the XOR of the member hashes of that byte's bits."""
    nodes = _node_hashes(num_bytes * 8).reshape(num_bytes, 8)
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
    return np.bitwise_xor.reduce(np.where(bits[None, :, :], nodes[:, None, :], 0), axis=2)


def uber_tables(holders: np.ndarray, need: Needs, num_nodes: int) -> np.ndarray:
    """``uber``: Lee et al.'s tables, then rows moved down the DAG into gaps (module docstring).

    The tables are numbered in the order of their bitsets' bytes, which fixes
    the order the greedy reduces the parents of a layer in, hence its moves.
    The DAG's edges (:func:`dag_edges`) and the greedy, a parent at a time
    (each one's choices depend on the gaps the ones before it filled), run in
    the C extension where it was built (:data:`COMPILED`)."""
    if not len(need.samples):
        return np.zeros(0, dtype=np.int64)
    tables, keys, order = _set_numbers(holders, need)
    starts, g_decoder, g_count, table_start = (
        _int64(column) for column in _groups(tables, need.decoders, len(keys), order)
    )
    edges = np.frombuffer(dag_edges(keys, table_start, g_decoder, g_count), dtype=np.int64)
    parent, member, child = (np.ascontiguousarray(column) for column in edges.reshape(-1, 3).T)
    moved = tables.copy()
    greedy(keys, table_start, g_decoder, g_count, order, starts, parent, member, child, moved)
    return moved


#: Encoding-table rules by scheme name: (holders, needs, num_nodes) -> table of each needed sample.
SCHEMES: dict[str, Callable[[np.ndarray, Needs, int], np.ndarray]] = {
    "none": uncoded_tables,
    "coded": coded_tables,
    "uber": uber_tables,
}


def plan(holders: np.ndarray, owners: np.ndarray, scheme: str, sizes: np.ndarray | None = None) -> Packets:
    """The packets of ``scheme`` for moving to ``owners`` from caches ``holders``.

    Args:
        holders: :func:`holder_bits` of the caches before the exchange.
        owners: the new owner of every sample.
        scheme: a key of :data:`SCHEMES`.
        sizes: bytes of each sample, if they differ: each column is sorted
            largest first, so that a row XORs parts of like sizes and its
            padding to the longest wastes little, and a sender that must
            fetch a part fetches the smallest.

    Raises:
        ValueError: an unknown scheme, or holders and owners of different lengths.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, not {scheme!r}")
    owners = np.asarray(owners, dtype=np.int64)
    if len(holders) != len(owners):
        raise ValueError(f"holders has {len(holders)} samples but owners {len(owners)}")
    num_nodes = holders.shape[1] * WORD_BITS
    need = needs(holders, owners)
    tables = SCHEMES[scheme](holders, need, num_nodes)
    part_sizes = np.zeros(len(tables), dtype=np.int64) if sizes is None else _int64(sizes[need.samples])
    parts, start = np.empty(len(tables), dtype=np.int64), np.empty(len(tables) + 1, dtype=np.int64)
    num_packets = packet_rows(_int64(tables), _int64(need.decoders), part_sizes, parts, start)
    samples, decoders = need.samples[parts], need.decoders[parts]
    return _senders(holders, start[: num_packets + 1], samples, decoders, sizes)


def _int64(values: np.ndarray) -> np.ndarray:
    """``values`` as the contiguous int64 array the C loops take, copied only if it is not one."""
    return np.ascontiguousarray(values, dtype=np.int64)


def _pick(holders: np.ndarray, start: np.ndarray, samples: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """:func:`pick_bits`: a node that caches every part of each group, or :data:`PFS`."""
    picked = np.empty(len(start) - 1, dtype=np.int64)
    pick_bits(np.ascontiguousarray(holders), _int64(start), _int64(samples), _int64(spread), picked)
    return picked


def _senders(
    holders: np.ndarray, start: np.ndarray, samples: np.ndarray, decoders: np.ndarray, sizes: np.ndarray | None
) -> Packets:
    """Applies the sender rule of the module docstring to the packets' parts."""
    num_packets = len(start) - 1
    spread = np.arange(num_packets, dtype=np.int64)
    senders = _pick(holders, start, samples, spread)
    parts = np.diff(start)
    lacking = np.flatnonzero((senders == PFS) & (parts > 1))
    if sizes is None:
        first = start[lacking] + spread[lacking] % parts[lacking]
    elif len(lacking):
        # The parts of the lacking packets only: at hundreds of nodes most packets have one part.
        counts = parts[lacking]
        offsets = np.cumsum(counts) - counts
        packet_of = np.repeat(np.arange(len(lacking)), counts)
        positions = np.arange(len(packet_of)) + np.repeat(start[lacking] - offsets, counts)
        part_sizes = sizes[samples[positions]]
        candidates = np.flatnonzero(part_sizes == np.minimum.reduceat(part_sizes, offsets)[packet_of])
        first = positions[candidates[np.searchsorted(packet_of[candidates], np.arange(len(lacking)))]]
    else:
        first = lacking
    senders[lacking] = decoders[first]
    fetch_samples = samples[first]
    fetch_sources = _pick(holders, np.arange(len(first) + 1), fetch_samples, spread[lacking])
    return Packets(start, samples, decoders, senders, lacking.astype(np.int64), fetch_samples, fetch_sources)


def load(packets: Packets, sizes: np.ndarray | None = None) -> Load:
    """What ``packets`` cost; ``sizes`` in bytes per sample id (unit samples when None)."""
    part_bytes = np.ones(len(packets.samples), dtype=np.int64) if sizes is None else sizes[packets.samples]
    packet_bytes = np.maximum.reduceat(part_bytes, packets.start[:-1]) if len(packets) else part_bytes[:0]
    fetch_bytes = (
        np.ones(len(packets.fetch_samples), dtype=np.int64) if sizes is None else (sizes[packets.fetch_samples])
    )
    from_pfs = packets.senders == PFS
    fetched_pfs = packets.fetch_sources == PFS
    return Load(
        packets=len(packets),
        fetches=len(packets.fetch_samples),
        transmissions=int((~from_pfs).sum() + (~fetched_pfs).sum()),
        bytes=int(packet_bytes[~from_pfs].sum() + fetch_bytes[~fetched_pfs].sum()),
        pfs_bytes=int(packet_bytes[from_pfs].sum() + fetch_bytes[fetched_pfs].sum()),
    )
