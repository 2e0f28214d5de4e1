"""The bulk data path between daemons: peer hits byte-exact over it, gRPC when
a peer has none, the token and TLS rules, and hostile input on its port.
Real directory and daemon processes on loopback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from polling import wait_until

import dataquay.client as dq
from dataquay.client.remote import _Reply
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.memfd import MemfdSegment
from dataquay.client.wire.shm import Segment, SegmentPool
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import new_token_file
from dataquay.server.node.peers.bulk.client import BulkClient, BulkRefusedError
from dataquay.server.node.peers.bulk.frames import (
    HELLO,
    HELLO_MAGIC,
    MAC_BYTES,
    READ,
    REQUEST,
    REQUEST_MAGIC,
    SAMPLE,
    BulkError,
    chunk_frames,
    client_proof,
    kernel_timeouts,
    parse_chunk,
    recv_all,
)
from dataquay.server.tools.local_cluster import LocalCluster, TlsFiles
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

N = 60
SIZE = 150_000  # more than a gRPC chunk's worth in a batch, less than a piece


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two daemons that require a token, the dataset staged on both; shared by this module's tests."""
    base = tmp_path_factory.mktemp("bulk")
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


def staged(local: LocalCluster, root: Path) -> None:
    """Registers ``root`` as "imgs", starts job j on every node and stages it."""
    with local.credentials().channel(local.daemons[0].address, channel_options()) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)), timeout=30)
        stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="j", dataset="imgs")), timeout=30)
    for daemon in local.daemons:
        with local.credentials().channel(daemon.address, channel_options()) as channel:
            *_, last = cache_pb2_grpc.CacheStub(channel).Stage(pb.StageRequest(dataset="imgs", job="j"))
            assert not last.error


def read_all(local: LocalCluster, node: int = 0) -> tuple[list[pb.Sample], pb.StatsReply]:
    """Every sample through node ``node`` for job j, and its stats after."""
    with local.credentials().channel(local.daemons[node].address, channel_options()) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        request = pb.ReadRequest(dataset="imgs", ids=list(range(N)), job="j")
        samples = [s for chunk in stub.Read(request, timeout=60) for s in chunk.samples]
        return samples, stub.Stats(pb.StatsRequest(), timeout=30)


def stats(local: LocalCluster, node: int) -> pb.StatsReply:
    with local.credentials().channel(local.daemons[node].address, channel_options()) as channel:
        return cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=30)


def bulk_address(local: LocalCluster, node: int) -> str:
    ready = local.daemons[node].ready
    assert ready is not None and ready["bulk"]
    return str(ready["bulk"])


def test_peer_hits_go_over_the_bulk_path_byte_exact(secured: LocalCluster) -> None:
    served_before = stats(secured, 1).bulk.served_samples
    samples, after = read_all(secured)
    assert [s.id for s in samples] == list(range(N))
    assert [s.data for s in samples] == [sample_bytes(0, i, SIZE) for i in range(N)]
    peer = [s.id for s in samples if s.tier == pb.TIER_PEER]
    assert 0 < len(peer) < N and pb.TIER_PFS not in {s.tier for s in samples}
    assert after.bulk.fetched_samples >= len(peer) and after.bulk.fetched_bytes >= len(peer) * SIZE
    assert after.bulk.fallbacks == 0
    assert stats(secured, 1).bulk.served_samples - served_before == len(peer)
    metrics = urllib.request.urlopen(secured.daemons[0].metrics_url, timeout=30).read().decode()
    assert f"dataquay_bulk_fetched_samples_total {float(after.bulk.fetched_samples)}" in metrics
    # A peer that answered every read has no series of its own.
    assert "dataquay_peer_failures_total{" not in metrics and "dataquay_peer_suspect{" not in metrics


