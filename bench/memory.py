"""Daemon memory with a 1,000,000-sample dataset registered.

Resident memory is read from /proc: RssAnon is the daemon's own heap; the
manifest is memory-mapped, so its pages count as RssFile (page cache, shared,
reclaimable) and are reported apart.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from common import progress, register, report, stub

from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_npy_dataset

SAMPLES = 1_000_000


def rss(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-mem-") as tmp:
        base = Path(tmp)
        progress(f"writing {SAMPLES} npy records")
        root = make_npy_dataset(base / "pfs", SAMPLES, record_shape=(16,), dtype="float32", files=4)
        daemon = DaemonProcess(base / "node", dataset_roots=(base,)).start()
        assert daemon.ready is not None
        pid = int(daemon.ready["pid"])
        rows.append({"state": "started", **_mib(rss(pid))})
        progress("registering")
        info = register(daemon, "million", root)
        assert info.num_samples == SAMPLES
        rows.append({"state": "1M samples registered", **_mib(rss(pid))})
        ids = np.random.default_rng(0).choice(SAMPLES, size=4096, replace=False)
        for start in range(0, len(ids), 512):
            list(stub(daemon).Read(pb.ReadRequest(dataset="million", ids=ids[start : start + 512].tolist())))
        rows.append({"state": "after 4096 random reads", **_mib(rss(pid))})
        daemon.stop()
        # A fresh daemon loads the registry from disk at start-up.
        daemon = DaemonProcess(base / "node", dataset_roots=(base,)).start()
        assert daemon.ready is not None
        rows.append({"state": "restarted with it registered", **_mib(rss(int(daemon.ready["pid"])))})
        daemon.stop()
    report("daemon_memory", rows, ["state", "RssAnon_MiB", "RssFile_MiB", "VmRSS_MiB"])


def _mib(fields: dict[str, int]) -> dict[str, float]:
    return {f"{k}_MiB": v / (1 << 20) for k, v in fields.items() if k != "RssShmem"}


if __name__ == "__main__":
    main()
