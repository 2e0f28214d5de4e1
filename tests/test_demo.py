"""``dataquay demo`` as a user runs it: a 4-node cluster, its report, and the
JSON and plot it leaves, with the stall shown at a real GPU step beside the
loading rate of the short step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataquay.server.tools.demo_report import REAL_STEP, DemoRow, plot, write_json


@pytest.mark.slow  # about 75 s: `make demo` runs the same
def test_demo_reports_the_stall_at_a_real_step_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "demo", "--samples", "800", "--epochs", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    assert "4-node cluster" in text and "--q 0.25" in text and "Q = " not in text
    assert "0.1875 of them leave it" in text
    assert "A real GPU step takes 50-100 ms per batch" in text
    report = json.loads((out / "demo.json").read_text())
    rows = report["rows"]
    assert [r["phase"] for r in rows] == ["global", "global", "global", "partial", REAL_STEP, REAL_STEP, REAL_STEP]
    assert [r["label"] for r in rows] == ["0", "page cache", "PFS", "0", "dataquay 1", "dataquay 2", "PFS"]
    assert all(r["samples"] == 800 for r in rows)
    assert {r["step_ms"] for r in rows if r["phase"] == REAL_STEP} == {75.0}
    # At a real step the PFS read directly waits most of the epoch; dataquay, once started, far less.
    assert rows[-1]["stall_pct"] > 50 > rows[-2]["stall_pct"]


def test_demo_report_round_trips_its_rows_and_plots_both_panels(tmp_path: Path) -> None:
    rows = [
        DemoRow("global", "0", 2.0, 800, 0.5, 0.3, 55.0, 1600.0, 140.0),
        DemoRow("global", "PFS", 2.0, 800, 4.0, 3.9, 97.0, 200.0, 18.0),
        DemoRow(REAL_STEP, "dataquay 1", 75.0, 800, 1.0, 0.01, 1.0, 800.0, 70.0),
        DemoRow(REAL_STEP, "PFS", 75.0, 800, 5.0, 4.6, 92.0, 160.0, 14.0),
    ]
    write_json(tmp_path / "demo.json", {"nodes": 4}, rows)
    back = json.loads((tmp_path / "demo.json").read_text())
    assert back["nodes"] == 4 and [DemoRow(**r) for r in back["rows"]] == rows
    assert plot(rows, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