def test_the_bulk_port_refuses_a_wrong_token_and_answers_errors_in_band(secured: LocalCluster) -> None:
    address = bulk_address(secured, 1)
    token = secured.node_credentials().token
    lengths = np.full(N, SIZE, dtype=np.int64)

    async def read(client: BulkClient, dataset: str, ids: list[int]) -> dict[int, bytes]:
        got = await client.read(address, dataset, "", np.array(ids, dtype=np.int64), lengths, 30.0)
        return {i: bytes(data) for i, (data, _digest) in got.samples.items()}

    async def run() -> None:
        wrong = BulkClient("f" * 64, None)
        with pytest.raises(BulkError, match="closed"):
            await read(wrong, "imgs", [0])
        wrong.close()
        right = BulkClient(token, None)
        with pytest.raises(BulkRefusedError, match="nope"):
            await read(right, "nope", [0])
        got = await read(right, "imgs", list(range(N)))  # the same connection, after the error
        assert got and all(data == sample_bytes(0, i, SIZE) for i, data in got.items())
        right.close()

    asyncio.run(run())
    assert "the client does not hold the node token" in secured.daemons[1].log_path.read_text()


def test_hostile_input_on_the_bulk_port_is_closed_and_logged(secured: LocalCluster) -> None:
    host, _, port = bulk_address(secured, 0).rpartition(":")
    token = secured.node_credentials().token
    refused_before = stats(secured, 0).bulk.refused_connections

    def connect() -> socket.socket:
        sock = socket.create_connection((host, int(port)), timeout=30)
        assert len(sock.recv(HELLO.size, socket.MSG_WAITALL)) == HELLO.size
        return sock

    def authenticated() -> socket.socket:
        sock = socket.create_connection((host, int(port)), timeout=30)
        _magic, nonce = HELLO.unpack(sock.recv(HELLO.size, socket.MSG_WAITALL))
        mine = b"\1" * 32
        sock.sendall(mine + client_proof(token, nonce, mine))
        assert len(sock.recv(MAC_BYTES, socket.MSG_WAITALL)) == MAC_BYTES
        return sock

    def closed(sock: socket.socket) -> bool:
        """Whether the daemon closed ``sock`` (a reset when our bytes were left unread)."""
        with sock:
            try:
                return sock.recv(1 << 16) == b""
            except ConnectionResetError:
                return True

    half_open = socket.create_connection((host, int(port)), timeout=30)  # says nothing, stays open
    garbage = connect()
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 100)
    assert closed(garbage)
    huge = authenticated()
    huge.sendall(REQUEST.pack(REQUEST_MAGIC, READ, 0xFFFFFFFF))
    assert closed(huge)
    bad_magic = authenticated()
    bad_magic.sendall(b"\xff" * 64)
    assert closed(bad_magic)
    truncated = authenticated()
    truncated.sendall(REQUEST.pack(REQUEST_MAGIC, READ, 40) + b"\5\0imgs")
    truncated.shutdown(socket.SHUT_WR)
    assert closed(truncated)

    samples, _ = read_all(secured)  # the daemon serves on, the half-open connection notwithstanding
    assert [s.data for s in samples] == [sample_bytes(0, i, SIZE) for i in range(N)]
    wait_until(lambda: stats(secured, 0).bulk.refused_connections - refused_before >= 4, "four connections refused")
    # The first is logged with its reason; those within the next seconds go in one summary line
    # (tests/test_bulk_flood.py).
    log = secured.daemons[0].log_path.read_text()
    assert "reason=handshake detail=the client does not hold the node token" in log
    half_open.close()


@pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
    reason="openssl is not installed: the test makes its certificates with it",
)
def test_the_bulk_path_speaks_tls_when_the_cluster_does(cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    pem = make_certificates(tmp_path / "pki")
    local = cluster(2, tls=pem, token_file=new_token_file(tmp_path / "token"))
    staged(local, make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,)))
    samples, after = read_all(local)
    assert [s.data for s in samples] == [sample_bytes(0, i, SIZE) for i in range(N)]
    assert after.bulk.fetched_samples > 0 and after.bulk.fallbacks == 0, local.daemons[0].log_tail()
    host, _, port = bulk_address(local, 1).rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as plain:  # no TLS: never greeted
        plain.sendall(b"\0" * 64)
        try:
            assert not plain.recv(1 << 16).startswith(HELLO_MAGIC)
        except ConnectionResetError:
            pass


