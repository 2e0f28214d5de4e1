"""The daemon's peak memory during one Read, against the bytes the Read asks for.

A files dataset of 2 MiB samples, staged once; each case starts a daemon of
its own on that cache (memory an earlier case freed would stay in the
allocator and hide the next one's growth). Just before the call the daemon's
peak resident size (VmHWM) is reset through /proc/PID/clear_refs; the growth
is the peak during the call minus the resident size before it. Cache pages
the daemon maps count in its resident size too; they are page cache, not the
daemon's heap, and are reported apart (RssFile growth). Cases:

- repeats, cached: one Read of ``REPEATS`` copies of one cached sample id,
  inline (no shared memory), the case of a client without shared memory; and the same with
  ``MAX_REPEATS`` copies (the daemon's --max-batch), which grew the daemon by
  about 16 GB before calls were bounded.
- distinct, cached: one Read of ``DISTINCT`` different cached samples, inline.
- repeats, PFS: as the first, of a sample no cache holds (the daemon reads
  it from the files).
- repeats, PFS, client: ``get_batch`` through the client (shared memory) of
  ``REPEATS`` copies of a sample no cache holds.
- large repeats, cached and PFS: one Read of ``LARGE_REPEATS`` copies of a
  sample of ``LARGE_BYTES``, larger than a gRPC message (it comes in pieces).

Every reply is checked byte for byte. ``python bench/experiments/call_memory.py LABEL``
writes bench/results/call_memory-LABEL.json; ``BENCH_SKIP`` names cases to
leave out, separated by ";" (the max-batch one takes 16 GB of a daemon that
does not bound its calls).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import MiB, progress, register, report, stage, stub

from dataquay.client import connect
from dataquay.client.wire.pieces import Joiner
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

SAMPLE_BYTES = 2 * MiB
REPEATS = 600
MAX_REPEATS = 4096
DISTINCT = 256
LARGE_BYTES = 70 * MiB
LARGE_REPEATS = 12


def status(pid: int, key: str) -> int:
    """A /proc/PID/status figure in bytes (VmHWM, VmRSS, RssFile)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise KeyError(key)


def measure(pid: int, case: str, ids: list[int], size: int, read: Callable[[], Iterable[bytes]]) -> dict[str, object]:
    want = {i: sample_bytes(0, i, size) for i in set(ids)}
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before, mapped = status(pid, "VmRSS"), status(pid, "RssFile")
    started = time.perf_counter()
    count = 0
    for position, data in enumerate(read()):
        assert data == want[ids[position]], f"{case}: wrong bytes at position {position}"
        count += 1
    seconds = time.perf_counter() - started
    growth = status(pid, "VmHWM") - before
    mapped = status(pid, "RssFile") - mapped
    assert count == len(ids), f"{case}: {count} samples for {len(ids)} ids"
    return {
        "case": case,
        "ids": len(ids),
        "sample_MiB": size / MiB,
        "requested_MiB": len(ids) * size / MiB,
        "peak_growth_MiB": growth / MiB,
        "mapped_cache_MiB": mapped / MiB,
        "seconds": seconds,
    }


@contextmanager
def inline(daemon: DaemonProcess, dataset: str, ids: list[int]) -> Iterator[Callable[[], Iterable[bytes]]]:
    """One Read through a plain stub: every payload inline (pieces joined), checked as it arrives."""

    def read() -> Iterator[bytes]:
        joiner = Joiner("the daemon")
        for chunk in stub(daemon).Read(pb.ReadRequest(dataset=dataset, ids=ids)):
            if chunk.HasField("piece"):
                p = chunk.piece
                whole = joiner.add(p.id, p.offset, p.length, p.data, p.length)
                if whole is not None:
                    yield whole
                continue
            for sample in chunk.samples:
                yield sample.data

    yield read


@contextmanager
def through_client(daemon: DaemonProcess, dataset: str, ids: list[int]) -> Iterator[Callable[[], Iterable[bytes]]]:
    """``get_batch`` through the client: payloads through its shared memory."""
    with connect(daemon.address) as client:
        ds = client.dataset(dataset)
        yield lambda: ds.get_batch(ids)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    rows = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-callmem-") as tmp:
        base = Path(tmp)
        daemon = DaemonProcess(base / "node", dataset_roots=(base,)).start()
        for name, count, size in (
            ("mem", DISTINCT, SAMPLE_BYTES),
            ("cold", 2, SAMPLE_BYTES),
            ("large", 1, LARGE_BYTES),
            ("large-cold", 1, LARGE_BYTES),
        ):
            register(daemon, name, make_files_dataset(base / name, count, sizes=(size,), classes=1))
        progress("staging")
        stage(daemon, "mem")
        stage(daemon, "large")
        daemon.stop()
        cases = [
            ("repeats, cached", "mem", [0] * REPEATS, SAMPLE_BYTES, inline),
            ("max-batch repeats, cached", "mem", [0] * MAX_REPEATS, SAMPLE_BYTES, inline),
            ("distinct, cached", "mem", list(range(DISTINCT)), SAMPLE_BYTES, inline),
            ("repeats, PFS", "cold", [0] * REPEATS, SAMPLE_BYTES, inline),
            ("repeats, PFS, client", "cold", [1] * REPEATS, SAMPLE_BYTES, through_client),
            ("large repeats, cached", "large", [0] * LARGE_REPEATS, LARGE_BYTES, inline),
            ("large repeats, PFS", "large-cold", [0] * LARGE_REPEATS, LARGE_BYTES, inline),
        ]
        skip = set(os.environ.get("BENCH_SKIP", "").split(";"))
        for case, dataset, ids, size, how in cases:
            if case in skip:
                continue
            progress(case)
            # A daemon of its own per case: memory freed by an earlier case
            # stays in the allocator and would hide this one's growth.
            daemon = DaemonProcess(base / "node", dataset_roots=(base,)).start()
            assert daemon.ready is not None
            with how(daemon, dataset, ids) as read:
                rows.append(measure(int(daemon.ready["pid"]), case, ids, size, read))
            daemon.stop()
    name = f"call_memory-{label}" if label else "call_memory"
    report(name, rows, ["case", "ids", "sample_MiB", "requested_MiB", "peak_growth_MiB", "mapped_cache_MiB", "seconds"])


if __name__ == "__main__":
    main()
