"""Shared plumbing for the benchmarks: datasets, daemons, timing, reports.

Every figure is a ratio against a baseline measured in the same run on the same
data, so the machine's speed cancels out; each number is the median of
``REPEATS`` timed runs.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import grpc

from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.node.cluster.identity import IDENTITY_FILE
from dataquay.server.tools.processes import DaemonProcess

REPEATS = 3
KiB = 1 << 10
MiB = 1 << 20
SIZES = {"4KiB": 4 * KiB, "110KiB": 110 * KiB, "1MiB": MiB}
#: Where results go: bench/results/, or BENCH_RESULTS (a run on another machine).
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


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


def wipe_cache(cache_dir: Path) -> None:
    """Empties a stopped node's cache dir but for its identity key: the node
    comes back as itself, which the directory lets take its name at once
    (a new key would wait out the old one's lease)."""
    for entry in cache_dir.iterdir():
        if entry.name == IDENTITY_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def machine() -> str:
    """The machine a result was measured on: cores, processor model, Python, kernel."""
    return (
        f"{os.cpu_count()} cores {_processor()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def load_average() -> str:
    """The machine's load averages over 1, 5 and 15 minutes, recorded when a
    run starts and ends: a shared machine's other work moves wall-time ratios."""
    return "load average: " + ", ".join(f"{load:.2f}" for load in os.getloadavg())


def _processor() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model = next((line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    return model or platform.processor() or platform.machine()


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