def make_certificates(directory: Path) -> TlsFiles:
    from test_auth import make_certificates as make

    return make(directory)


def test_a_trainer_gets_peer_payloads_forwarded_into_its_segment_as_they_arrive(
    secured: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in secured.node_env(0).items():
        monkeypatch.setenv(name, value)
    before = stats(secured, 0).bulk
    with dq.connect() as client:
        ds = client.dataset("imgs")
        ds.sampler(job="j", rank=0, world_size=2)
        assert ds.get_batch(list(range(N))) == [sample_bytes(0, i, SIZE) for i in range(N)]
        peer = client.stats().samples["peer"]
    assert peer > 0
    after = stats(secured, 0).bulk
    assert after.forwarded_samples - before.forwarded_samples == peer
    # The client's segment is a sealed memfd: every peer payload was received straight into it.
    assert after.in_place_samples - before.in_place_samples == peer


def test_the_trainer_skips_its_check_only_of_payloads_checked_on_this_hop_in_its_sealed_segment(
    secured: LocalCluster,
) -> None:
    credentials = secured.credentials()
    pool = SegmentPool(daemon_address=secured.daemons[0].address, token=credentials.token)
    lengths = np.full(N, SIZE)
    payloads = [sample_bytes(0, i, SIZE) for i in range(N)]
    with (
        pool.segment(N * (SIZE + 64)) as seg,
        credentials.channel(secured.daemons[0].address, channel_options()) as channel,
    ):
        assert isinstance(seg, MemfdSegment)
        request = pb.ReadRequest(dataset="imgs", ids=list(range(N)), job="j", shm_name=seg.name, shm_size=seg.size)
        chunks = list(cache_pb2_grpc.CacheStub(channel).Read(request, timeout=60))
        samples = [s for chunk in chunks for s in chunk.samples]
        peer = [s.tier == pb.TIER_PEER for s in samples]
        assert any(peer) and not all(peer)
        # Received from n1 straight into the segment and checked there; n0's own copied in from
        # its cache, each checked against its stored checksum as it was read.
        assert all(s.in_shm and s.checked_in_place for s in samples)

        def taken(reply_chunks: list[pb.ReadChunk], segment: MemfdSegment | Segment) -> _Reply:
            reply = _Reply("imgs", list(range(N)), lengths, segment, verify=True)
            for chunk in reply_chunks:
                reply.take(chunk)
            reply.check_complete()
            return reply

        assert taken(chunks, seg).out == payloads and taken(chunks, seg).bad == []
        wrong = [
            pb.ReadChunk(
                samples=[
                    pb.Sample(
                        id=s.id,
                        tier=s.tier,
                        checksum=s.checksum ^ 1,
                        in_shm=s.in_shm,
                        shm_offset=s.shm_offset,
                        length=s.length,
                        checked_in_place=s.checked_in_place,
                    )
                ]
            )
            for s in samples
        ]
        # The mark is taken in the sealed segment: a marked payload's checksum is not looked at again.
        assert taken(wrong, seg).bad == []
        # An older daemon's reply carries no mark: every payload is checked.
        for chunk in wrong:
            chunk.samples[0].checked_in_place = False
        assert taken(wrong, seg).bad == list(range(N))
        # Nor is the mark taken in a /dev/shm segment, which any process of the user may write.
        shm = Segment(seg.size)
        try:
            shm.map[:] = seg.map[:]
            for chunk in wrong:
                chunk.samples[0].checked_in_place = True
            assert taken(wrong, shm).out == payloads and taken(wrong, shm).bad == list(range(N))
        finally:
            shm.close()
    pool.close()


def test_a_peer_payload_corrupt_on_the_wire_never_reaches_the_trainer(
    cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = cluster(2)
    staged(local, make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,)))
    payloads = [sample_bytes(0, i, SIZE) for i in range(N)]
    # n1 serves its values from its cache's map unchecked (the receiver checks): every copy of
    # every payload in its cache file is flipped, so each one it sends fails its checksum in place.
    data_file = local.daemons[1].cache_dir / "data.mdb"
    raw = data_file.read_bytes()
    flipped = 0
    with open(data_file, "r+b") as f:
        for payload in payloads:
            at = raw.find(payload[:64])
            while at >= 0:
                f.seek(at + 10)
                f.write(bytes([raw[at + 10] ^ 0xFF]))
                flipped += 1
                at = raw.find(payload[:64], at + 1)
    assert flipped > 0
    for name, value in local.node_env(0).items():
        monkeypatch.setenv(name, value)
    with dq.connect() as client:
        ds = client.dataset("imgs")
        ds.sampler(job="j", rank=0, world_size=2)
        assert ds.get_batch(list(range(N))) == payloads
        tiers = client.stats().samples
    assert tiers["peer"] == 0 and tiers["pfs"] > 0
    after = stats(local, 0).bulk
    assert after.in_place_samples == after.forwarded_samples == 0 and after.fetched_samples == 0
    metrics = urllib.request.urlopen(local.daemons[0].metrics_url, timeout=30).read().decode()
    bad = sum(
        float(line.rpartition(" ")[2])
        for line in metrics.splitlines()
        if line.startswith("dataquay_peer_bad_checksums_total{")
    )
    assert bad == tiers["pfs"], metrics


