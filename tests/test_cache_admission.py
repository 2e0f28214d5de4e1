"""A value enters a cache only from the node the plan says gives it, and only
with the manifest's length: forged exchange streams against a real cluster."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from test_exchange import JOB, SAMPLES, SIZES, Nodes, sample_payload

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.records import checksum, encode_value
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.node.cache.admission import ADMITTED, LENGTH, ORIGIN, Origin, refusals
from dataquay.server.node.peers.reads import Peers
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset


def two_nodes(cluster: Callable[..., LocalCluster], tmp_path: Path) -> tuple[Nodes, np.ndarray]:
    """2 daemons, "imgs" staged for a partial job; the job's owners in epochs 0 and 1."""
    local = cluster(2)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                "--mode",
                "partial",
                "--q",
                "0.5",
                "--ranks-per-node",
                "2",
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    nodes = Nodes(local)
    manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
    job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
    plan = job_plan(job, manifest)
    first = owners(plan, 0)
    return nodes, np.stack([first, owners(plan, 1, first)])


def forge(nodes: Nodes, to: int, sender: str, values: dict[int, bytes]) -> list[list[int]]:
    """An Exchange stream into node ``to`` claiming to come from ``sender``:
    ``values`` (payloads, each with its own valid checksum); the held ids of each reply."""
    offer = pb.ExchangeOffer(job=JOB, dataset="imgs", epoch=1, sender=sender, ids=list(values))
    samples = [pb.Sample(id=i, value=encode_value(payload)) for i, payload in values.items()]
    replies = nodes.stubs[to].Exchange(
        iter([pb.ExchangeMessage(offer=offer), pb.ExchangeMessage(samples=samples)]), timeout=30
    )
    return [list(r.held) for r in replies]


def refused_counts(local: LocalCluster, index: int) -> dict[str, float]:
    metrics = urllib.request.urlopen(local.daemons[index].metrics_url, timeout=10).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'dataquay_values_refused_total\{reason="(\w+)"\} (\S+)', metrics)}


