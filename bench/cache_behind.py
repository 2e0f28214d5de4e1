"""How fast a daemon caches behind its trainers, by where the bytes come from.

A trainer that read its misses from the PFS names them to its daemon
(``CacheBehind``). The daemon reads them back from the page cache, or, where
the page cache no longer holds them (taken out here with
``POSIX_FADV_DONTNEED`` between the trainer's read and the notice), the
client hands them over through its shared-memory segment. Both are timed from
the first notice until the daemon's cache holds every sample, against the
trainer's own read of the same files (the rate the caching must keep up
with); each sample must be cached once, and the PFS never read again.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPEATS, SIZES, MiB, back_free_memory, progress, register, report, stub

from dataquay.client import connect, page_cache
from dataquay.client.malloc import tune_malloc
from dataquay.client.pfs import PfsReader
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

#: Within what a client's backlog holds for handing over (64 MiB).
DATASET_BYTES = 48 * MiB
BATCH = 64


def _cached_bytes(paths: list[Path]) -> int | None:
    """The bytes of ``paths`` the page cache holds; None where the kernel will not say."""
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            held = page_cache.cached_pages(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if held is None:
            return None
        total += held * page_cache.PAGE
    return total


def _evict(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def bench(daemon: DaemonProcess, base: Path, size: int, label: str) -> dict[str, object]:
    count = DATASET_BYTES // size
    root = make_files_dataset(base / f"behind-{label}", count, sizes=(size,))
    paths = sorted(root.rglob("*.bin"))
    client = connect(daemon.address)
    rates: dict[str, list[float]] = {"read": [], "page_cache": [], "handed": []}
    read_back: list[int | None] = []
    handed_shares: list[float] = []
    for _ in range(REPEATS):
        for source in ("page_cache", "handed"):
            if any(d.name == "behind" for d in stub(daemon).ListDatasets(pb.ListDatasetsRequest()).datasets):
                stub(daemon).DropDataset(pb.DropDatasetRequest(name="behind"))
            register(daemon, "behind", root)
            ds = client.dataset("behind")
            reader = PfsReader(ds.manifest, "behind", confined=False)
            ids = np.random.default_rng(0).permutation(count)
            back_free_memory()
            started = time.perf_counter()
            read = [(b, reader.read(b)) for b in np.array_split(ids, max(1, count // BATCH))]
            rates["read"].append(count / (time.perf_counter() - started))
            if source == "handed":
                _evict(paths)
            before = stub(daemon).Stats(pb.StatsRequest()).cache_behind
            started = time.perf_counter()
            for batch, payloads in read:
                client.remote.notices.note("behind", ds.manifest.manifest_id, batch, payloads)
            while stub(daemon).GetDataset(pb.GetDatasetRequest(name="behind")).cached_samples < count:
                if time.perf_counter() - started > 300:
                    raise RuntimeError(f"{source}: the daemon did not cache {count} samples in 300 s")
                time.sleep(0.02)
            rates[source].append(count / (time.perf_counter() - started))
            after = stub(daemon).Stats(pb.StatsRequest())
            got = {
                s: getattr(after.cache_behind, f"{s}_samples") - getattr(before, f"{s}_samples")
                for s in ("page_cache", "handed")
            }
            assert sum(got.values()) == count and got[source] >= 0.9 * count, f"{source}: {got} of {count}"
            assert after.pfs_bytes == 0, "the daemon read the PFS"
            if source == "handed":
                handed_shares.append(got["handed"] / count)
                read_back.append(_cached_bytes(paths))
    client.close()
    read_rate = float(np.median(rates["read"]))
    row: dict[str, object] = {"size": label, "trainer_read_per_s": read_rate}
    for source in ("page_cache", "handed"):
        rate = float(np.median(rates[source]))
        row |= {f"cached_from_{source}_per_s": rate, f"{source}_vs_read": rate / read_rate}
    row |= {"handed_share": min(handed_shares), "read_back_MiB": None if None in read_back else max(read_back) / MiB}
    return row


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dq-bench-behind-") as tmp:
        base = Path(tmp)
        daemon = DaemonProcess(base / "node", dataset_roots=(base,)).start()
        try:
            for label, size in SIZES.items():
                if label in wanted:
                    progress(f"{label}: caching behind a trainer")
                    rows.append(bench(daemon, base, size, label))
        finally:
            daemon.stop()
    report(
        "cache_behind",
        rows,
        [
            "size",
            "trainer_read_per_s",
            "cached_from_page_cache_per_s",
            "page_cache_vs_read",
            "cached_from_handed_per_s",
            "handed_vs_read",
            "handed_share",
            "read_back_MiB",
        ],
    )


if __name__ == "__main__":
    main()
