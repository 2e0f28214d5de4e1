"""One small node cache shared by datasets over many simulated days: the
daemon runs under libfaketime, whose Unix clock the test steps a day at a
time. What no live job pins and no one used for --evict-min-age gives way to
a staging that needs room, least recently used first; the Stage reply says
so before anything is read; the operator lists, pins and evicts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from one_daemon import cache_stub, cached_samples, daemon_stats
from polling import wait_until
from stepped_clock import SteppedClock, needs_faketime

from dataquay.client.placement import initial_owners
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess
from dataquay.server.tools.synthetic import make_files_dataset

DAY = 86400
SAMPLE = 32 * 1024
SAMPLES = 48
#: Three datasets fit, a fourth does not.
CACHE = "6M"
AGED = ("--evict-min-age", "1d")


@pytest.fixture
def clock(tmp_path: Path) -> SteppedClock:
    return SteppedClock(tmp_path / "faketime")


@pytest.fixture
def node(tmp_path: Path, clock: SteppedClock) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(
        tmp_path / "node",
        ("--cache-size", CACHE, "--evict-min-age", "1d"),
        prefix=clock.prefix(),
        dataset_roots=(tmp_path,),
    ).start()
    try:
        yield daemon
    finally:
        daemon.kill()


def register(daemon: DaemonProcess, tmp_path: Path, *names: str) -> None:
    with cache_stub(daemon) as stub:
        for seed, name in enumerate(names):
            root = make_files_dataset(tmp_path / "pfs" / name, SAMPLES, sizes=(SAMPLE,), seed=seed, classes=2)
            stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root)))


def stage(daemon: DaemonProcess, name: str) -> tuple[pb.StageProgress, pb.StageProgress]:
    """The first and the last report of a staging run."""
    with cache_stub(daemon) as stub:
        reports = list(stub.Stage(pb.StageRequest(dataset=name)))
    first, last = reports[0], reports[-1]
    assert last.finished and not last.error, last.error
    return first, last


def evicted(progress: pb.StageProgress) -> list[tuple[str, bool]]:
    return [(",".join(e.datasets), e.whole) for e in progress.evictions]


def read_all(daemon: DaemonProcess, name: str) -> int:
    with cache_stub(daemon) as stub:
        return sum(len(c.samples) for c in stub.Read(pb.ReadRequest(dataset=name, ids=range(SAMPLES))))


@needs_faketime
def test_over_simulated_days_the_least_recently_used_dataset_gives_way(
    tmp_path: Path, node: DaemonProcess, clock: SteppedClock
) -> None:
    register(node, tmp_path, "a", "b", "c", "d")
    for day, name in enumerate(("a", "b", "c")):
        clock.step(day * DAY)
        first, _ = stage(node, name)
        assert evicted(first) == [] and first.admission_fit_bytes == first.admission_need_bytes > SAMPLES * SAMPLE
    clock.step(5 * DAY)
    assert read_all(node, "a") == SAMPLES  # a is used again: b is now the oldest

    clock.step(9 * DAY)
    first, last = stage(node, "d")
    assert evicted(first) == [("b", False)]  # only the room d needs, from the least recently used
    assert first.admission_fit_bytes == first.admission_need_bytes and not last.cache_full
    assert [cached_samples(node, n) for n in "acd"] == [SAMPLES] * 3
    assert 0 < cached_samples(node, "b") < SAMPLES

    clock.step(9 * DAY + DAY // 2)
    first, last = stage(node, "b")  # d is younger than --evict-min-age; c, unused 7 days, goes
    assert evicted(first) == [("c", False)] and not last.cache_full
    assert [cached_samples(node, n) for n in "abd"] == [SAMPLES] * 3
    assert cached_samples(node, "c") < SAMPLES
    held = {",".join(h.datasets): h for h in daemon_stats(node).cache_holdings}
    assert held["b"].samples == SAMPLES and held["b"].bytes == SAMPLES * SAMPLE


@needs_faketime
def test_without_room_to_evict_admission_says_what_will_not_fit(
    tmp_path: Path, node: DaemonProcess, clock: SteppedClock
) -> None:
    register(node, tmp_path, "a", "b", "c", "d")
    for name in "abc":
        stage(node, name)
    clock.step(DAY // 2)  # every dataset used within --evict-min-age
    first, last = stage(node, "d")
    assert evicted(first) == [] and first.admission_fit_bytes < first.admission_need_bytes
    assert last.cache_full and [cached_samples(node, n) for n in "abc"] == [SAMPLES] * 3


@needs_faketime
def test_the_operator_pins_lists_and_evicts_with_a_dry_run_first(
    tmp_path: Path, node: DaemonProcess, clock: SteppedClock
) -> None:
    register(node, tmp_path, "a", "b", "c", "d")
    for name in "abc":
        stage(node, name)

    def cli(*args: str, command: str = "cache") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dataquay.server.cli", command, *args, "--addr", node.address],
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert cli("pin", "a").returncode == 0
    clock.step(3 * DAY)
    listed = cli("ls")
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if line.startswith("a "))
    assert row[-1] == "operator" and row[2] == str(SAMPLES)
    status = cli(command="status")
    shown = next(line.split() for line in status.stdout.splitlines() if line.startswith("a "))
    assert status.returncode == 0 and (shown[:4], shown[-2:]) == (row[:4], row[-2:])
    dry = cli("evict", "--dry-run")
    assert [line.split(":")[0] for line in dry.stdout.splitlines()] == ["would evict b", "would evict c"]
    assert [cached_samples(node, n) for n in "abc"] == [SAMPLES] * 3
    refused = cli("evict", "a")
    assert refused.returncode == 1 and "pinned by operator" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    done = cli("evict", "b")
    assert done.returncode == 0 and done.stdout.startswith("evicted b:")
    assert [cached_samples(node, n) for n in "abc"] == [SAMPLES, 0, SAMPLES]
    first, last = stage(node, "d")
    assert evicted(first) == [] and not last.cache_full  # the room b left is enough
    with cache_stub(node) as stub:
        reply = stub.ManageCache(pb.ManageCacheRequest(action="evict", dry_run=True))
    assert [",".join(e.datasets) for e in reply.evictions] == ["c"]


@needs_faketime
def test_a_live_jobs_dataset_is_never_evicted_however_long_unused(
    tmp_path: Path, clock: SteppedClock, stub_for: Callable[[DirectoryProcess], directory_pb2_grpc.DirectoryStub]
) -> None:
    directory = DirectoryProcess(tmp_path / "directory", dataset_roots=(tmp_path,)).start()
    daemon = DaemonProcess(
        tmp_path / "node",
        ("--directory", directory.address, "--node-name", "n0", "--cache-size", CACHE, "--evict-min-age", "1d"),
        prefix=clock.prefix(),
        dataset_roots=(tmp_path,),
    )
    try:
        daemon.start()
        register(daemon, tmp_path, "a", "b", "c", "d")
        jobs = stub_for(directory)
        jobs.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="train-a", dataset="a", nodes=["n0"])))
        for day, name in enumerate("abc"):
            clock.step(day * DAY)
            stage(daemon, name)
        wait_until(lambda: pinned(daemon) == {"a": ("train-a",)}, "the daemon sees the job")

        clock.step(30 * DAY)  # a, staged first and never read, is the least recently used
        staged = subprocess.run(
            [
                sys.executable,
                "-m",
                "dataquay.server.cli",
                "stage",
                "d",
                "--job",
                "train-d",
                "--nodes",
                "n0",
                "--quiet",
                "--directory",
                directory.address,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert staged.returncode == 0, staged.stderr
        row = next(line.split() for line in staged.stdout.splitlines() if line.startswith("n0 "))
        assert row[1] == f"{SAMPLES}/{SAMPLES}" and row[-3:] == ["(b)", "0", "ok"]  # EVICTED, FOR OTHERS, STATUS
        assert cached_samples(daemon, "a") == SAMPLES
        assert 0 < cached_samples(daemon, "b") < SAMPLES

        jobs.DropJob(jpb.DropJobRequest(job_id="train-a"))
        wait_until(lambda: pinned(daemon) == {"d": ("train-d",)}, "the daemon sees the job end")
        first, _ = stage(daemon, "b")
        assert evicted(first) == [("a", False)]  # d is pinned by train-d
    finally:
        daemon.kill()
        directory.kill()


def pinned(daemon: DaemonProcess) -> dict[str, tuple[str, ...]]:
    return {",".join(h.datasets): tuple(h.pinned_by) for h in daemon_stats(daemon).cache_holdings if h.pinned_by}


def test_what_no_live_job_holds_here_gives_way_oldest_first_and_never_what_a_job_reads(
    tmp_path: Path, stub_for: Callable[[DirectoryProcess], directory_pb2_grpc.DirectoryStub]
) -> None:
    # a and b were staged whole on n0; then jobs on n0 and n1 pin them, and
    # their placements give n0 about half of each. Every holding is used
    # within --evict-min-age, so only those halves can make room for d.
    directory = DirectoryProcess(tmp_path / "directory", dataset_roots=(tmp_path,)).start()
    daemon, other = (
        DaemonProcess(
            tmp_path / name,
            ("--directory", directory.address, "--node-name", name, "--cache-size", CACHE, *AGED, "--heal-after", "0"),
            dataset_roots=(tmp_path,),
        )
        for name in ("n0", "n1")
    )
    try:
        daemon.start()
        other.start()
        register(daemon, tmp_path, "a", "b", "c", "d")
        for name in "abc":
            stage(daemon, name)
        jobs = stub_for(directory)
        for name in "ab":
            spec = jpb.JobSpec(job_id=f"train-{name}", dataset=name, nodes=["n0", "n1"])
            jobs.JoinJob(jpb.JoinJobRequest(spec=spec))
        wait_until(lambda: pinned(daemon) == {"a": ("train-a",), "b": ("train-b",)}, "the daemon sees the jobs")
        mine = {name: np.flatnonzero(initial_owners(SAMPLES, ["n0", "n1"], "sample", None, name) == 0) for name in "ab"}
        assert 0 < len(mine["a"]) < SAMPLES

        first, last = stage(daemon, "d")
        # The samples n1 holds for the jobs make the room: all of a's, the
        # older, then what d still needs of b's.
        assert evicted(first) == [("a", False), ("b", False)] and not last.cache_full
        assert first.admission_fit_bytes == first.admission_need_bytes
        assert [cached_samples(daemon, n) for n in "acd"] == [len(mine["a"]), SAMPLES, SAMPLES]
        assert len(mine["b"]) <= cached_samples(daemon, "b") < SAMPLES
        held = {",".join(h.datasets): h for h in daemon_stats(daemon).cache_holdings}
        assert held["a"].bytes == len(mine["a"]) * SAMPLE
        # What the jobs read on n0 is all there: reading it costs no PFS byte.
        before = daemon_stats(daemon).pfs_bytes
        with cache_stub(daemon) as stub:
            for name in "ab":
                ids = mine[name].tolist()
                assert sum(len(c.samples) for c in stub.Read(pb.ReadRequest(dataset=name, ids=ids))) == len(ids)
        assert daemon_stats(daemon).pfs_bytes == before
    finally:
        daemon.kill()
        other.kill()
        directory.kill()
