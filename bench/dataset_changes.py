"""PFS bytes a changed dataset restages: a realistic change (1% of the files
modified, 1% appended) registered again with ``dataset add --replace``.

The baseline, measured in the same run on the same changed files, is what
restaging read before the cache kept unchanged samples: the whole dataset
(a fresh registration of the changed root, which shares no cache). Each row
is one sample size; the numbers are PFS bytes and seconds of the staging
after the change.

    python bench/dataset_changes.py [--files N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import KiB, progress, register, report, stage

from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

#: Fraction of the files modified, and appended, by the change.
CHANGED = 0.01
SIZES = {"16KiB": 16 * KiB, "110KiB": 110 * KiB}


def change(root: Path, fraction: float, size: int) -> tuple[int, int]:
    """Rewrites every 1/fraction-th file (new bytes, same size, new mtime) and
    appends as many new files; returns (files modified, files appended)."""
    files = sorted(root.rglob("*.bin"))
    step = round(1 / fraction)
    modified = files[::step]
    for path in modified:
        path.write_bytes(os.urandom(size))
        os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    for i in range(len(modified)):
        (root / "class_000" / f"appended-{i:06d}.bin").write_bytes(os.urandom(size))
    return len(modified), len(modified)


def run(files: int, label: str, size: int, base: Path) -> dict[str, object]:
    root = make_files_dataset(base / label / "pfs", files, sizes=(size,), classes=10)
    daemon = DaemonProcess(base / label / "node", dataset_roots=(base,)).start()
    try:
        register(daemon, "ds", root)
        first = stage(daemon, "ds")
        modified, appended = change(root, CHANGED, size)
        started = time.perf_counter()
        register(daemon, "ds", root, replace=True)
        kept = stage(daemon, "ds")
        kept_seconds = time.perf_counter() - started
        started = time.perf_counter()
        register(daemon, "fresh", root)
        fresh = stage(daemon, "fresh")
        fresh_seconds = time.perf_counter() - started
    finally:
        daemon.stop()
    return {
        "sample": label,
        "files": files,
        "modified": modified,
        "appended": appended,
        "first_stage_pfs_bytes": first.read_bytes,
        "restage_pfs_bytes": kept.read_bytes,
        "restage_seconds": round(kept_seconds, 2),
        "restage_skipped": kept.skipped_samples,
        "baseline_pfs_bytes": fresh.read_bytes,
        "baseline_seconds": round(fresh_seconds, 2),
        "pfs_bytes_saved": fresh.read_bytes - kept.read_bytes,
        "saved_fraction": round(1 - kept.read_bytes / fresh.read_bytes, 4),
        "ideal_pfs_bytes": (modified + appended) * size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000, help="files in the dataset (default 2000)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="dq-bench-changes-"))
    rows = []
    try:
        for label, size in SIZES.items():
            progress(f"{args.files} files of {label}: stage, change 1% + append 1%, restage")
            rows.append(run(args.files, label, size, base))
    finally:
        shutil.rmtree(base)
    report(
        "dataset_changes",
        rows,
        [
            "sample",
            "files",
            "modified",
            "appended",
            "restage_pfs_bytes",
            "ideal_pfs_bytes",
            "baseline_pfs_bytes",
            "saved_fraction",
            "restage_seconds",
            "baseline_seconds",
        ],
    )


if __name__ == "__main__":
    main()
