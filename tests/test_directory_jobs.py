"""Jobs that end: a real `dataquay directory` drops jobs idle past --job-ttl,
and `dataquay job prune` drops the ones idle past what the operator names,
never one that became active since it was listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.processes import DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

Stub = directory_pb2_grpc.DirectoryStub
HOUR = 3600.0
DAY = 86400.0


@pytest.fixture
def imgs(tmp_path: Path) -> Path:
    return make_files_dataset(tmp_path / "pfs" / "imgs", 10, sizes=(100,), classes=2)


def create_jobs(stub: Stub, imgs: Path, *job_ids: str) -> None:
    node = jpb.NodeInfo(name="n0", tcp_address="127.0.0.1:7000")
    stub.RegisterNode(dpb.RegisterNodeRequest(node=node, identity_key=bytes(32)))
    stub.AddDataset(pb.AddDatasetRequest(name="imgs", root=str(imgs)))
    for job_id in job_ids:
        stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job_id, dataset="imgs")))


def job_ids(stub: Stub) -> list[str]:
    return [job.spec.job_id for job in stub.ListJobs(jpb.ListJobsRequest()).jobs]


def age_jobs(directory: DirectoryProcess, idle: dict[str, float]) -> None:
    """Rewrites the stopped directory's state so that each named job was last
    active that many seconds ago."""
    path = directory.state_dir / "directory.json"
    doc = json.loads(path.read_text())
    for job in doc["jobs"]:
        if (seconds := idle.get(job["spec"]["job_id"])) is not None:
            job["last_active"] = time.time() - seconds
    path.write_text(json.dumps(doc))


def metrics(directory: DirectoryProcess) -> dict[str, float]:
    with urllib.request.urlopen(directory.http_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def run_cli(*args: str, directory: DirectoryProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DATAQUAY_DIRECTORY": directory.address},
    )


def test_a_job_idle_past_the_ttl_expires_and_one_reporting_epochs_is_kept(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub], imgs: Path
) -> None:
    directory = start_directory("--job-ttl", "2s")
    stub = stub_for(directory)
    create_jobs(stub, imgs, "busy", "idle")
    # The busy job reports on all through the checks: a CLI that takes seconds
    # to start on a loaded machine must not outlast its TTL.
    checked = threading.Event()

    def report_busy() -> None:
        while not checked.wait(0.2):
            stub.ReportEpoch(jpb.ReportEpochRequest(job_id="busy", epoch=1))

    reporter = threading.Thread(target=report_busy)
    reporter.start()
    try:
        wait_until(lambda: job_ids(stub) == ["busy"], "the idle job expired")
        listed = run_cli("job", "ls", directory=directory)
        assert listed.returncode == 0, listed.stderr
        assert [line.split()[0] for line in listed.stdout.splitlines()] == ["JOB", "busy"]
        assert metrics(directory)["dataquay_directory_jobs"] == 1
        assert metrics(directory)["dataquay_directory_jobs_expired_total"] == 1
    finally:
        checked.set()
        reporter.join()
    assert directory.stop() == 0
    expired = [line for line in directory.log_path.read_text().splitlines() if "job expired" in line]
    assert len(expired) == 1 and "job expired job=idle idle_seconds=" in expired[0]


def test_a_restart_expires_jobs_idle_past_the_ttl(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub], imgs: Path
) -> None:
    first = start_directory("--job-ttl", "0")
    create_jobs(stub_for(first), imgs, "old", "recent")
    assert first.stop() == 0
    age_jobs(first, {"old": 2 * DAY, "recent": HOUR})

    second = start_directory("--job-ttl", "1d")
    stub = stub_for(second)
    wait_until(lambda: "old" not in job_ids(stub), "the job idle for two days expired")
    assert job_ids(stub) == ["recent"]
    jobs = {job.spec.job_id: job for job in stub.ListJobs(jpb.ListJobsRequest()).jobs}
    assert time.time() - jobs["recent"].last_active_unix >= HOUR
    assert (metrics(second)["dataquay_directory_jobs"], metrics(second)["dataquay_directory_jobs_expired_total"]) == (
        1,
        1,
    )

    # The log line may reach the file a moment after the job left the table.
    def expired() -> list[str]:
        return [line for line in second.log_path.read_text().splitlines() if "job expired" in line]

    wait_until(expired, "the expiry was logged")
    assert len(expired()) == 1 and "job expired job=old idle_seconds=1728" in expired()[0]


def test_prune_lists_with_dry_run_then_drops_only_jobs_idle_that_long(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub], imgs: Path
) -> None:
    first = start_directory()
    create_jobs(stub_for(first), imgs, "a-old", "b-recent", "c-older")
    assert first.stop() == 0
    age_jobs(first, {"a-old": 3 * HOUR, "b-recent": 60.0, "c-older": 2 * DAY})
    directory = start_directory()
    stub = stub_for(directory)

    rows = run_cli("job", "ls", directory=directory).stdout.splitlines()
    listed = {row.split()[0]: row.split()[-1] for row in rows}
    assert (listed["JOB"], listed["a-old"], listed["c-older"]) == ("IDLE", "3h0m", "2d0h")
    shown = run_cli("job", "show", "a-old", directory=directory).stdout.splitlines()
    assert any(line.startswith("last active") and "(idle 3h0m;" in line for line in shown)

    dry = run_cli("job", "prune", "--idle", "2h", "--dry-run", directory=directory)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "would drop job 'a-old' (idle 3h0m)",
        "would drop job 'c-older' (idle 2d0h)",
        "2 job(s) idle for 2h or longer; none dropped (--dry-run)",
    ]
    assert job_ids(stub) == ["a-old", "b-recent", "c-older"]

    pruned = run_cli("job", "prune", "--idle", "2h", directory=directory)
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.splitlines() == [
        "dropped job 'a-old' (idle 3h0m)",
        "dropped job 'c-older' (idle 2d0h)",
        "dropped 2 job(s) idle for 2h or longer",
    ]
    assert job_ids(stub) == ["b-recent"]
    assert metrics(directory)["dataquay_directory_jobs"] == 1
    assert metrics(directory)["dataquay_directory_jobs_expired_total"] == 0


def test_a_drop_on_condition_of_idleness_keeps_a_job_active_since(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub], imgs: Path
) -> None:
    directory = start_directory()
    stub = stub_for(directory)
    create_jobs(stub, imgs, "j1")
    stub.ReportEpoch(jpb.ReportEpochRequest(job_id="j1", epoch=0))
    with pytest.raises(grpc.RpcError) as refused:
        stub.DropJob(jpb.DropJobRequest(job_id="j1", min_idle_seconds=HOUR))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "less than the 3600s idle asked for" in refused.value.details()
    with pytest.raises(grpc.RpcError) as bad:
        stub.DropJob(jpb.DropJobRequest(job_id="j1", min_idle_seconds=-1))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert job_ids(stub) == ["j1"]
    stub.DropJob(jpb.DropJobRequest(job_id="j1"))
    assert job_ids(stub) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("job", "prune", "--idle", "soon"), "--idle: bad duration 'soon': expected a duration like"),
        (("job", "prune", "--idle", "0"), "--idle: '0' would take every job"),
        (
            ("directory", "--job-ttl", "a week", "--state-dir", "{tmp}"),
            "--job-ttl: bad duration 'a week': expected a duration like",
        ),
    ],
)
def test_a_bad_duration_is_one_line_and_exit_code_1(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *(arg.format(tmp=tmp_path) for arg in args)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DATAQUAY_DIRECTORY": "127.0.0.1:1"},
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
