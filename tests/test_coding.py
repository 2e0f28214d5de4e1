"""The coded-shuffling planner: the seed's toy example, and decoding from packets plus a cache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataquay.server.node.exchange import coding
from dataquay.server.node.exchange.coded_packets import xor_decode, xor_encode
from dataquay.server.node.exchange.coding import (
    PFS,
    SCHEMES,
    Load,
    Packets,
    caches_sample,
    holder_bits,
    load,
    needs,
    plan,
    uber_tables,
)

# UberShuffle's toy example, its ids shifted to start at 0 (nodes 1..3 -> 0..2, samples 1..9 -> 0..8).
TOY_CACHES = [{2, 3, 4, 8}, {6, 7, 8, 9}, {1, 3, 4, 5}]
TOY_NEEDS = [{3, 5, 8}, {1, 4, 9}, {2, 6, 7}]


#: The planner's loops: the C extension's and Python's.
GREEDIES = [pytest.param("_coding", id="c"), pytest.param("_coding_py", id="python")]
LOOPS = ("greedy", "packet_rows", "pick_bits", "table_hashes", "set_numbers", "dag_edges")


@contextmanager
def greedy_of(module: str) -> Iterator[None]:
    """Plans with the loops (UberShuffle's greedy and the others) of ``dataquay.server.<module>`` meanwhile."""
    loops = pytest.importorskip(f"dataquay.server.{module}", reason="installed without a C compiler")
    saved = {name: getattr(coding, name) for name in LOOPS}
    for name in LOOPS:
        setattr(coding, name, getattr(loops, name))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(coding, name, function)


def toy() -> tuple[np.ndarray, np.ndarray]:
    holders = holder_bits([np.array(sorted(c)) - 1 for c in TOY_CACHES], 9)
    owners = np.zeros(9, dtype=np.int64)
    for node, ids in enumerate(TOY_NEEDS):
        owners[np.array(sorted(ids)) - 1] = node
    return holders, owners


def packet_sets(packets: Packets) -> list[tuple[frozenset[int], frozenset[int]]]:
    """Each packet as (its samples, its decoders), in the seed's numbering, in an order
    that does not depend on the packets' (sets compare as subsets, so they are sorted as lists)."""
    return canonical(
        [
            (frozenset((packets.samples[lo:hi] + 1).tolist()), frozenset((packets.decoders[lo:hi] + 1).tolist()))
            for lo, hi in zip(packets.start[:-1].tolist(), packets.start[1:].tolist(), strict=True)
        ]
    )


def canonical(sets: list[tuple[frozenset[int], frozenset[int]]]) -> list[tuple[frozenset[int], frozenset[int]]]:
    return sorted(sets, key=lambda pair: (sorted(pair[0]), sorted(pair[1])))


def test_the_toy_example_takes_6_uncoded_4_coded_and_3_ubershuffle_transmissions() -> None:
    holders, owners = toy()
    assert [len(plan(holders, owners, scheme)) for scheme in ("none", "coded", "uber")] == [6, 4, 3]


def test_the_toy_tables_are_the_seeds() -> None:
    holders, owners = toy()
    f = frozenset
    # Table {1,3}: d2 + d5; table {2,3}: d1 + d6 and d7; table {1,2,3}: d4 alone, which UberShuffle
    # moves into the gap of table {2,3}'s first column.
    assert packet_sets(plan(holders, owners, "coded")) == canonical(
        [(f({2, 5}), f({1, 3})), (f({1, 6}), f({2, 3})), (f({7}), f({3})), (f({4}), f({2}))]
    )
    assert packet_sets(plan(holders, owners, "uber")) == canonical(
        [(f({2, 5}), f({1, 3})), (f({1, 6}), f({2, 3})), (f({4, 7}), f({2, 3}))]
    )


def test_with_no_node_holding_all_data_a_pair_costs_a_fetch_and_saves_nothing() -> None:
    holders, owners = toy()
    uncoded, uber = load(plan(holders, owners, "none")), load(plan(holders, owners, "uber"))
    assert (uncoded.packets, uncoded.transmissions, uncoded.bytes) == (6, 6, 6)
    assert (uber.packets, uber.fetches, uber.transmissions, uber.bytes) == (3, 3, 6, 6)


def test_a_node_that_caches_every_part_sends_the_packet_alone() -> None:
    # Node 0 needs sample 0 (cached on 1, 2), node 1 needs sample 1 (on 0, 2), node 2 needs sample 2
    # (on 0, 1): one table {0, 1, 2}, one row of three parts; node 3 caches all three.
    holders = holder_bits([np.array([1, 2]), np.array([0, 2]), np.array([0, 1]), np.array([0, 1, 2])], 3)
    packets = plan(holders, np.array([0, 1, 2]), "coded")
    assert len(packets) == 1 and packets.senders.tolist() == [3]
    assert load(packets) == Load(packets=1, fetches=0, transmissions=1, bytes=1, pfs_bytes=0)
    without = holder_bits([np.array([1, 2]), np.array([0, 2]), np.array([0, 1])], 3)
    lacking = plan(without, np.array([0, 1, 2]), "coded")
    assert lacking.senders[0] in (0, 1, 2) and load(lacking).transmissions == 2
    assert load(plan(without, np.array([0, 1, 2]), "none")).transmissions == 3


def test_a_sender_that_must_fetch_its_own_part_is_the_decoder_of_the_smallest() -> None:
    holders = holder_bits([np.array([1, 2]), np.array([0, 2]), np.array([0, 1])], 3)
    sizes = np.array([5, 1, 7])
    packets = plan(holders, np.array([0, 1, 2]), "coded", sizes)
    assert packets.senders.tolist() == [1]
    assert packets.fetch_samples.tolist() == [1] and packets.fetch_sources[0] in (0, 2)
    assert load(packets, sizes) == Load(packets=1, fetches=1, transmissions=2, bytes=7 + 1, pfs_bytes=0)


def test_a_sample_no_cache_holds_is_read_from_the_pfs_and_not_sent() -> None:
    holders = holder_bits([np.array([0, 1]), np.array([], dtype=np.int64)], 3)
    packets = plan(holders, np.array([1, 1, 0]), "uber")
    sent = {int(s): int(p) for s, p in zip(packets.samples, packets.senders, strict=True)}
    assert sent == {0: 0, 1: 0, 2: PFS}
    assert load(packets, np.array([10, 20, 30])) == Load(3, 0, 2, 30, 30)


def test_parts_of_like_sizes_share_a_packet() -> None:
    # Node 0 needs samples 0 and 1 (cached on 1, 2), node 1 needs 2 and 3 (cached on 0, 2): one table
    # {0, 1, 2} of two rows, sent by node 2, which caches all four.
    holders = holder_bits([np.array([2, 3]), np.array([0, 1]), np.arange(4)], 4)
    owners, sizes = np.array([0, 0, 1, 1]), np.array([10, 1, 1, 10])
    packets = plan(holders, owners, "coded", sizes)
    both = frozenset({1, 2})
    assert packet_sets(packets) == canonical([(frozenset({1, 4}), both), (frozenset({2, 3}), both)])
    assert load(packets, sizes).bytes == 10 + 1
    assert load(plan(holders, owners, "coded"), sizes).bytes == 10 + 10


def test_an_unknown_scheme_is_named() -> None:
    holders, owners = toy()
    with pytest.raises(ValueError, match="scheme must be one of none, coded, uber, not 'xor'"):
        plan(holders, owners, "xor")


def assert_decodable(holders: np.ndarray, owners: np.ndarray, packets: Packets, data: list[bytes]) -> None:
    """Every node gets exactly the samples it needs, byte for byte, from the packets sent to it, the
    fetches that reach it and its own cache, and nothing else is sent."""
    need = needs(holders, owners)
    delivered = sorted(zip(packets.samples.tolist(), packets.decoders.tolist(), strict=True))
    assert delivered == sorted(zip(need.samples.tolist(), need.decoders.tolist(), strict=True))
    fetched = dict(zip(packets.fetch_packets.tolist(), packets.fetch_samples.tolist(), strict=True))
    for p, (lo, hi) in enumerate(zip(packets.start[:-1].tolist(), packets.start[1:].tolist(), strict=True)):
        ids, decoders, sender = packets.samples[lo:hi], packets.decoders[lo:hi], int(packets.senders[p])
        if sender == PFS:
            assert hi - lo == 1 and not holders[ids[0]].any()
            continue
        held = caches_sample(holders, ids, np.full(len(ids), sender))
        assert held.all() or (p in fetched and ids[~held].tolist() == [fetched[p]])
        packet = xor_encode([data[i] for i in ids.tolist()])
        for k, (sample, decoder) in enumerate(zip(ids.tolist(), decoders.tolist(), strict=True)):
            others = np.delete(ids, k)
            assert caches_sample(holders, others, np.full(len(others), decoder)).all()
            assert xor_decode(packet, [data[i] for i in others.tolist()], len(data[sample])) == data[sample]
    for p, sample, source in zip(
        packets.fetch_packets.tolist(), packets.fetch_samples.tolist(), packets.fetch_sources.tolist(), strict=True
    ):
        assert source == PFS or caches_sample(holders, np.array([sample]), np.array([source]))[0]
        assert sample in packets.samples[packets.start[p] : packets.start[p + 1]]


@st.composite
def shuffles(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    num_nodes = draw(st.integers(2, 7))
    num_samples = draw(st.integers(1, 60))
    cached = draw(
        st.lists(
            st.lists(st.booleans(), min_size=num_samples, max_size=num_samples), min_size=num_nodes, max_size=num_nodes
        )
    )
    owners = np.array(draw(st.lists(st.integers(0, num_nodes - 1), min_size=num_samples, max_size=num_samples)))
    data = draw(st.lists(st.binary(min_size=0, max_size=12), min_size=num_samples, max_size=num_samples))
    return holder_bits([np.flatnonzero(row) for row in cached], num_samples), owners, data


@pytest.mark.parametrize("module", GREEDIES)
@settings(max_examples=150, deadline=None)
@given(shuffles())
def test_every_scheme_delivers_exactly_what_each_node_lacks_and_uber_sends_fewest(
    module: str, shuffle: tuple[np.ndarray, np.ndarray, list[bytes]]
) -> None:
    holders, owners, data = shuffle
    counts = []
    sizes = np.array([len(d) for d in data], dtype=np.int64)
    with greedy_of(module):
        for scheme in SCHEMES:
            packets = plan(holders, owners, scheme, sizes)
            assert_decodable(holders, owners, packets, data)
            counts.append(len(packets))
    assert counts[0] >= counts[1] >= counts[2]


def overlapping(rng: np.random.Generator, num_nodes: int, num_samples: int, extra: int) -> tuple[np.ndarray, ...]:
    """Caches of each node's old samples and ``extra`` more at random, and new owners."""
    owners = rng.integers(0, num_nodes, num_samples)
    caches = [
        np.union1d(np.flatnonzero(owners == m), rng.choice(num_samples, extra, replace=False)) for m in range(num_nodes)
    ]
    return holder_bits(caches, num_samples), rng.permutation(owners)


def same_packets(a: Packets, b: Packets) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


def clustered(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """130 nodes, of which nodes 0-9 all cache most samples: tables of a dozen members and more,
    many alike in their first members."""
    holders, owners = overlapping(rng, 130, 8000, 40)
    holders[:6000, 0] |= np.uint64(0x3FF)
    return holders, owners


def crowded() -> tuple[np.ndarray, ...]:
    """One table {0, 1, 2, 3} of two columns of 100 samples each."""
    owners = np.arange(200) % 2
    return holder_bits([np.flatnonzero(owners != m) for m in range(4)], 200), owners


def test_the_c_loops_plan_every_packet_and_sender_as_the_python_ones_do() -> None:
    rng = np.random.default_rng(16)
    small = [
        overlapping(rng, int(rng.integers(3, 8)), int(rng.integers(5, 80)), int(rng.integers(0, 5))) for _ in range(300)
    ]
    wide = overlapping(rng, 64, 20000, 1000)
    for holders, owners in [toy(), *small, wide, clustered(rng), crowded()]:
        need, num_nodes = needs(holders, owners), holders.shape[1] * 64
        sizes = rng.integers(1, 4, len(owners))  # few sizes: ties in a column
        with greedy_of("_coding"):
            compiled = uber_tables(holders, need, num_nodes)
            plans = [plan(holders, owners, scheme, given) for scheme in SCHEMES for given in (None, sizes)]
        with greedy_of("_coding_py"):
            assert np.array_equal(compiled, uber_tables(holders, need, num_nodes))
            again = [plan(holders, owners, scheme, given) for scheme in SCHEMES for given in (None, sizes)]
        assert all(same_packets(a, b) for a, b in zip(plans, again, strict=True))
    with greedy_of("_coding"):  # the 64-node plan moves rows: a test of the moves, not only of Lee's tables
        assert len(plan(*wide, "uber")) < len(plan(*wide, "coded"))


@pytest.mark.parametrize("module", GREEDIES)
def test_more_nodes_than_a_bitset_word_decode_too_and_plan_alike_every_time(module: str) -> None:
    rng = np.random.default_rng(3)
    num_nodes, num_samples = 130, 3000
    owners = rng.permutation(np.arange(num_samples) % num_nodes)
    caches = [
        np.union1d(np.flatnonzero(owners == m), rng.choice(num_samples, 90, replace=False)) for m in range(num_nodes)
    ]
    holders = holder_bits(caches, num_samples)
    new_owners = rng.permutation(owners)
    data = [rng.bytes(int(n)) for n in rng.integers(1, 9, num_samples)]
    with greedy_of(module):
        for scheme in SCHEMES:
            packets = plan(holders, new_owners, scheme)
            assert_decodable(holders, new_owners, packets, data)
            # Every daemon plans for itself: the same caches and owners must give the same packets.
            assert same_packets(packets, plan(holders.copy(), new_owners.copy(), scheme))


def test_the_c_greedy_names_arrays_that_contradict_each_other() -> None:
    loops = pytest.importorskip("dataquay.server._coding", reason="installed without a C compiler")
    keys = np.array([[0b111], [0b011]], dtype=np.uint64)
    # Table 0 = {0, 1, 2} holds one sample for node 2, table 1 = {0, 1} one for node 0; 1 = 0 less 2.
    arrays = [
        np.array([0, 1, 2]),
        np.array([2, 0]),
        np.array([1, 1]),
        np.array([0, 1]),
        np.array([0, 1]),
        np.array([0]),
        np.array([2]),
        np.array([1]),
        np.array([0, 1]),
    ]
    loops.greedy(keys, *arrays)
    with pytest.raises(ValueError, match="parent or child is not a table"):
        loops.greedy(keys, *arrays[:7], np.array([7]), arrays[8])
    with pytest.raises(ValueError, match="decoder is not a member"):
        loops.greedy(keys, arrays[0], np.array([5, 0]), *arrays[2:])
    with pytest.raises(ValueError, match="outside order"):
        loops.greedy(keys, *arrays[:4], np.array([0, 9]), *arrays[5:])
    with pytest.raises(ValueError, match="64-bit integers"):
        loops.greedy(keys, *arrays[:-1], np.zeros(2, dtype=np.int32))
    three = [np.zeros(3, dtype=np.int64) for _ in range(4)]
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        loops.packet_rows(*three, np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="outside holders"):
        loops.pick_bits(keys, np.array([0, 1]), np.array([2]), np.array([0]), np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="decoder outside its bitset"):
        loops.table_hashes(keys, np.array([0]), np.array([64]), np.zeros((8, 256), np.int64), np.zeros(1, np.int64))
