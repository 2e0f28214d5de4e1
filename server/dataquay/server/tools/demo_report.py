"""What ``dataquay demo`` leaves behind: its rows as JSON and, with matplotlib
(an optional extra), a plot of the raw loading rate and of the stall at a
real GPU step."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The phase of the rows read at a real GPU step's pace.
REAL_STEP = "real step"


@dataclass(frozen=True)
class DemoRow:
    """One epoch (or one direct read of an epoch) as the demo measured it."""

    #: ``global``, ``partial`` or ``real step``.
    phase: str
    #: The epoch, or how it was read without dataquay (``page cache``, ``PFS``), or ``dataquay``.
    label: str
    step_ms: float
    samples: int
    #: The slowest rank's wall time, and every rank's mean wait for data, seconds.
    wall_s: float
    wait_s: float
    stall_pct: float
    samples_per_s: float
    mb_per_s: float


def write_json(path: Path, settings: Mapping[str, object], rows: Sequence[DemoRow]) -> None:
    path.write_text(json.dumps({**settings, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")


def plot(rows: Sequence[DemoRow], path: Path) -> bool:
    """Two panels: samples/s at the demo's short step, and stall % at a real
    step; False, writing nothing, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fast = [r for r in rows if r.phase != REAL_STEP]
    real = [r for r in rows if r.phase == REAL_STEP]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [f"{r.phase} {r.label}" if r.label[:1].isdigit() else r.label for r in fast]
    left.bar(
        labels, [r.samples_per_s for r in fast], color=["#1f77b4" if r.label[:1].isdigit() else "#b22222" for r in fast]
    )
    left.set_ylabel("samples/s, all ranks")
    left.set_title(f"loading rate, {fast[0].step_ms:g} ms step (data-bound)" if fast else "", fontsize=9)
    left.tick_params(axis="x", labelrotation=60, labelsize=7)
    right.bar(
        [r.label for r in real],
        [r.stall_pct for r in real],
        color=["#b22222" if r.label == "PFS" else "#2ca02c" for r in real],
    )
    for x, r in enumerate(real):
        right.text(x, r.stall_pct + 1, f"{r.stall_pct:.1f}%\n{r.wall_s:.1f} s", ha="center", fontsize=8)
    right.set_ylim(0, 110)
    right.set_ylabel("stall, % of the epoch waiting for data")
    right.set_title(f"stall at a real GPU step ({real[0].step_ms:g} ms per batch)" if real else "", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
