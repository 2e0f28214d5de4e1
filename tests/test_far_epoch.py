"""A far epoch never stalls a job: a rank of a real partial-mode job that names
epoch 20000 (a global step passed for an epoch) is refused at once, by the
daemon and the directory as well as by its sampler, while the other rank reads
the current epoch on; the next epoch is taken as ever."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import dataquay.client as dq
from dataquay.client.jobs import check_epoch_ahead
from dataquay.client.placement import MAX_EPOCHS_AHEAD
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_npy_dataset

#: Enough samples that 20000 steps of their owners would take minutes.
N = 20_000
FAR = 20_000
HINT = "pass the epoch number, not the global step"


@pytest.fixture
def records(tmp_path: Path) -> np.ndarray:
    root = make_npy_dataset(tmp_path / "pfs" / "frames", N, record_shape=(2,), files=4)
    return np.concatenate([np.load(path) for path in sorted(root.glob("*.npy"))])


@pytest.fixture
def servers(tmp_path: Path, records: np.ndarray) -> Iterator[tuple[DirectoryProcess, list[DaemonProcess]]]:
    directory = DirectoryProcess(tmp_path / "directory", dataset_roots=(tmp_path,)).start()
    daemons: list[DaemonProcess] = []
    try:
        for name in ("n0", "n1"):
            daemons.append(
                DaemonProcess(
                    tmp_path / name, ("--directory", directory.address, "--node-name", name), dataset_roots=(tmp_path,)
                ).start()
            )
        with grpc.insecure_channel(grpc_target(daemons[0].address), options=channel_options()) as channel:
            root = str(tmp_path / "pfs" / "frames")
            cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="frames", root=root))
        yield directory, daemons
    finally:
        for process in [*daemons, directory]:
            process.kill()


def assert_refused(message: str, current: int) -> None:
    assert f"epoch {FAR} of job 'p1'" in message and f"current epoch {current}" in message
    assert f"more than {MAX_EPOCHS_AHEAD} epochs" in message and HINT in message


def test_a_far_epoch_is_refused_at_once_and_the_other_rank_reads_on(
    servers: tuple[DirectoryProcess, list[DaemonProcess]], records: np.ndarray
) -> None:
    directory, daemons = servers
    with dq.connect(daemons[0].address, timeout=10) as c0, dq.connect(daemons[1].address, timeout=10) as c1:
        d0, d1 = c0.dataset("frames"), c1.dataset("frames")
        ranks = [
            d.sampler(job="p1", mode="partial", q=0.5, seed=4, rank=r, world_size=2) for r, d in enumerate((d0, d1))
        ]
        for sampler in ranks:
            sampler.set_epoch(0)

        started = time.monotonic()
        with pytest.raises(dq.EpochTooFarError) as refused:
            ranks[0].set_epoch(FAR)
        assert time.monotonic() - started < 2.0
        assert_refused(str(refused.value), 0)
        assert ranks[0].epoch == 0

        # The daemon and the directory refuse it too, to a caller with no sampler.
        with grpc.insecure_channel(grpc_target(daemons[0].address), options=channel_options()) as channel:
            stub = cache_pb2_grpc.CacheStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as by_daemon:
                stub.ReportEpoch(jpb.ReportEpochRequest(job_id="p1", epoch=FAR))
            assert by_daemon.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert_refused(by_daemon.value.details(), 0)
            with pytest.raises(grpc.RpcError) as read_far:
                list(stub.Read(pb.ReadRequest(dataset="frames", ids=[0, 1], job="p1", epoch=FAR)))
            assert read_far.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert_refused(read_far.value.details(), 0)
            assert time.monotonic() - started < 2.0
        with grpc.insecure_channel(directory.address, options=channel_options()) as channel:
            stub_d = directory_pb2_grpc.DirectoryStub(channel)
            with pytest.raises(grpc.RpcError) as by_directory:
                stub_d.ReportEpoch(jpb.ReportEpochRequest(job_id="p1", epoch=FAR))
            assert by_directory.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert_refused(by_directory.value.details(), 0)
            assert stub_d.GetJob(jpb.GetJobRequest(job_id="p1")).epoch == 0

        # The other rank reads the current epoch on, on both nodes.
        ids = ranks[1].indices()[:200]
        started = time.monotonic()
        assert d1.get_batch(ids) == [records[i].tobytes() for i in ids]
        assert d0.get_batch(ids) == [records[i].tobytes() for i in ids]
        assert time.monotonic() - started < 10.0

        ranks[0].set_epoch(1)
        ranks[1].set_epoch(1)
        with grpc.insecure_channel(directory.address, options=channel_options()) as channel:
            assert directory_pb2_grpc.DirectoryStub(channel).GetJob(jpb.GetJobRequest(job_id="p1")).epoch == 1
        ids = ranks[0].indices()[:200]
        assert d0.get_batch(ids) == [records[i].tobytes() for i in ids]
        # The bound counts from the job's current epoch: as far as it reaches is taken.
        ranks[0].set_epoch(1 + MAX_EPOCHS_AHEAD)
        with grpc.insecure_channel(directory.address, options=channel_options()) as channel:
            job = directory_pb2_grpc.DirectoryStub(channel).GetJob(jpb.GetJobRequest(job_id="p1"))
        assert job.epoch == 1 + MAX_EPOCHS_AHEAD


@pytest.mark.parametrize("mode", ["global", "local", "locality"])
def test_modes_whose_owners_stay_take_any_epoch(mode: str) -> None:
    check_epoch_ahead("p1", mode, FAR, 0)  # each epoch's owners are computed directly


def test_partial_takes_epochs_up_to_the_bound_past_the_current_one() -> None:
    check_epoch_ahead("p1", "partial", 7 + MAX_EPOCHS_AHEAD, 7)
    with pytest.raises(dq.EpochTooFarError) as refused:
        check_epoch_ahead("p1", "partial", FAR, 7)
    assert_refused(str(refused.value), 7)
