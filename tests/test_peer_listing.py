"""What a daemon names of its peers in a status, and in its metrics: every
peer that failed, and of the healthy ones only a few (Stats) or none
(metrics), since a node of a job over thousands reads from every other."""

from __future__ import annotations

import time

from dataquay.server.node.peers.reads import PeerHealth, listed_peers


def test_a_status_names_every_troubled_peer_then_the_busiest_healthy_ones() -> None:
    healthy = [PeerHealth(f"n{i:04d}", samples=i) for i in range(4095)]
    failed = PeerHealth("n9998", failures=1)
    corrupt = PeerHealth("n9999", bad_checksums=3)
    suspect = PeerHealth("n0000", suspect_until=time.monotonic() + 60)
    listed = listed_peers([*healthy[1:], failed, corrupt, suspect], 32)
    names = [peer.node for peer in listed]
    assert names == sorted(names) and len(names) == 32
    assert {"n0000", "n9998", "n9999"} <= set(names), "every troubled peer"
    assert set(names) - {"n0000", "n9998", "n9999"} == {f"n{i:04d}" for i in range(4094, 4065, -1)}, "the busiest"
    assert [p.node for p in listed_peers(healthy[:5], 32)] == [p.node for p in healthy[:5]], "a small cluster: all"
    many = [PeerHealth(f"f{i}", failures=1) for i in range(40)]
    assert len(listed_peers([*many, *healthy], 32)) == 40, "never a troubled one left out"
    assert not healthy[3].troubled and failed.troubled and corrupt.troubled and suspect.troubled
