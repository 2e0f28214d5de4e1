"""A step of the system clock, injected into a real directory, changes no lease
and no job's idle time: a node killed while the clock steps back is listed down
after its lease, and a step forward lists no live node down and drops no busy
job. The directory runs under libfaketime, whose offset file is rewritten while
it runs; the monotonic clock is left alone, as a real NTP step leaves it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from polling import wait_until
from stepped_clock import SteppedClock, needs_faketime

from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.state import DirectoryState
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

Stub = directory_pb2_grpc.DirectoryStub
HOUR = 3600
LEASE = 6.0


@pytest.fixture
def clock(tmp_path: Path) -> SteppedClock:
    return SteppedClock(tmp_path / "faketime")


@pytest.fixture
def start_stepped(tmp_path: Path, clock: SteppedClock) -> Iterator[Callable[..., DirectoryProcess]]:
    """Starts a directory whose Unix clock :func:`clock` steps; killed after the test."""
    started: list[DirectoryProcess] = []

    def start(*extra_args: str) -> DirectoryProcess:
        directory = DirectoryProcess(
            tmp_path / "directory",
            ("--lease-seconds", str(LEASE), "--heartbeat-seconds", "0.2", *extra_args),
            prefix=clock.prefix(),
            dataset_roots=(tmp_path,),
        ).start()
        started.append(directory)
        return directory

    yield start
    for directory in started:
        directory.kill()


def states(stub: Stub) -> dict[str, int]:
    return {n.info.name: n.state for n in stub.ListNodes(dpb.ListNodesRequest()).nodes}


def register(stub: Stub, name: str) -> int:
    """Registers ``name`` as its daemon would; returns the session its heartbeats carry."""
    node = jpb.NodeInfo(name=name, tcp_address="127.0.0.1:7000")
    return stub.RegisterNode(dpb.RegisterNodeRequest(node=node, identity_key=bytes(32))).session


def assert_clock_stepped(stub: Stub, seconds: int) -> None:
    """Shows the step reached the directory: a node registered now is
    registered ``seconds`` off the real clock."""
    register(stub, "probe")
    listed = {n.info.name: n for n in stub.ListNodes(dpb.ListNodesRequest()).nodes}
    assert abs(listed["probe"].registered_unix - (time.time() + seconds)) < 60


@needs_faketime
def test_a_node_killed_while_the_clock_steps_back_is_listed_down_after_its_lease(
    tmp_path: Path, start_stepped: Callable[..., DirectoryProcess], clock: SteppedClock, stub_for: Callable[..., Stub]
) -> None:
    directory = start_stepped()
    stub = stub_for(directory)
    daemons = [
        DaemonProcess(tmp_path / name, ("--directory", directory.address, "--node-name", name)).start()
        for name in ("node0", "node1")
    ]
    try:
        wait_until(lambda: states(stub) == {"node0": jpb.NODE_UP, "node1": jpb.NODE_UP}, "both nodes up")
        daemons[0].kill()
        clock.step(-HOUR)
        assert_clock_stepped(stub, -HOUR)
        took = wait_until(
            lambda: states(stub).get("node0") == jpb.NODE_DOWN, "the killed node listed down", timeout=4 * LEASE
        )
        assert took < 4 * LEASE
        assert states(stub)["node1"] == jpb.NODE_UP  # it renews its lease by RPC when datagrams look stale
    finally:
        for daemon in daemons:
            daemon.kill()


@needs_faketime
def test_a_step_forward_lists_no_live_node_down_and_drops_no_busy_job(
    tmp_path: Path, start_stepped: Callable[..., DirectoryProcess], clock: SteppedClock, stub_for: Callable[..., Stub]
) -> None:
    directory = start_stepped("--job-ttl", "10s")
    stub = stub_for(directory)
    imgs = make_files_dataset(tmp_path / "pfs" / "imgs", 10, sizes=(100,), classes=2)
    session = register(stub, "n0")
    stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="busy", dataset="imgs")))
    stub.ReportEpoch(jpb.ReportEpochRequest(job_id="busy", epoch=1))
    stub.Heartbeat(dpb.HeartbeatRequest(name="n0", session=session))
    beaten = time.monotonic()
    clock.step(HOUR)
    # Within the lease and the TTL, while the lease checks (every second) and
    # the job expiry checks (every 2.5 s) look.
    time.sleep(3.0)
    job = stub.ReportEpoch(jpb.ReportEpochRequest(job_id="busy", epoch=2))
    assert (job.spec.job_id, job.epoch) == ("busy", 2)
    assert states(stub)["n0"] == jpb.NODE_UP
    assert time.monotonic() - beaten < LEASE
    assert_clock_stepped(stub, HOUR)
    assert directory.stop() == 0
    log = directory.log_path.read_text()
    assert "node down" not in log and "job expired" not in log
    # Written as Unix time by the clock the directory had: an hour ahead.
    written = json.loads((directory.state_dir / "directory.json").read_text())
    assert [j["spec"]["job_id"] for j in written["jobs"]] == ["busy"]
    assert abs(written["jobs"][0]["last_active"] - (time.time() + HOUR)) < 60


def test_activity_written_in_the_future_reads_back_as_active_at_load() -> None:
    doc = {
        "format": 1,
        "versions": {"nodes": 1, "datasets": 0, "jobs": 1},
        "nodes": [],
        "jobs": [
            {
                "spec": {"job_id": job_id, "dataset": "imgs"},
                "manifest_id": "m1",
                "num_samples": 10,
                "epoch": 0,
                "created": 1.0,
                "started": False,
                "last_active": last_active,
            }
            for job_id, last_active in (("ahead", 5000.0 + HOUR), ("idle", 5000.0 - 2 * HOUR))
        ],
    }
    restarted = DirectoryState.from_json(doc, LEASE, now=100.0, wall=5000.0)  # monotonic 100 is Unix 5000
    assert restarted.expire_jobs(ttl=2 * HOUR + 1, now=100.0) == []
    expired = restarted.expire_jobs(ttl=2 * HOUR, now=100.0)
    assert [(j.spec.job_id, idle) for j, idle in expired] == [("idle", 2 * HOUR)]
    assert [(j.spec.job_id, j.last_active) for j in restarted.jobs()] == [("ahead", 5000.0 + HOUR)]
    assert restarted.expire_jobs(ttl=HOUR, now=100.0 + HOUR - 1) == []
    assert [(j.spec.job_id, idle) for j, idle in restarted.expire_jobs(ttl=HOUR, now=100.0 + HOUR)] == [("ahead", HOUR)]