def test_values_from_a_node_the_plan_does_not_name_are_refused_and_the_real_exchange_commits(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    nodes, epoch_owners = two_nodes(cluster, tmp_path)
    try:
        before, after = epoch_owners
        from_a = np.flatnonzero((before == 0) & (after == 1))
        attacked = from_a[:4]
        forged = {int(i): b"\0" * len(sample_payload(int(i))) for i in attacked}
        # Neither a name outside the job nor the receiver's own name may hand it node-0's samples.
        assert forge(nodes, 1, "mallory", dict(list(forged.items())[:2])) == [[], []]
        assert forge(nodes, 1, "node-1", dict(list(forged.items())[2:])) == [[], []]
        assert not nodes.holds(1, attacked).any()
        assert refused_counts(nodes.local, 1) == {"length": 0, "origin": 4}
        assert dict(nodes.stats()[1].values_refused) == {"length": 0, "origin": 4}
        nodes.read(1, attacked)  # the PFS's bytes, checked

        nodes.report(0, (0, 1))
        runs = nodes.wait_exchanged(1)
        assert [r.refused_samples for r in runs] == [0, 0]
        for m in range(2):
            assert nodes.holds(m, np.flatnonzero(after == m)).all()
        nodes.report(1, (0, 1))
        assert {s.tier for s in nodes.read(1, from_a)} == {pb.TIER_CACHE}
        assert refused_counts(nodes.local, 1) == {"length": 0, "origin": 4}
    finally:
        nodes.close()


def test_a_value_of_another_length_than_the_manifests_is_refused_from_the_right_sender(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    nodes, epoch_owners = two_nodes(cluster, tmp_path)
    try:
        before, after = epoch_owners
        longer, shorter, right, in_pieces = (int(i) for i in np.flatnonzero((before == 0) & (after == 1))[:4])
        held = forge(
            nodes,
            1,
            "node-0",
            {
                longer: sample_payload(longer) + b"x",
                shorter: sample_payload(shorter)[:-1],
                right: sample_payload(right),
            },
        )
        assert held == [[], [right]]
        assert nodes.holds(1, np.array([longer, shorter, right])).tolist() == [False, False, True]
        value = encode_value(sample_payload(in_pieces) + b"x")
        offer = pb.ExchangeOffer(job=JOB, dataset="imgs", epoch=1, sender="node-0", ids=[in_pieces])
        piece = pb.Sample(id=in_pieces, value=value[:100], offset=0, length=len(value))
        with pytest.raises(grpc.RpcError) as refused:
            list(
                nodes.stubs[1].Exchange(
                    iter([pb.ExchangeMessage(offer=offer), pb.ExchangeMessage(piece=piece)]), timeout=30
                )
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the manifest says {len(sample_payload(in_pieces))} bytes" in refused.value.details()
        assert refused_counts(nodes.local, 1) == {"length": 3, "origin": 0}
        assert dict(nodes.stats()[1].values_refused) == {"length": 3, "origin": 0}
        nodes.report(0, (0, 1))
        nodes.wait_exchanged(1)
        nodes.report(1, (0, 1))
        samples = nodes.read(1, np.array([longer, shorter, right, in_pieces]))
        assert {s.tier for s in samples} == {pb.TIER_CACHE}
    finally:
        nodes.close()


def test_admission_refuses_wrong_lengths_and_senders_the_plan_does_not_name() -> None:
    manifest_lengths = np.array([10, 20, 30, 40], dtype=np.int64)
    ids = np.array([0, 1, 2, 3])
    assert refusals(ids, np.array([10, 21, 30, 39]), manifest_lengths).tolist() == [ADMITTED, LENGTH, ADMITTED, LENGTH]
    before, after = np.array([0, 0, 2, 1]), np.array([1, 1, 1, 0])
    origin = Origin(sender=0, receiver=1, before=before, after=after)
    # id 2 comes from node 2, id 3 is not this receiver's: only node 0's ids to node 1 pass.
    assert refusals(ids, manifest_lengths, manifest_lengths, origin).tolist() == [ADMITTED, ADMITTED, ORIGIN, ORIGIN]
    # The wrong sender outranks a wrong length: nothing of it is admitted either way.
    assert refusals(ids[:1], np.array([11]), manifest_lengths, origin).tolist() == [LENGTH]
    assert refusals(ids[:1], np.array([11]), manifest_lengths, Origin(2, 1, before, after)).tolist() == [ORIGIN]
    for outsider in (Origin(-1, 1, before, after), Origin(1, 1, before, after), Origin(0, 1, None, after)):
        assert (refusals(ids, manifest_lengths, manifest_lengths, outsider) == ORIGIN).all()


class _ForgedPeer(cache_pb2_grpc.CacheServicer):
    """A peer that answers reads with bytes one longer than the manifest's, checksummed."""

    async def Read(
        self, request: pb.ReadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ReadChunk]:
        data = [sample_payload(i) + (b"x" if i % 2 else b"") for i in request.ids]
        yield pb.ReadChunk(samples=[pb.Sample(id=i, data=d, checksum=checksum(d)) for i, d in zip(request.ids, data)])


def test_a_peer_answering_in_another_length_than_the_manifests_is_read_elsewhere() -> None:
    lengths = np.array([len(sample_payload(i)) for i in range(SAMPLES)], dtype=np.int64)

    async def fetch() -> tuple[dict[int, tuple[bytes | memoryview, int]], int]:
        server = grpc.aio.server()
        cache_pb2_grpc.add_CacheServicer_to_server(_ForgedPeer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        peers = Peers(10.0)
        try:
            got = await peers.fetch("node-9", f"127.0.0.1:{port}", "imgs", "", np.arange(6), lengths)
            return got, peers.refused_lengths
        finally:
            await peers.close()
            await server.stop(None)

    got, refused = asyncio.run(fetch())
    assert {i: bytes(v[0]) for i, v in got.items()} == {i: sample_payload(i) for i in (0, 2, 4)}
    assert refused == 3
