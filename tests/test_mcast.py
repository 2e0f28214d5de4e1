"""The coded exchange's multicast transport: its reliability state, and whole exchanges in a network namespace.

The namespace (its own loopback with a multicast route, and for the loss
test an nftables rule that drops datagrams at random) keeps the host's
network untouched; the tests skip where one cannot be made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from dataquay.server.node.exchange import mcast_seal
from dataquay.server.node.exchange import mcast_wire as wire
from dataquay.server.node.exchange.coding_payoff import NodeBytes, node_bytes, payoff
from dataquay.server.node.exchange.mcast import MAX_DATAGRAM, Channel, MulticastEndpoint, _Protocol, payload_bytes
from dataquay.server.tools import coded_wire

PORT = 47016
#: Multicast addresses the exchanges here spread their groups over.
POOL = 16


def test_a_receiver_reports_the_gaps_below_what_it_saw_and_below_the_tail() -> None:
    log = wire.ReceiveLog(session=7)
    for seq in (0, 1, 3, 6):
        assert log.on_data(seq)
    assert not log.on_data(3)
    assert (log.cumulative, log.gaps()) == (2, (2, 4, 5))
    log.on_tail(9)
    assert log.gaps() == (2, 4, 5, 7, 8)
    for seq in (2, 4, 5, 7, 8):
        log.on_data(seq)
    assert (log.cumulative, log.gaps(), log.behind) == (9, (), False)


def test_a_sender_keeps_each_datagram_until_every_member_acknowledged_it() -> None:
    window = wire.SendWindow(frozenset({1, 2}))
    for _ in range(4):
        seq = window.reserve()
        window.keep(seq, b"d%d" % seq)
    assert window.on_ack(wire.Ack(1, 0, 5, 0, 4, ())) == []
    assert sorted(window.kept) == [0, 1, 2, 3] and window.lagging() == [2]
    assert window.on_ack(wire.Ack(2, 0, 5, 0, 1, (1, 3))) == [1, 3]
    assert sorted(window.kept) == [1, 2, 3]
    assert window.on_ack(wire.Ack(9, 0, 5, 0, 4, ())) == []
    window.on_ack(wire.Ack(2, 0, 5, 0, 4, ()))
    assert window.kept == {} and window.done


def test_datagrams_round_trip_and_malformed_ones_are_refused() -> None:
    fragment = wire.Fragment(3, 11, 2, 40, 9, 1, 3, 2900, 0xABC, b"x" * 100)
    assert wire.decode(wire.encode_data(fragment)) == fragment
    ack = wire.Ack(1, 3, 11, 2, 40, (41, 45))
    assert wire.decode(wire.encode_ack(ack)) == ack
    assert wire.decode(wire.encode_tail(wire.Tail(3, 11, 2, 44))) == wire.Tail(3, 11, 2, 44)
    assert len(wire.encode_data(fragment)) == wire.DATA_HEADER_BYTES + 100
    for bad in (
        b"",
        b"XX\x01\x01" + bytes(60),
        wire.encode_data(fragment)[:30],
        wire.encode_ack(ack)[:-3],
        wire.encode_data(wire.Fragment(3, 11, 2, 40, 9, 3, 3, 2900, 0, b"")),
    ):
        with pytest.raises(wire.WireError):
            wire.decode(bad)
    assert list(wire.fragments(b"abcdefg", 3)) == [(0, 3, b"abc"), (1, 3, b"def"), (2, 3, b"g")]
    assert list(wire.fragments(b"", 3)) == [(0, 1, b"")]


def test_a_datagram_fills_the_mtu_less_the_headers_and_never_passes_udps_limit() -> None:
    sealed = 2 + 1 + 8 + 12 + 16  # magic, version, pass id, nonce; GCM's tag
    assert payload_bytes(9000) == 9000 - 28 - wire.DATA_HEADER_BYTES - sealed
    assert payload_bytes(1500) == 1500 - 28 - wire.DATA_HEADER_BYTES - sealed
    assert payload_bytes(65536) == 65535 - 28 - wire.DATA_HEADER_BYTES - sealed


def test_a_datagram_opens_only_in_its_own_pass_under_the_token_it_was_sealed_with() -> None:
    message = wire.encode_tail(wire.Tail(3, 11, 2, 44))
    sealed = mcast_seal.PassSeal("t0k3n", 1 << 60).seal(message)
    assert message not in sealed and len(sealed) == len(message) + mcast_seal.OVERHEAD_BYTES
    assert mcast_seal.PassSeal("t0k3n", 1 << 60).open(sealed) == message
    assert sealed != mcast_seal.PassSeal("t0k3n", 1 << 60).seal(message)  # a fresh nonce each time
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for seal, datagram, reason in (
        (mcast_seal.PassSeal("t0k3n", (1 << 60) + 1), sealed, "unknown_pass"),
        (mcast_seal.PassSeal("other", 1 << 60), sealed, "unauthenticated"),
        (mcast_seal.PassSeal("t0k3n", 1 << 60), tampered, "unauthenticated"),
        (mcast_seal.PassSeal("t0k3n", 1 << 60), sealed[:20], "malformed"),
        (mcast_seal.PassSeal("t0k3n", 1 << 60), b"XX" + sealed[2:], "malformed"),
    ):
        with pytest.raises(mcast_seal.SealError) as refused:
            seal.open(datagram)
        assert refused.value.reason == reason


def test_an_endpoint_counts_what_it_drops_and_ignores_its_processes_other_passes() -> None:
    dropped: list[str] = []
    endpoint = MulticastEndpoint(
        0, Channel("239.255.0.1", PORT), "t0k3n", pass_id=5, others={5, 6}, on_drop=dropped.append
    )
    endpoint.expect(1, 0)
    here, other, earlier = (mcast_seal.PassSeal("t0k3n", p) for p in (5, 6, 4))

    def fragment(session: int, seq: int) -> bytes:
        return wire.encode_data(wire.Fragment(1, session, 0, seq, 7, 0, 1, 3, xxhash.xxh3_64_intdigest(b"abc"), b"abc"))

    sender, replayer = ("127.0.0.1", 9), ("127.0.0.1", 666)
    endpoint._on_datagram(here.seal(fragment(100, 0)), sender)
    endpoint._on_datagram(here.seal(fragment(100, 0)), replayer)
    for datagram in (
        other.seal(fragment(100, 1)),
        earlier.seal(fragment(100, 1)),
        here.seal(fragment(200, 0)),
        here.seal(fragment(100, 1)),
        b"garbage",
    ):
        endpoint._on_datagram(datagram, sender)
    assert dropped == ["duplicate", "unknown_pass", "stale_session", "malformed"]
    assert endpoint._senders[1] == sender  # a replay does not draw the acknowledgements
    assert endpoint.stats.dropped == {"duplicate": 1, "unknown_pass": 1, "stale_session": 1, "malformed": 1}
    assert endpoint.ready.qsize() == 2  # session 100's packet, then the restarted session 200's


def test_a_datagram_of_a_stream_expected_later_came_early_and_is_not_foreign() -> None:
    endpoint = MulticastEndpoint(0, Channel("239.255.0.1", PORT), "t0k3n", pass_id=5)
    seal = mcast_seal.PassSeal("t0k3n", 5)

    def fragment(sender: int, group: int) -> bytes:
        payload = wire.Fragment(sender, 100, group, 0, 7, 0, 1, 3, xxhash.xxh3_64_intdigest(b"abc"), b"abc")
        return seal.seal(wire.encode_data(payload))

    # Its sender planned first: group 3's stream reaches this node before the node's own plan expects it.
    endpoint._on_datagram(fragment(1, 3), ("127.0.0.1", 9))
    endpoint._on_datagram(fragment(2, 4), ("127.0.0.1", 9))
    assert endpoint.stats.foreign_datagrams == 2
    endpoint.expect(1, 3)
    assert (endpoint.stats.foreign_datagrams, endpoint.stats.datagrams_received) == (1, 2)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace whose loopback carries multicast."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace for multicast")
    name = f"dqmcast{os.getpid()}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
    try:
        for step in (["link", "set", "lo", "up"], ["route", "add", "224.0.0.0/4", "dev", "lo"]):
            done = _ip("netns", "exec", name, "ip", *step)
            assert done.returncode == 0, done.stderr
        yield name
    finally:
        _ip("netns", "del", name)


def _exchange(namespace: str, rundir: Path, nodes: int, *args: str) -> list[dict[str, object]]:
    """Runs one coded exchange, a process per node, and returns each node's result."""
    rundir.mkdir()
    command = [
        "ip",
        "netns",
        "exec",
        namespace,
        sys.executable,
        "-m",
        "dataquay.server.tools.coded_wire",
        "--nodes",
        str(nodes),
        "--port",
        str(PORT),
        "--rundir",
        str(rundir),
        *args,
    ]
    processes = [subprocess.Popen([*command, "--node", str(n)]) for n in range(nodes)]
    try:
        for process in processes:
            assert process.wait(timeout=90) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [json.loads((rundir / f"result.{n}.json").read_text()) for n in range(nodes)]


