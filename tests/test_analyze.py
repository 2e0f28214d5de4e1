"""The stall analyzer: its arithmetic with exact numbers, its measurement on
loaders whose read, prep and step costs are known, and ``dataquay analyze``
against a real daemon.

Loaders that read and prepare in the calling thread run on a virtual clock
that only their sleeps move, so the stalls measured come out exact however
busy the machine is. The threaded loader needs real parallel time: that test
checks which stall dominates and ratios with wide margins, with costs of tens
of milliseconds so that scheduling noise (a few ms) stays small beside them,
and waits rather than burns the CPU (a busy loop on a loaded machine takes as
long as the scheduler makes it, which is not the cost a test means to set).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dataquay.analyze import (
    RunTiming,
    StallReport,
    UnfitLoaderError,
    cache_bytes_needed,
    fetch_stall_with_cache,
    format_report,
    measure,
    stall_seconds,
    sweep_prep_stall,
    workers_needed,
)
from dataquay.client.errors import UnknownDatasetError
from dataquay.server.cli import analyze
from dataquay.server.cli import main as cli_main
from dataquay.server.cli.common import CliError
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

READ_S, PREP_S, STEP_S = 0.040, 0.020, 0.010
STEPS, WARMUP = 15, 1
BATCHES = STEPS + WARMUP


def step(batch: object) -> None:
    time.sleep(STEP_S)


class KnownCostStorage:
    """Batches whose first read waits ``read_s`` (a cold PFS) and whose later reads are free (a warm cache)."""

    def __init__(self, read_s: float) -> None:
        self.read_s = read_s
        self._read: set[int] = set()
        self._lock = threading.Lock()

    def read(self, index: int) -> int:
        with self._lock:
            cold = index not in self._read
            self._read.add(index)
        if cold:
            time.sleep(self.read_s)
        return index


class SerialLoader:
    """Reads and prepares each batch in the calling thread: one prep worker."""

    def __init__(self, storage: KnownCostStorage, prep_s: float) -> None:
        self.storage = storage
        self.prep_s = prep_s

    def __iter__(self) -> Iterator[int]:
        for index in range(BATCHES):
            batch = self.storage.read(index)
            time.sleep(self.prep_s)
            yield batch


class ThreadedLoader:
    """Reads and prepares batches on ``workers`` threads, all batches queued at once."""

    def __init__(self, storage: KnownCostStorage, prep_s: float, workers: int) -> None:
        self.storage = storage
        self.prep_s = prep_s
        self.workers = workers

    def _load(self, index: int) -> int:
        batch = self.storage.read(index)
        time.sleep(self.prep_s)
        return batch

    def __iter__(self) -> Iterator[int]:
        with ThreadPoolExecutor(self.workers) as pool:
            yield from pool.map(self._load, range(BATCHES))


def timing(seconds_per_step: float, step_fn_per_step: float = 0.01, steps: int = 10) -> RunTiming:
    total = seconds_per_step * steps
    return RunTiming(steps, total, total - step_fn_per_step * steps, step_fn_per_step * steps)


# ------------------------------------------------------------------ arithmetic


def test_stall_seconds_are_differences_of_the_runs_and_never_negative() -> None:
    assert stall_seconds(0.010, 0.030, 0.070) == pytest.approx((0.020, 0.040))
    assert stall_seconds(0.010, 0.009, 0.020) == pytest.approx((0.0, 0.010))
    assert stall_seconds(0.010, 0.030, 0.025) == (pytest.approx(0.020), 0.0)


def test_workers_needed_is_prep_over_step_rounded_up() -> None:
    assert workers_needed(0.020, 0.010) == 2
    assert workers_needed(0.021, 0.010) == 3
    assert workers_needed(0.3, 0.1) == 3
    assert workers_needed(0.001, 0.010) == 1
    assert workers_needed(0.0, 0.010) == 1
    with pytest.raises(ValueError, match="positive step time"):
        workers_needed(0.02, 0.0)


def test_cache_bytes_needed_is_the_working_set() -> None:
    assert cache_bytes_needed(4096, 1000) == 4_096_000
    assert cache_bytes_needed(110.5, 3) == 332
    assert cache_bytes_needed(4096, 0) == 0
    with pytest.raises(ValueError, match="sample_bytes"):
        cache_bytes_needed(-1, 10)


def test_a_partial_cache_leaves_the_uncached_share_of_the_fetch_stall() -> None:
    assert fetch_stall_with_cache(0.020, 50, 100) == pytest.approx(0.010)
    assert fetch_stall_with_cache(0.020, 0, 100) == pytest.approx(0.020)
    assert fetch_stall_with_cache(0.020, 200, 100) == 0.0
    assert fetch_stall_with_cache(0.020, 50, 0) == 0.0


def test_report_from_fixed_timings() -> None:
    report = StallReport(
        synthetic=timing(0.010),
        warm=timing(0.030),
        cold=timing(0.070),
        loader_alone=timing(0.0105),
        workers=2,
        samples_per_batch=32,
        sample_bytes=4096,
        epoch_samples=1000,
        cache_bytes=1_024_000,
        cpus=64,
    )
    assert report.prep_stall_seconds == pytest.approx(0.020)
    assert report.fetch_stall_seconds == pytest.approx(0.040)
    assert report.share(report.fetch_stall_seconds) == pytest.approx(4 / 7)
    assert report.prep_seconds_per_batch == pytest.approx(0.021)
    assert report.workers_needed == 3
    assert report.cache_bytes_needed == 4_096_000
    assert report.fetch_stall_with_cache_seconds == pytest.approx(0.030)
    assert report.samples_per_second(report.synthetic) == pytest.approx(3200)
    assert report.warnings == ()

    document = json.loads(json.dumps(report.to_dict()))
    assert sum(document["percent"].values()) == pytest.approx(100)
    assert document["prep"]["workers_needed"] == 3
    assert document["cache"]["cache_bytes_needed"] == 4_096_000

    text = format_report(report)
    assert "40.0 ms fetch stall (57 %)" in text
    assert "a cache of 3.9 MiB removes it" in text
    assert "prep workers needed to keep up with the step: 3 " in text


def test_a_sweep_stalls_on_k_times_the_prep_alone_and_once_coordinated() -> None:
    assert sweep_prep_stall(0.040, 0.010, cpus=2, jobs=4) == pytest.approx((0.070, 0.010))
    assert sweep_prep_stall(0.010, 0.010, cpus=4, jobs=2) == (0.0, 0.0)
    with pytest.raises(ValueError, match="at least one CPU and job"):
        sweep_prep_stall(0.01, 0.01, cpus=2, jobs=0)
    report = StallReport(
        synthetic=timing(0.010),
        warm=timing(0.030),
        cold=timing(0.030),
        loader_alone=timing(0.020),
        workers=2,
        cpus=2,
        sweep_jobs=4,
    )
    assert report.sweep_prep_stall_seconds == pytest.approx((0.070, 0.010))
    assert report.to_dict()["sweep"]["prep_cpu_seconds_per_step_independent"] == pytest.approx(0.160)
    assert (
        "a sweep of 4 jobs on this node (2 CPUs): prep stall 70.0 ms/step per job with independent loaders, "
        "10.0 ms with coordinated prep (ds.coordinated), which saves 60.0 ms/step"
    ) in format_report(report)


def test_report_without_a_fetch_stall_needs_no_cache_and_warns_of_doubtful_runs() -> None:
    report = StallReport(
        synthetic=timing(0.010, step_fn_per_step=0.010),
        warm=timing(0.030, step_fn_per_step=0.025),
        cold=timing(0.0301, step_fn_per_step=0.010),
        loader_alone=timing(0.050, step_fn_per_step=0.0),
        sample_bytes=4096,
        epoch_samples=1000,
        cpus=2,
    )
    assert report.cache_bytes_needed == 0
    assert "negligible, no cache needed" in format_report(report)
    assert report.workers_needed == 5
    drift, cpus = report.warnings
    assert "25.0 ms per step in the warm run but 10.0 ms in the synthetic run" in drift
    assert "5 prep workers but this process may use 2 CPUs" in cpus


# ---------------------------------------------------------------- measurement


class VirtualClock:
    """Time that passes only when a read, a prep or a step sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def virtual_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaders, the step and :func:`measure` on one :class:`VirtualClock`."""
    clock = VirtualClock()
    monkeypatch.setattr(sys.modules[__name__], "time", clock)
    monkeypatch.setattr(sys.modules["dataquay.analyze.measure"], "time", clock)


def under_load(check: Callable[[], None], tries: int = 3) -> None:
    """Runs a timed check up to ``tries`` times: a burst of load on a shared
    machine can spoil one measurement, a wrong attribution fails them all."""
    for left in reversed(range(tries)):
        try:
            check()
            return
        except AssertionError:
            if not left:
                raise


@pytest.mark.usefixtures("virtual_time")
def test_slow_reads_show_as_a_fetch_stall_larger_than_the_prep_stall() -> None:
    report = measure(
        SerialLoader(KnownCostStorage(READ_S), PREP_S),
        STEPS,
        step,
        warmup=WARMUP,
        samples_per_batch=32,
        sample_bytes=4096,
        epoch_samples=10_000,
    )
    assert report.fetch_stall_seconds == pytest.approx(READ_S), format_report(report)
    assert report.prep_stall_seconds == pytest.approx(PREP_S), format_report(report)
    assert report.step_seconds == pytest.approx(STEP_S), format_report(report)
    assert report.synthetic.steps_per_second > report.warm.steps_per_second > report.cold.steps_per_second
    assert 2 <= report.workers_needed <= 3, format_report(report)
    assert report.cache_bytes_needed == 4096 * 10_000


@pytest.mark.usefixtures("virtual_time")
def test_free_reads_show_no_fetch_stall() -> None:
    report = measure(SerialLoader(KnownCostStorage(0.0), PREP_S), STEPS, step, warmup=WARMUP)
    assert report.fetch_stall_seconds == pytest.approx(0.0, abs=1e-12), format_report(report)
    assert report.prep_stall_seconds == pytest.approx(PREP_S), format_report(report)


def test_parallel_workers_hide_prep_and_the_estimate_counts_per_worker() -> None:
    # Four workers ready a batch every 5 ms, inside the 10 ms step: no prep
    # stall, though one worker alone would need two steps' time for a batch.
    workers = 4

    def check() -> None:
        report = measure(
            lambda: ThreadedLoader(KnownCostStorage(0.0), PREP_S, workers), STEPS, step, warmup=WARMUP, workers=workers
        )
        assert report.prep_stall_seconds < 0.4 * report.step_seconds, format_report(report)
        assert 0.5 * PREP_S < report.prep_seconds_per_batch < 2.5 * PREP_S, format_report(report)
        assert 2 <= report.workers_needed <= 4, format_report(report)

    under_load(check)


@pytest.mark.usefixtures("virtual_time")
def test_a_given_cold_loader_replaces_the_first_pass() -> None:
    report = measure(
        SerialLoader(KnownCostStorage(0.0), 0.0),
        STEPS,
        step,
        warmup=WARMUP,
        cold_loader=SerialLoader(KnownCostStorage(READ_S), 0.0),
    )
    assert report.fetch_stall_seconds == pytest.approx(READ_S), format_report(report)
    assert report.prep_stall_seconds == pytest.approx(0.0, abs=1e-12), format_report(report)


def test_measure_refuses_loaders_it_cannot_read_as_asked() -> None:
    with pytest.raises(UnfitLoaderError, match="one-shot iterator"):
        measure(iter(range(100)), 5, step)
    with pytest.raises(UnfitLoaderError, match="ran out after 3 batches; a run reads warmup \\+ steps = 7"):
        measure([0, 1, 2], 5, step)
    with pytest.raises(ValueError, match="steps >= 1"):
        measure([0], 0, step)


# ------------------------------------------------------------------------ CLI


def analyze_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dataquay")
    analyze.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["analyze", *argv])


def test_cli_analyzes_a_dataset_cold_from_the_pfs_and_warm_through_the_daemon(
    daemon: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_files_dataset(tmp_path / "pfs", 64, sizes=(4096,))
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", daemon.address]) == 0
    capsys.readouterr()
    common = (
        "imgs",
        "--addr",
        daemon.address,
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--step-ms",
        "2",
        "--prep-ms",
        "1",
        "--workers",
        "2",
        "--cache-bytes",
        "128K",
    )

    args = analyze_args(*common, "--json")
    args.func(args)
    document = json.loads(capsys.readouterr().out)
    assert document["inputs"]["dataset"] == "imgs"
    assert {name: run["steps"] for name, run in document["runs"].items()} == {
        "synthetic": 4,
        "warm": 4,
        "cold": 4,
        "loader_alone": 4,
    }
    assert document["samples_per_batch"] == 8
    assert document["prep"]["workers"] == 2
    assert document["cache"]["working_set_bytes"] == 64 * 4096
    assert document["cache"]["cache_bytes"] == 128 << 10
    assert not [w for w in document["warnings"] if "came from the PFS" in w]

    args = analyze_args(*common)
    args.func(args)
    text = capsys.readouterr().out
    assert "dataset 'imgs': 5 batches of 8 random samples" in text
    assert "fetch stall" in text and "prep stall" in text

    with pytest.raises(UnknownDatasetError):
        args = analyze_args("nope", "--addr", daemon.address, "--batch-size", "8", "--step-ms", "2")
        args.func(args)


def test_cli_analyzes_a_loader_named_by_its_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "analyze_known_loader.py").write_text("def make():\n    return [b'x' * 16] * 6\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = analyze_args("--loader", "analyze_known_loader:make", "--steps", "4", "--step-ms", "1", "--json")
    args.func(args)
    document = json.loads(capsys.readouterr().out)
    assert document["runs"]["cold"]["steps"] == 4
    assert document["cache"]["working_set_bytes"] is None

    with pytest.raises(CliError, match="one of --step-ms or --step-fn"):
        args = analyze_args("--loader", "analyze_known_loader:make")
        args.func(args)
    with pytest.raises(CliError, match="ran out after 6 batches"):
        args = analyze_args("--loader", "analyze_known_loader:make", "--steps", "10", "--step-ms", "1")
        args.func(args)
    with pytest.raises(CliError, match="has no missing"):
        args = analyze_args("--loader", "analyze_known_loader:missing", "--step-ms", "1")
        args.func(args)
    with pytest.raises(CliError, match="name a dataset or give --loader"):
        args = analyze_args("imgs", "--loader", "analyze_known_loader:make", "--step-ms", "1")
        args.func(args)