def test_an_exchange_chunk_is_taken_whole_and_a_body_its_frames_do_not_fill_is_refused() -> None:
    values = [(7, b"a" * 10), (3, b""), (9, b"b" * 1000)]
    header, *frames = chunk_frames(values)
    body = b"".join(frames)
    assert SAMPLE.unpack(header)[1:3] == (3, len(body))
    assert [(i, bytes(v)) for i, v in parse_chunk(memoryview(body), 3, 1000)] == values

    for bad, count, reason in [
        (body[:-1], 3, "bad exchange sample frame"),  # the last value runs past the body
        (body + b"x", 3, "holds"),  # bytes left over
        (body, 4, "ends inside a frame header"),
        (body, 3 - 1, "holds"),
    ]:
        with pytest.raises(BulkError, match=reason):
            parse_chunk(memoryview(bad), count, 1000)
    with pytest.raises(BulkError, match="bad exchange sample frame"):
        parse_chunk(memoryview(body), 3, 999)  # a value over the largest taken


def test_a_receive_under_the_kernels_timeout_fills_every_view_or_fails_clearly() -> None:
    sender, receiver = socket.socketpair()
    with sender, receiver:
        kernel_timeouts(receiver, receive=0.2)
        head, body = bytearray(3), bytearray(5)
        sender.sendall(b"abcdefgh")
        recv_all(receiver, [memoryview(head), memoryview(body)])
        assert (head, body) == (b"abc", b"defgh")
        with pytest.raises(TimeoutError):
            recv_all(receiver, [memoryview(head)])
        sender.sendall(b"ab")
        sender.close()
        with pytest.raises(BulkError, match="closed"):
            recv_all(receiver, [memoryview(head)])


