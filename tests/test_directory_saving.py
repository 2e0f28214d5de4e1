"""The directory writes its state off the event loop: heartbeats are answered
while a write runs, and a call that changes the state answers only once the
change is on disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.config import DirectoryConfig
from dataquay.server.directory.server import DirectoryServer
from dataquay.server.tools.processes import DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

Stub = directory_pb2_grpc.DirectoryStub

#: How long a held write waits for the test before it goes on anyway: only a
#: directory that writes on its event loop, and so holds up the test, waits that long.
HOLD_SECONDS = 10.0


def node_info(name: str) -> jpb.NodeInfo:
    return jpb.NodeInfo(name=name, tcp_address="127.0.0.1:7000", metrics_address="127.0.0.1:8000")


def create(job_id: str) -> jpb.JoinJobRequest:
    return jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job_id, dataset="imgs"))


@pytest.fixture
def imgs(tmp_path: Path) -> Path:
    return make_files_dataset(tmp_path / "pfs" / "imgs", 20, sizes=(100, 200), classes=2)


@pytest.fixture
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(held, release): once armed by clearing release, the next rename onto a
    directory.json sets held and waits for release."""
    held, release = threading.Event(), threading.Event()
    release.set()
    rename = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst).name == "directory.json" and not release.is_set():
            held.set()
            release.wait(HOLD_SECONDS)
        rename(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    yield held, release
    release.set()


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, imgs: Path) -> AsyncIterator[tuple[Stub, dpb.RegisterNodeReply]]:
    """A directory in this process, node n0 registered and dataset imgs added."""
    config = DirectoryConfig(
        listen="127.0.0.1:0",
        state_dir=tmp_path / "directory",
        http_host="127.0.0.1",
        http_port=0,
        dataset_roots=(tmp_path,),
    )
    async with (
        DirectoryServer(config) as server,
        grpc.aio.insecure_channel(server.tcp_address, options=channel_options()) as channel,
    ):
        stub = Stub(channel)
        registered = await stub.RegisterNode(dpb.RegisterNodeRequest(node=node_info("n0"), identity_key=bytes(32)))
        await stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
        yield stub, registered


def test_heartbeats_are_answered_while_the_state_is_written_and_a_join_waits_for_its_write(
    tmp_path: Path, imgs: Path, held_writes: tuple[threading.Event, threading.Event]
) -> None:
    held, release = held_writes

    async def scenario() -> None:
        async with serving(tmp_path, imgs) as (stub, registered):
            release.clear()
            join = asyncio.ensure_future(stub.JoinJob(create("j1")))
            assert await asyncio.to_thread(held.wait, HOLD_SECONDS), "the job's creation was never written"
            beat = dpb.HeartbeatRequest(name="n0", session=registered.session)
            beats = [await stub.Heartbeat(beat) for _ in range(50)]
            answered_while_held = not release.is_set()
            assert not join.done(), "the job's creation was answered before it was on disk"
            release.set()
            job = await join
            assert answered_while_held, "heartbeats waited for the state's write"
            assert [b.known for b in beats] == [True] * 50
            assert job.spec.job_id == "j1"

    asyncio.run(scenario())


@pytest.fixture
def start_directory(tmp_path: Path) -> Iterator[Callable[[], DirectoryProcess]]:
    started: list[DirectoryProcess] = []

    def start() -> DirectoryProcess:
        started.append(DirectoryProcess(tmp_path / "directory").start())
        return started[-1]

    yield start
    for directory in started:
        directory.kill()


def test_thousands_of_jobs_created_at_once_leave_heartbeats_answered_and_survive_a_kill(
    start_directory: Callable[[], DirectoryProcess], imgs: Path
) -> None:
    jobs = 2000
    first = start_directory()
    with grpc.insecure_channel(first.address, options=channel_options()) as channel:
        stub = Stub(channel)
        registered = stub.RegisterNode(dpb.RegisterNodeRequest(node=node_info("n0"), identity_key=bytes(32)))
        stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
        with ThreadPoolExecutor(32) as pool:
            creating = [pool.submit(stub.JoinJob, create(f"job-{i}")) for i in range(jobs)]
            beats: list[dpb.HeartbeatReply] = []
            while not all(c.done() for c in creating):
                beats.append(stub.Heartbeat(dpb.HeartbeatRequest(name="n0", session=registered.session)))
            created = {c.result().spec.job_id for c in creating}
    first.kill()

    assert created == {f"job-{i}" for i in range(jobs)}
    assert beats and all(b.known for b in beats)
    second = start_directory()
    with grpc.insecure_channel(second.address, options=channel_options()) as channel:
        listed = Stub(channel).ListJobs(jpb.ListJobsRequest()).jobs
    assert {j.spec.job_id for j in listed} == created


def test_a_beat_that_carries_a_drops_version_is_followed_by_a_listing_without_the_dataset(
    tmp_path: Path, imgs: Path, held_writes: tuple[threading.Event, threading.Event]
) -> None:
    """Daemons follow the registry by its version: one that takes the new version
    while the listing still holds the dataset would keep its copy for good."""
    held, release = held_writes

    async def scenario() -> None:
        async with serving(tmp_path, imgs) as (stub, registered):
            beat = dpb.HeartbeatRequest(name="n0", session=registered.session)
            before = (await stub.Heartbeat(beat)).versions.datasets
            release.clear()
            drop = asyncio.ensure_future(stub.DropDataset(pb.DropDatasetRequest(name="imgs")))
            assert await asyncio.to_thread(held.wait, HOLD_SECONDS), "the drop was never written"
            during = (await stub.Heartbeat(beat)).versions.datasets
            listed = [d.name for d in (await stub.ListDatasets(pb.ListDatasetsRequest())).datasets]
            release.set()
            await drop
            assert during != before and listed == []

    asyncio.run(scenario())
