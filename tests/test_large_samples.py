"""Samples larger than a gRPC message: in pieces from the daemon, from a peer
and in the exchange, straight from the PFS while the daemon is down, and
refused by name beyond --max-sample-size, at registration and at read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from one_daemon import add, cache_stub, reply_samples, stage, tiers_read
from polling import wait_until

import dataquay.client as dq
from dataquay.client.errors import SampleTooLargeError
from dataquay.client.wire.channels import MAX_MESSAGE_BYTES, channel_options
from dataquay.client.wire.pieces import PIECE_BYTES
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

MiB = 1 << 20
BIG = 70 * MiB
#: Sample i is SIZES[i % 3] bytes: larger than a message, small, and one that fits a client's segment.
SIZES = (BIG, 3000, 5 * MiB)


def truth(ids: list[int]) -> list[bytes]:
    return [sample_bytes(0, i, SIZES[i % len(SIZES)]) for i in ids]


def test_the_large_sample_is_larger_than_a_message() -> None:
    assert BIG > MAX_MESSAGE_BYTES


def test_a_sample_larger_than_a_message_reads_right_from_the_daemon_cached_or_not(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    make_files_dataset(tmp_path / "big", 4, sizes=SIZES, classes=1)
    add(daemon, "big", tmp_path / "big")
    ids = [0, 1, 2, 0, 3]
    got, tiers = tiers_read(client, lambda: client.dataset("big").get_batch(ids))
    assert got == truth(ids)
    # A repeat in a later window may find the sample cached by then.
    assert tiers["pfs"] + tiers["cache"] == len(ids) and tiers["pfs"] >= 4

    stage(daemon, "big")
    with cache_stub(daemon) as stub:
        chunks = list(stub.Read(pb.ReadRequest(dataset="big", ids=ids)))
    pieces = -(-np.array([SIZES[i % len(SIZES)] for i in ids]) // PIECE_BYTES)
    assert sum(chunk.HasField("piece") for chunk in chunks) == pieces[pieces > 1].sum()
    samples = list(reply_samples(chunks))
    assert [s.id for s in samples] == ids
    assert [s.data for s in samples] == truth(ids)
    assert all(s.tier == pb.TIER_CACHE and s.checksum == checksum(s.data) for s in samples)


def test_a_sample_larger_than_a_message_comes_from_its_owner_through_the_local_daemon(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(2)
    make_files_dataset(tmp_path / "big", 6, sizes=SIZES, classes=1)
    with dq.connect(local.daemons[0].address, timeout=10) as client:
        with cache_stub(local.daemons[0]) as stub:
            stub.AddDataset(pb.AddDatasetRequest(name="big", root=str(tmp_path / "big")))
        ds = client.dataset("big")
        # A seed under which node 1 owns one of the large samples.
        for seed in range(10):
            sampler = ds.sampler(job=f"j{seed}", mode="global", seed=seed, rank=0, world_size=2)
            owner = sampler.owners(0)
            remote = np.flatnonzero(owner == 1).tolist()
            if any(i % len(SIZES) == 0 for i in remote):
                break
        else:
            pytest.fail("no seed gives node 1 a large sample")
        assert list(sampler.job.spec.nodes) == [node_name(0), node_name(1)]
        with cache_stub(local.daemons[1]) as stub:
            *_, last = stub.Stage(pb.StageRequest(dataset="big", job=sampler.job_id))
        assert last.finished and not last.error and last.done_samples == len(remote)

        got, tiers = tiers_read(client, lambda: ds.get_batch(remote))
        assert got == truth(remote)
        assert tiers["peer"] == len(remote)


def test_a_sample_larger_than_a_message_is_read_from_the_pfs_while_the_daemon_is_down(
    daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    make_files_dataset(tmp_path / "big", 2, sizes=SIZES, classes=1)
    add(daemon, "big", tmp_path / "big")
    with dq.connect(daemon.address, timeout=5) as client:
        ds = client.dataset("big")
        daemon.kill()
        got, tiers = tiers_read(client, lambda: ds.get_batch([0, 1, 0]))
    assert got == truth([0, 1, 0])
    assert tiers["fallback"] == 3


def test_the_exchange_moves_a_sample_larger_than_a_message_in_pieces(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(2)
    make_files_dataset(tmp_path / "big", 6, sizes=SIZES, classes=1)
    channels = [grpc.insecure_channel(d.ready["tcp"], options=channel_options()) for d in local.daemons if d.ready]
    stubs = [cache_pb2_grpc.CacheStub(channel) for channel in channels]
    try:
        stubs[0].AddDataset(pb.AddDatasetRequest(name="big", root=str(tmp_path / "big")))
        with dq.connect(local.daemons[0].address, timeout=10) as client:
            # A seed under which a large sample changes owner between epochs 0 and 1
            # (a dataset object reads for one job: each seed's job opens its own).
            for seed in range(20):
                sampler = client.dataset("big").sampler(
                    job=f"x{seed}", mode="partial", q=1.0, seed=seed, rank=0, world_size=2
                )
                before, after = sampler.owners(0), sampler.owners(1)
                moved = np.flatnonzero(before != after)
                if any(i % len(SIZES) == 0 for i in moved.tolist()):
                    break
            else:
                pytest.fail("no seed moves a large sample")
        job = sampler.job_id
        for stub in stubs:
            *_, last = stub.Stage(pb.StageRequest(dataset="big", job=job))
            assert last.finished and not last.error
        for stub in stubs:
            stub.ReportEpoch(jpb.ReportEpochRequest(job_id=job, epoch=0))

        def delivered() -> bool:
            runs = [next((x for x in s.Stats(pb.StatsRequest()).exchanges if x.job == job), None) for s in stubs]
            return all(run is not None and run.finished for run in runs)

        wait_until(delivered, "both nodes finished their exchange into epoch 1")
        for m, stub in enumerate(stubs):
            incoming = [i for i in moved.tolist() if after[i] == m]
            held = list(reply_samples(stub.Read(pb.ReadRequest(dataset="big", ids=incoming, peer=True))))
            assert [s.id for s in held] == incoming and not any(s.missing for s in held)
            assert [s.data for s in held] == truth(incoming)
        received = sum(s.Stats(pb.StatsRequest()).exchange_received_bytes for s in stubs)
        assert received == sum(SIZES[i % len(SIZES)] for i in moved.tolist())
    finally:
        for channel in channels:
            channel.close()


def test_a_sample_over_the_limit_is_refused_at_registration_naming_it(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    root = tmp_path / "huge"
    root.mkdir()
    with open(root / "a.bin", "wb") as f:  # sparse: no disk space taken
        f.truncate((1 << 30) + 1)
    (root / "b.bin").write_bytes(b"x" * 100)
    daemon = start_daemon()
    with cache_stub(daemon) as stub, pytest.raises(grpc.RpcError) as refused:
        stub.AddDataset(pb.AddDatasetRequest(name="huge", root=str(root)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = refused.value.details()
    assert "sample 0 of 'huge' (a.bin)" in message and "1073741825 bytes" in message
    assert "1.0 GiB a sample may be (--max-sample-size)" in message

    small = start_daemon("--max-sample-size", "4M", name="small")
    make_files_dataset(tmp_path / "mixed", 3, sizes=(3000, 5 * MiB), classes=1)
    with cache_stub(small) as stub, pytest.raises(grpc.RpcError) as refused:
        stub.AddDataset(pb.AddDatasetRequest(name="mixed", root=str(tmp_path / "mixed")))
    assert "sample 1 of 'mixed' (class_000/00000001.bin) is 5.0 MiB" in refused.value.details()


def test_a_sample_over_the_daemons_limit_is_refused_at_read_naming_it(
    cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")  # the daemon's reads are limited, not the trainer's
    # The directory builds the manifest under its own (default) limit.
    local = cluster(1, daemon_args=("--max-sample-size", "4M"))
    make_files_dataset(tmp_path / "mixed", 4, sizes=(3000, 5 * MiB), classes=1)
    with cache_stub(local.daemons[0]) as stub:
        stub.AddDataset(pb.AddDatasetRequest(name="mixed", root=str(tmp_path / "mixed")))
    with dq.connect(local.daemons[0].address, timeout=10) as client:
        ds = client.dataset("mixed")
        with pytest.raises(SampleTooLargeError, match=r"sample 3 of 'mixed' is 5\.0 MiB .*--max-sample-size"):
            ds.get_batch([0, 2, 3])
        assert ds.get_batch([2, 0]) == [sample_bytes(0, 2, 3000), sample_bytes(0, 0, 3000)]