def test_the_exchange_goes_over_the_bulk_path_byte_exact(cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    from test_exchange import NODES as EXCHANGE_NODES
    from test_exchange import SIZES as EXCHANGE_SIZES
    from test_exchange import partial_cluster

    nodes, epoch_owners = partial_cluster(cluster, tmp_path, "--spare-copies-fill", "0")
    try:
        nodes.report(0)
        runs = nodes.wait_exchanged(1)
        before, after = epoch_owners[0], epoch_owners[1]
        for m, run in enumerate(runs):
            assert run.delivered_samples == run.total_samples == int(((before == m) & (after != m)).sum())
        stats = nodes.stats()
        moved = int((before != after).sum())
        assert sum(s.bulk.exchange_samples for s in stats) == moved
        assert sum(s.exchange_received_samples for s in stats) == moved
        assert not any(s.bulk.fallbacks for s in stats)
        for m in range(EXCHANGE_NODES):
            ids = np.flatnonzero((after == m) & (before != m))
            got = [
                s
                for chunk in nodes.stubs[m].Read(pb.ReadRequest(dataset="imgs", ids=ids.tolist(), peer=True))
                for s in chunk.samples
            ]
            assert [s.data for s in got] == [
                sample_bytes(0, i, EXCHANGE_SIZES[i % len(EXCHANGE_SIZES)]) for i in ids.tolist()
            ]
    finally:
        nodes.close()


def test_a_value_corrupt_in_the_senders_cache_is_refused_by_the_receiver_and_read_from_the_pfs(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    from test_exchange import NODES as EXCHANGE_NODES
    from test_exchange import partial_cluster, sample_payload

    nodes, epoch_owners = partial_cluster(cluster, tmp_path, "--spare-copies-fill", "0")
    try:
        before, after = epoch_owners[0], epoch_owners[1]
        # The exchange sends out of the sender's map unchecked: the receiver's check is the hop's.
        sender = 0
        given = np.flatnonzero((before == sender) & (after != sender))
        victim = int(given[0])
        data_file = nodes.local.daemons[sender].cache_dir / "data.mdb"
        payload = sample_payload(victim)
        raw = data_file.read_bytes()
        with open(data_file, "r+b") as f:
            at = raw.find(payload[:64])
            assert at >= 0
            while at >= 0:
                f.seek(at + 10)
                f.write(bytes([raw[at + 10] ^ 0xFF]))
                at = raw.find(payload[:64], at + 1)

        nodes.report(0)
        runs = nodes.wait_exchanged(1)
        assert (runs[sender].refused_samples, runs[sender].delivered_samples) == (1, len(given) - 1)
        assert sum(r.refused_samples + r.unavailable_samples for r in runs) == 1
        receiver = int(after[victim])
        assert not nodes.holds(receiver, np.array([victim]))[0]
        for m in range(EXCHANGE_NODES):  # every sample byte-exact in epoch 1, the victim from the PFS
            nodes.read(m, np.flatnonzero(after == m))
    finally:
        nodes.close()


def test_a_restarted_peer_is_read_over_bulk_again_and_over_grpc_once_it_has_none(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(2)
    staged(local, make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,)))
    payloads = [sample_bytes(0, i, SIZE) for i in range(N)]
    samples, first = read_all(local)
    peer = sum(s.tier == pb.TIER_PEER for s in samples)
    assert first.bulk.fetched_samples == peer > 0

    def all_from_caches() -> pb.StatsReply | None:
        """Stats after a read of every sample that no PFS served (n0 may list
        the restarted node down for a moment, and read its share from the PFS)."""
        samples, stats = read_all(local)
        assert [s.data for s in samples] == payloads
        return stats if pb.TIER_PFS not in {s.tier for s in samples} else None

    local.restart_node(1)  # the same ports: n0's pooled connection now leads nowhere
    wait_until(all_from_caches, "node-1's samples read from its cache again")
    again = stats(local, 0)
    assert again.bulk.fetched_samples >= 2 * peer and again.bulk.fallbacks == 0

    # Listed with a bulk port it no longer has, then (relisted) with none, as an older daemon is.
    local.restart_node(1, extra_args=("--bulk-listen", "off"))
    wait_until(all_from_caches, "node-1's samples read from its cache again")
    before = stats(local, 0).bulk.fetched_samples
    assert all_from_caches() is not None
    assert stats(local, 0).bulk.fetched_samples == before  # over gRPC
