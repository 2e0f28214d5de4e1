"""What each node sends and receives in a coded exchange: one transmission per sample it lacks."""

from __future__ import annotations

import numpy as np

from dataquay.server.node.exchange import coded_packets
from dataquay.server.node.exchange.coding import SCHEMES, holder_bits, load, needs, plan
from dataquay.server.tools.coded_traffic import CodedExchanges, node_traffic
from dataquay.server.tools.spare_copies import balanced_owners


def test_every_node_receives_one_transmission_per_sample_it_lacks_and_senders_send_them_all() -> None:
    rng = np.random.default_rng(5)
    num_nodes, num_samples = 9, 2000
    # Each node holds its share of an earlier epoch, so no sample is left to the PFS.
    before = balanced_owners(num_samples, num_nodes, rng)
    caches = [np.union1d(np.flatnonzero(before == m), rng.choice(num_samples, 300)) for m in range(num_nodes)]
    holders = holder_bits(caches, num_samples)
    owners = balanced_owners(num_samples, num_nodes, rng)
    lacking = np.bincount(needs(holders, owners).decoders, minlength=num_nodes)
    for scheme in SCHEMES:
        packets = plan(holders, owners, scheme)
        sent, received = node_traffic(packets, num_nodes)
        assert received.tolist() == lacking.tolist()
        assert sent.sum() == load(packets).transmissions


def test_exchanges_keep_each_share_and_spares_up_to_the_capacity() -> None:
    rng = np.random.default_rng(6)
    owners = balanced_owners(400, 4, rng)
    exchanges = CodedExchanges(owners, 4, 150, "uber", seed=1)
    assert [len(c) for c in exchanges.caches] == [100] * 4
    for _ in range(3):
        owners = balanced_owners(400, 4, rng)
        epoch = exchanges.exchange(owners)
        assert epoch.coded.packets <= epoch.uncoded.packets
        for node, cache in enumerate(exchanges.caches):
            assert len(cache) == 150 and np.isin(np.flatnonzero(owners == node), cache).all()


def test_each_set_of_receivers_gets_an_address_of_its_own_while_the_pool_has_room() -> None:
    rng = np.random.default_rng(7)
    num_nodes, num_samples = 8, 2000
    before = balanced_owners(num_samples, num_nodes, rng)
    caches = [np.union1d(np.flatnonzero(before == m), rng.choice(num_samples, 500)) for m in range(num_nodes)]
    sent = coded_packets.streams(
        plan(holder_bits(caches, num_samples), balanced_owners(num_samples, num_nodes, rng), "uber")
    )
    sets = len(set(sent.members))
    for pool, foreign_at_most in ((256, 0), (16, None)):
        slots = coded_packets.slots(sent, pool)
        assert slots.min() >= 1 and slots.max() < pool  # address 0 is the snapshots'
        joined: dict[int, frozenset[int]] = {}
        for members, slot in zip(sent.members, slots.tolist(), strict=True):
            joined[slot] = joined.get(slot, frozenset()) | members
        foreign = sum(len(joined[slot] - members) for members, slot in zip(sent.members, slots.tolist(), strict=True))
        if foreign_at_most is not None:
            assert len(joined) == sets and foreign == foreign_at_most
        else:
            # Too few addresses: shared, but fewer stray deliveries than one address for all.
            assert len(joined) == pool - 1
            assert foreign < sum(num_nodes - len(m) for m in sent.members) / 2
