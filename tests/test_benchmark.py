"""The benchmarks' own parts: the page-cache stand-in, the shell scripts that
run them on another machine (shellcheck; skipped where it is missing), and
(slow) whole quick runs whose figures must show what the benchmarks claim."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dataquay.server.tools import overflow_stall
from dataquay.server.tools.data_stall import run_benchmark
from dataquay.server.tools.trainers import PageCache

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_the_page_cache_stand_in_keeps_the_most_recent_samples_within_its_budget() -> None:
    cache = PageCache(budget=10)
    cache.put({1: b"aaaa", 2: b"bbbb"})
    assert cache.get([1, 3]) == ({1: b"aaaa"}, [3])  # 1 is now the most recent
    cache.put({3: b"cccc"})  # over budget: 2, the least recent, goes
    assert cache.get([1, 2, 3]) == ({1: b"aaaa", 3: b"cccc"}, [2])
    cache.put({4: b"x" * 11})  # larger than the budget: never held, evicts nothing
    assert cache.get([1, 3, 4]) == ({1: b"aaaa", 3: b"cccc"}, [4])
    assert PageCache(budget=0).get([1]) == ({}, [1])


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_benchmarks_shell_scripts_pass_shellcheck() -> None:
    scripts = sorted(path.name for path in BENCH.glob("*.sh"))
    assert scripts
    result = subprocess.run(["shellcheck", *scripts], cwd=BENCH, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ([], "usage: bench/offline_run.sh WHEELS OUT [SECONDS]"),
        (
            ["{tmp}/no-wheels", "{tmp}/out"],
            "offline_run.sh: no wheels in {tmp}/no-wheels (bench/offline_wheels.sh downloads them)",
        ),
    ],
)
def test_the_offline_run_refuses_bad_arguments_with_one_line(tmp_path: Path, args: list[str], error: str) -> None:
    argv = [arg.format(tmp=tmp_path) for arg in args]
    result = subprocess.run(["bash", str(BENCH / "offline_run.sh"), *argv], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, error.format(tmp=tmp_path) + "\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_quick_run_shows_dataquay_without_stalls_and_the_pfs_bound_baseline_with_them(tmp_path: Path) -> None:
    rows = run_benchmark(samples=768, epochs=2, out_dir=tmp_path, progress=False)
    by = {(r.system, r.epoch): r for r in rows}
    assert by[("direct", 1)].stall_pct > 40 and by[("direct", 1)].pfs_mb > 0
    for mode in ("dataquay partial q=0.1", "dataquay local"):
        assert by[(mode, 1)].pfs_mb == 0 and by[(mode, 1)].peer_mb == 0
    assert json.loads((tmp_path / "stall.json").read_text())["rows"]


@pytest.mark.slow
def test_a_quick_overflow_run_reads_each_overflow_sample_once_an_epoch_and_ahead_of_the_ranks(tmp_path: Path) -> None:
    run = overflow_stall.run_benchmark(samples=512, epochs=2, epoch_seconds=2.0, out_dir=tmp_path, progress=False)
    by = {(r.system, r.epoch): r for r in run.rows}
    overflow = sum(run.overflow_mb_per_node)
    assert run.dataset_over_cached > 1.4
    for epoch in (0, 1):
        ahead, on_demand = by[("dataquay, read ahead", epoch)], by[("dataquay, on demand", epoch)]
        assert ahead.wasted_mb == 0 and ahead.served_ahead_mb > overflow / 2
        assert on_demand.read_ahead_mb == 0 and on_demand.pfs_mb == pytest.approx(overflow, rel=1e-9)
    assert by[("direct", 0)].pfs_mb == pytest.approx(run.dataset_mb, rel=1e-9)
    assert json.loads((tmp_path / "overflow.json").read_text())["rows"]