def _assert_every_sample_committed(results: list[dict[str, object]]) -> None:
    for result in results:
        assert result["checksum_failures"] == 0
        assert result["committed"] == result["lacked"] > 0
        assert result["digest"] == result["expected_digest"]


def test_a_coded_exchange_over_multicast_puts_the_planned_bytes_on_the_wire(namespace: str, tmp_path: Path) -> None:
    results = _exchange(namespace, tmp_path / "run", 4, "--scheme", "uber", "--token", "t0k3n")
    _assert_every_sample_committed(results)
    stats = [result["stats"] for result in results]
    assert sum(s["packet_bytes_sent"] for s in stats) == results[0]["planned_bytes"]  # type: ignore[index]
    assert [s["dropped"] for s in stats] == [{}] * 4  # type: ignore[index]


def test_five_percent_loss_still_delivers_every_sample_byte_exact(namespace: str, tmp_path: Path) -> None:
    if shutil.which("nft") is None:
        pytest.skip("needs nftables (nft) to drop datagrams at random")
    rules = (
        f"add table inet loss\n"
        f"add chain inet loss in {{ type filter hook input priority 0; }}\n"
        f"add rule inet loss in udp dport {PORT} numgen random mod 20 0 drop\n"
        f"add rule inet loss in udp sport != {PORT} numgen random mod 20 0 drop\n"
    )
    added = subprocess.run(
        ["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=rules, text=True, capture_output=True, timeout=30
    )
    if added.returncode != 0:
        pytest.skip(f"nftables cannot filter in the namespace: {added.stderr.strip()}")
    results = _exchange(namespace, tmp_path / "run", 4, "--scheme", "coded", "--token", "t0k3n")
    _assert_every_sample_committed(results)
    assert sum(r["stats"]["datagrams_resent"] for r in results) > 0  # type: ignore[index]


def _udp_delivered(namespace: str) -> int:
    """UDP datagrams the namespace's kernel delivered to sockets (one per socket a multicast datagram reached)."""
    lines = [
        line.split()
        for line in _ip("netns", "exec", namespace, "cat", "/proc/net/snmp").stdout.splitlines()
        if line.startswith("Udp:")
    ]
    return int(lines[1][lines[0].index("InDatagrams")])


def _modelled(nodes: int, scheme: str, frame: int = 0) -> NodeBytes:
    """Each node's bytes by the payoff model, for the plan the tool makes with its defaults: datagrams
    of 1400 packet bytes with our header and seal, or (``frame``) TCP's stream of framed samples."""
    s = coded_wire.setup(nodes, 400, 4096, 100, scheme, 1, POOL)
    if frame:
        return node_bytes(s.packets, nodes, s.sizes + frame)
    return node_bytes(s.packets, nodes, s.sizes, 1400, wire.DATA_HEADER_BYTES + mcast_seal.OVERHEAD_BYTES)


def test_each_node_hears_only_the_groups_it_decodes_for(namespace: str, tmp_path: Path) -> None:
    delivered = _udp_delivered(namespace)
    results = _exchange(namespace, tmp_path / "run", 4, "--scheme", "uber", "--token", "t0k3n", "--pool", str(POOL))
    delivered = _udp_delivered(namespace) - delivered
    _assert_every_sample_committed(results)
    stats = [result["stats"] for result in results]
    for node, s in enumerate(stats):
        assert s["foreign_datagrams"] == 0  # type: ignore[index]
        assert s["data_bytes_received"] == _modelled(4, "uber").received[node]  # type: ignore[index]
    # The kernel's count: the datagrams delivered are the ones the nodes took (data and tails of their
    # groups, acknowledgements of their own), and at most a few still queued when a node closed.
    counted = sum(s["datagrams_received"] for s in stats)  # type: ignore[index]
    assert counted <= delivered <= counted * 1.02


def test_the_uncoded_baseline_over_tcp_streams_delivers_every_sample_byte_exact(namespace: str, tmp_path: Path) -> None:
    results = _exchange(namespace, tmp_path / "run", 4, "--scheme", "none", "--tcp")
    _assert_every_sample_committed(results)
    sent = sum(r["stats"]["payload_bytes_sent"] for r in results)  # type: ignore[index]
    assert sent == sum(r["stats"]["payload_bytes_received"] for r in results) > 0  # type: ignore[index]


def test_the_payoff_model_counts_each_nodes_bytes_as_a_real_exchange_puts_them_on_the_wire(
    namespace: str, tmp_path: Path
) -> None:
    counted = {}
    for scheme in ("coded", "uber"):
        results = _exchange(namespace, tmp_path / scheme, 4, "--scheme", scheme, "--pool", str(POOL))
        _assert_every_sample_committed(results)
        stats = [r["stats"] for r in results]
        model = _modelled(4, scheme)
        # First transmissions only: resends and acknowledgements are the transport's, not the plan's.
        assert [s["wire_bytes_sent"] for s in stats] == model.sent.tolist()  # type: ignore[index]
        assert [s["data_bytes_received"] for s in stats] == model.received.tolist()  # type: ignore[index]
        counted[scheme] = model
    results = _exchange(namespace, tmp_path / "tcp", 4, "--scheme", "none", "--tcp")
    uncoded = _modelled(4, "none", coded_wire.FRAME_BYTES)
    assert [r["stats"]["payload_bytes_sent"] for r in results] == uncoded.sent.tolist()  # type: ignore[index]
    assert [r["stats"]["payload_bytes_received"] for r in results] == uncoded.received.tolist()  # type: ignore[index]
    for model in counted.values():
        # Coding lightens the busiest sender but no receiver: on equal links it does not pay; where
        # senders' links are a third of the receivers', it does.
        assert model.sent.max() < uncoded.sent.max() and model.received.sum() >= uncoded.received.sum() * 0.95
        assert not payoff(uncoded, model, copies=2.0).pays  # each cache: its 100 samples and 100 spares
        assert payoff(uncoded, model, copies=2.0, egress=1.0, ingress=3.0).pays


def test_datagrams_read_in_one_wake_up_draw_one_acknowledgement_per_stream() -> None:
    async def exchange() -> list[wire.Ack]:
        seal = mcast_seal.PassSeal("t0k3n", 5)
        endpoint = MulticastEndpoint(0, Channel("239.255.0.1", PORT), "t0k3n", pass_id=5)
        endpoint.expect(1, 0)
        with (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as inbox,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer,
        ):
            inbox.bind(("127.0.0.1", 0))
            inbox.setblocking(False)  # as the event loop's sockets are
            peer.bind(("127.0.0.1", 0))
            peer.settimeout(0.5)
            datagrams = [
                seal.seal(
                    wire.encode_data(
                        wire.Fragment(1, 9, 0, seq, seq, 0, 1, 3, xxhash.xxh3_64_intdigest(b"abc"), b"abc")
                    )
                )
                for seq in range(8)
            ]
            for datagram in datagrams[1:]:
                peer.sendto(datagram, inbox.getsockname())
            await endpoint.start()
            try:
                # The loop's read of the first; the seven queued behind it are read in the same call.
                _Protocol(endpoint, inbox).datagram_received(datagrams[0], peer.getsockname())
                await asyncio.sleep(0.1)
                acks = []
                with contextlib.suppress(TimeoutError):
                    while True:
                        acks.append(wire.decode(seal.open(peer.recv(MAX_DATAGRAM))))
            finally:
                endpoint.close()
        assert endpoint.ready.qsize() == 8
        return [ack for ack in acks if isinstance(ack, wire.Ack)]

    acks = asyncio.run(exchange())
    assert [(ack.cumulative, ack.gaps) for ack in acks] == [(8, ())]  # one per stream, not one per packet
