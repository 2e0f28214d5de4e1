"""Shared plumbing for the benchmarks: datasets, daemons, timing, reports.

Every figure is a ratio against a baseline measured in the same run on the same
data, so the machine's speed cancels out; each number is the median of
``REPEATS`` timed runs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import grpc

from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools.processes import DaemonProcess

REPEATS = 3
KiB = 1 << 10
MiB = 1 << 20
SIZES = {"4KiB": 4 * KiB, "110KiB": 110 * KiB, "1MiB": MiB}
RESULTS = Path(__file__).resolve().parent / "results"


def stub(daemon: DaemonProcess) -> cache_pb2_grpc.CacheStub:
    channel = grpc.insecure_channel(grpc_target(daemon.address), options=channel_options())
    return cache_pb2_grpc.CacheStub(channel)


def register(daemon: DaemonProcess, name: str, root: Path, replace: bool = False) -> pb.DatasetInfo:
    return stub(daemon).AddDataset(pb.AddDatasetRequest(name=name, root=str(root), replace=replace))


def stage(daemon: DaemonProcess, name: str) -> pb.StageProgress:
    *_, last = stub(daemon).Stage(pb.StageRequest(dataset=name))
    if last.error:
        raise RuntimeError(f"staging {name} failed: {last.error}")
    return last


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores {cpu}, Python {platform.python_version()}, {platform.system()} {platform.release()}"


def report(
    name: str, rows: list[dict[str, object]], columns: list[str], extra: dict[str, object] | None = None
) -> None:
    """Prints a table and writes it as JSON under bench/results/ (if it has rows),
    with ``extra`` (say, the machine's load) beside the rows."""
    if not rows:
        return
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(w) for c, w in zip(columns, widths)))
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": name, "machine": machine(), "argv": sys.argv, **(extra or {}), "rows": rows}
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return "" if value is None else str(value)


def progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def back_free_memory(gib: int = 6) -> None:
    """Touches ``gib`` GiB in a child process that then exits, leaving that much
    free memory the hypervisor has already backed.

    On a virtual machine the first touch of guest memory the host has not
    backed yet costs several times the copy into it (a 256 MiB LMDB write
    here: 430-830 MB/s into such memory, 1.9-2.5 GB/s after this). A run
    that happens to get fresh memory and one that reuses freed pages would
    then compare the VM, not the code; calling this before every timed run
    gives both sides of a ratio the same kind of memory. On bare metal it
    changes nothing.
    """
    subprocess.run([sys.executable, "-c", f"import numpy; numpy.ones({gib} << 27)"], check=True)
