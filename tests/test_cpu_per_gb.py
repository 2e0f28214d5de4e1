"""The CPU-per-GB benchmark's own parts: its CPU count (bench/cpu_meter.py)
must include the processes a daemon starts, and a toy run must measure every path and its
baseline on the same bytes, or its ratios say nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SIZE = 110 * 1024


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import cpu_per_gb

        yield cpu_per_gb
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_cpu_seconds_counts_what_a_child_spends_while_its_parent_sleeps(bench: ModuleType) -> None:
    import cpu_meter  # beside the bench, on the path the fixture set

    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}])\ntime.sleep(30)",
        ]
    )
    try:
        before = cpu_meter.cpu_seconds(parent.pid)
        time.sleep(2.5)  # the child has burnt its half second and been reaped by now, even on a loaded machine
        spent = cpu_meter.cpu_seconds(parent.pid) - before
    finally:
        parent.kill()
        parent.wait()
    assert spent >= 0.4


@pytest.mark.long
def test_a_toy_run_measures_every_path_and_its_baseline_on_the_same_bytes(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "PASSES", 8)
    monkeypatch.setattr(bench, "ROUNDS", 2)
    rows = bench.run(tmp_path, 24 << 20, SIZE)
    by = {r["path"]: r for r in rows}
    assert set(by) == {
        "staging",
        "local_hit",
        "local_hit_shm",
        "local_hit_shm_views",
        "peer_hit",
        "peer_hit_views",
        "peer_hit_views_large",
        "raw_lmdb",
        "raw_stream",
        "raw_stream_put",
        "raw_pfs_put",
        "miss",
        "exchange",
        "exchange_steady",
    }
    # Each hit path's rounds are each followed by its baseline's, on the same samples.
    assert by["local_hit"]["MB"] == by["local_hit_shm_views"]["MB"] == pytest.approx(by["raw_lmdb"]["MB"] / 3)
    assert by["peer_hit"]["MB"] == by["peer_hit_views"]["MB"] == by["peer_hit_views_large"]["MB"]
    assert by["peer_hit"]["MB"] == pytest.approx(by["raw_stream"]["MB"] / 3)
    assert by["raw_pfs_put"]["MB"] == pytest.approx(by["staging"]["MB"])
    assert all(len(by[path]["paired_ratios"]) == bench.ROUNDS for path in bench.TARGETS if path in by and "hit" in path)
    assert by["local_hit"]["MB"] + by["peer_hit"]["MB"] == pytest.approx(bench.PASSES * by["staging"]["MB"])
    assert all(float(r["cpu_s"]) >= 0 for r in rows)
    # Over the bytes sent: three exchanges move more than the first alone.
    assert 0 < by["exchange"]["MB"] < by["exchange_steady"]["MB"]
    assert "client_s" not in by["exchange"] and "client_s" in by["peer_hit"]
    ratios = bench.ratios(rows)
    assert [r["path"] for r in ratios] == [*bench.TARGETS, *bench.CONTEXT]
    assert all(r["ratio"] > 0 for r in ratios)
    median = bench.medians([rows, rows, rows])
    assert [r["path"] for r in median] == [r["path"] for r in rows]
