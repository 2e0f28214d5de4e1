"""A flood of connections on the bulk port: one host that opens hundreds of
silent connections holds only a few of the listener's slots, peers keep
reading over the bulk path, and the daemon's log gets a few lines, not one
per connection. Real directory and daemon processes on loopback."""

from __future__ import annotations

import ast
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import wait_until
from test_bulk import SIZE, N, bulk_address, read_all, staged, stats

from dataquay.protos import cache_pb2 as pb
from dataquay.server.auth import new_token_file
from dataquay.server.node.peers.bulk.refusals import RefusalLog
from dataquay.server.node.peers.bulk.server import MAX_HANDSHAKES_PER_HOST
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

#: Silent connections the attacker opens: more than the listener's 256 slots.
FLOOD = 300
#: Another address of the loopback range, so the attacker is a host other than the peers'.
ATTACKER = "127.0.0.2"


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two daemons that require a token, the dataset staged on both, no bulk read made yet."""
    base = tmp_path_factory.mktemp("flood")
    root = make_files_dataset(base / "pfs", N, sizes=(SIZE,))
    with LocalCluster(
        base / "cluster",
        2,
        (),
        ("--lease-seconds", "3", "--heartbeat-seconds", "0.5"),
        token_file=new_token_file(base / "token"),
        dataset_roots=(base,),
    ) as local:
        staged(local, root)
        yield local


def test_silent_connections_from_one_host_leave_the_bulk_path_to_the_peers(cluster: LocalCluster) -> None:
    host, _, port = bulk_address(cluster, 1).rpartition(":")
    silent = []
    for _ in range(FLOOD):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((ATTACKER, 0))
        sock.connect((host, int(port)))
        silent.append(sock)
    try:
        # Those past the host's share are closed at once; the rest sit in their handshake.
        wait_until(lambda: stats(cluster, 1).bulk.refused_connections >= FLOOD - 256, "the overflow refused")
        samples, after = read_all(cluster, 0)  # node 0's first reads of node 1's share
        assert [s.data for s in samples] == [sample_bytes(0, i, SIZE) for i in range(N)]
        peer = [s for s in samples if s.tier == pb.TIER_PEER]
        assert 0 < len(peer) < N and pb.TIER_PFS not in {s.tier for s in samples}
        assert after.bulk.fallbacks == 0
        assert after.bulk.fetched_samples == len(peer) and after.bulk.fetched_bytes == len(peer) * SIZE
        assert stats(cluster, 1).bulk.served_samples == len(peer)
    finally:
        for sock in silent:
            sock.close()
    # The ones in their handshake time out and are refused too; every one is counted, in a few lines.
    wait_until(lambda: stats(cluster, 1).bulk.refused_connections == FLOOD, "every silent connection refused", 30)
    log = cluster.daemons[1].log_path
    wait_until(lambda: sum(logged_refusals(log).values()) == FLOOD, "every refusal in the log", 30)
    held = MAX_HANDSHAKES_PER_HOST
    assert logged_refusals(log) == {"host_full": FLOOD - held, "handshake": held}
    lines = [line for line in log.read_text().splitlines() if "bulk connection" in line]
    assert 2 <= len(lines) <= 3, lines
    assert f"peer={ATTACKER}:" in lines[0]


def logged_refusals(log: Path) -> Counter[str]:
    """Refusals by reason as the daemon's log tells them: one line each, or a summary line of counts."""
    counts: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        if "closed a bulk connection" in line and (reason := re.search(r" reason=(\w+)", line)):
            counts[reason[1]] += 1
        elif "closed bulk connections" in line and (summary := re.search(r" refused=(\{[^}]*\})", line)):
            counts.update(ast.literal_eval(summary[1]))
    return counts


def test_refusals_are_logged_once_then_summed_up_by_reason(caplog: pytest.LogCaptureFixture) -> None:
    refusals = RefusalLog(seconds=0.2)
    with caplog.at_level("WARNING", logger="dataquay.bulk"):
        assert refusals.refused("handshake", "10.0.0.9:1", "the client does not hold the node token") is None
        delay = refusals.refused("request", "10.0.0.9:2", "bad magic")
        assert delay is not None and 0 < delay <= 0.2
        for i in range(1000):
            assert refusals.refused("handshake" if i % 2 else "request", "10.0.0.9:3", "x") is None
        assert len(caplog.records) == 1
        time.sleep(delay)
        refusals.flush()
        refusals.flush()
    assert [r.getMessage() for r in caplog.records] == ["closed a bulk connection", "closed bulk connections"]
    summary = caplog.records[1].fields  # type: ignore[attr-defined]
    assert summary["refused"] == {"request": 501, "handshake": 500} and summary["refused_so_far"] == 1002
    assert refusals.total == 1002
