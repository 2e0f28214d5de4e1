"""What storing new bytes in the page cache costs on memory the host has not
backed yet, against memory just freed: the bound the exchange's receiver
meets on a virtual machine.

A store that takes in N new bytes takes N bytes of new page cache. On a VM
whose guest hands freed memory back to the host (free page reporting; this
one boots with ``page_reporting.page_reporting_order=11``), memory may come
back to the guest untouched, and a first write into it may cost the host a
fault. A raw TCP stream into one reused buffer never meets that.

Per round, in this process: 256 MiB of 1 MiB values written into a new file
allocated ahead (``fallocate``), once as copies into a shared map of it (as
LMDB writes with ``writemap``) and once with ``pwrite``; first on whatever
memory the kernel hands out after a pause (what earlier rounds freed has
gone back to the host by then), then again right after deleting such a
file (its pages are reused before they are reported). GB/s of payload,
median of the rounds.
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import MiB, progress, report

TOTAL = 256 * MiB
VALUE = MiB
ROUNDS = 3
#: Longer than the kernel's delay before it reports freed pages (2 s).
SETTLE_SECONDS = 5.0


def _mapped(path: Path, value: bytes) -> float:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, TOTAL)
    started = time.perf_counter()
    with mmap.mmap(fd, TOTAL) as mapped:
        for offset in range(0, TOTAL, VALUE):
            mapped[offset : offset + VALUE] = value
    elapsed = time.perf_counter() - started
    os.close(fd)
    return TOTAL / elapsed / 1e9


def _written(path: Path, value: bytes) -> float:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, TOTAL)
    started = time.perf_counter()
    for offset in range(0, TOTAL, VALUE):
        os.pwrite(fd, value, offset)
    elapsed = time.perf_counter() - started
    os.close(fd)
    return TOTAL / elapsed / 1e9


def main() -> None:
    value = os.urandom(VALUE)
    rates: dict[str, list[float]] = {name: [] for name in ("mmap_new", "mmap_reused", "pwrite_new", "pwrite_reused")}
    with tempfile.TemporaryDirectory(prefix="dq-bench-first-touch-") as tmp:
        base = Path(tmp)
        for round_ in range(ROUNDS):
            progress(f"round {round_ + 1} of {ROUNDS}")
            for name, write in (("mmap", _mapped), ("pwrite", _written)):
                time.sleep(SETTLE_SECONDS)
                rates[f"{name}_new"].append(write(base / "new", value))
                (base / "new").unlink()  # its pages are free, not yet reported
                rates[f"{name}_reused"].append(write(base / "reused", value))
                (base / "reused").unlink()
    gbps = {name: float(statistics.median(values)) for name, values in rates.items()}
    row: dict[str, object] = {**gbps, "rounds": rates}
    for name in ("mmap", "pwrite"):
        row[f"{name}_reused_over_new"] = gbps[f"{name}_reused"] / gbps[f"{name}_new"]
    report(
        "first_touch",
        [row],
        ["mmap_new", "mmap_reused", "mmap_reused_over_new", "pwrite_new", "pwrite_reused", "pwrite_reused_over_new"],
    )


if __name__ == "__main__":
    main()
