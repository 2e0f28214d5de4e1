"""Read paths through the client against raw baselines in the same process.

local: ``ds.get_batch`` of 64 random ids, all cached, against a raw py-lmdb
loop over the same environment doing the same work: it gets the batch's 64
values into a list (as get_batch returns them) and computes the xxh3 of each
(get only when verification is off). Both run in this process, taking
turns, each opening the environment and warming it before its timed run.

miss: ``ds.get_batch`` of 64 ids that no cache holds (the client reads the
files itself and its daemon caches them behind it), against this process
reading the same files directly with open().read(). Twice: with the files in
the page cache for both, and with them out of it for both (cold, read from
the disk as a PFS client reads from the servers). After each timed run of
the miss path, the daemon's caching behind is waited for (and timed): every
sample must be cached, once, and read back from the page cache, not the disk.
Warm, two bounds besides: the direct loop keeping each batch's 64 payloads
in a list until the next batch (as a trainer holds what ``get_batch``
returns, where the plain loop reuses one buffer), and the miss path with
this process's notices to the daemon switched off (the client's read path
alone, nothing cached behind).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lmdb
import numpy as np
from common import REPEATS, SIZES, MiB, back_free_memory, load_average, progress, register, report, stage, stub

from dataquay.client import Client, Dataset, connect
from dataquay.client.malloc import tune_malloc
from dataquay.client.wire.records import checksum, sample_key
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

BATCH = 64
LOCAL_BYTES = 256 * MiB
MISS_BYTES = 192 * MiB
#: Warm timed runs of each kind per round: one reads 192 MiB in 20-40 ms at
#: 110 KiB and 1 MiB, so a single one is at the mercy of the scheduler.
WARM_PASSES = 3
#: Passes over the cached samples per timed local run: long enough that a
#: daemon's background work landing in one run does not decide its rate.
LOCAL_PASSES = 3


def _rate(run, units: int) -> float:  # type: ignore[no-untyped-def]
    import time

    started = time.perf_counter()
    run()
    return units / (time.perf_counter() - started)


def _median(values: list[float]) -> float:
    return float(np.median(values))


def bench_local(daemon: DaemonProcess, root: Path, count: int, label: str) -> dict[str, object]:
    register(daemon, "local", root)
    stage(daemon, "local")
    info = stub(daemon).GetDataset(pb.GetDatasetRequest(name="local"))
    rng = np.random.default_rng(0)
    order = rng.permutation(count)
    batches = [order[i : i + BATCH] for i in range(0, count - BATCH + 1, BATCH)]
    keys = [[sample_key(int(i)) for i in b] for b in batches]
    total = len(batches) * BATCH

    def raw(verify: bool) -> float:
        env = lmdb.open(str(daemon.cache_dir), readonly=True, lock=True, max_dbs=8)
        db = env.open_db(info.cache_db.encode(), create=False)

        def run() -> None:
            for batch in keys:
                with env.begin(db=db) as txn:
                    values = [txn.get(k) for k in batch]
                    if verify:
                        for value in values:
                            checksum(memoryview(value)[8:])

        run()  # warm
        rate = _rate(lambda: [run() for _ in range(LOCAL_PASSES)], LOCAL_PASSES * total)
        env.close()
        return rate

    def through_client(verify: bool) -> float:
        client = connect(daemon.address, verify=verify)
        get_batch = client.dataset("local").get_batch

        def run() -> None:
            for b in batches:
                get_batch(b)

        run()  # warm
        rate = _rate(lambda: [run() for _ in range(LOCAL_PASSES)], LOCAL_PASSES * total)
        assert client.stats().samples["local"] == (1 + LOCAL_PASSES) * total, "reads were not all local hits"
        client.close()
        return rate

    # Raw and client runs take turns, so that both see the same machine; one
    # environment at a time, as py-lmdb allows per process.
    rates: dict[tuple[str, bool], list[float]] = {}
    for _ in range(REPEATS):
        for verify in (True, False):
            for name, measure in (("raw", raw), ("client", through_client)):
                rates.setdefault((name, verify), []).append(measure(verify))
    raw_verify, raw_plain = _median(rates["raw", True]), _median(rates["raw", False])
    rows = {verify: _median(rates["client", verify]) for verify in (True, False)}
    return {
        "size": label,
        "raw_get_xxh3_per_s": raw_verify,
        "client_verified_per_s": rows[True],
        "verified_ratio": rows[True] / raw_verify,
        "raw_get_per_s": raw_plain,
        "client_unverified_per_s": rows[False],
        "unverified_ratio": rows[False] / raw_plain,
    }


def bench_miss(daemon: DaemonProcess, base: Path, size: int, label: str) -> dict[str, object]:
    count = MISS_BYTES // size
    root = make_files_dataset(base / f"miss-{label}", count, sizes=(size,))
    register(daemon, "miss", root)
    manifest_paths = sorted(str(p) for p in root.rglob("*.bin"))
    rng = np.random.default_rng(1)
    rates: dict[str, list[float]] = {
        key: [] for key in ("direct", "miss", "direct_cold", "miss_cold", "direct_batch", "miss_alone")
    }
    behind: dict[str, list[float]] = {"": [], "_cold": []}
    passed_on = {"": [0, 0], "_cold": [0, 0]}  # samples handed over, samples whose notice was lost
    client = connect(daemon.address)
    for _ in range(REPEATS):
        for cold in [False] * WARM_PASSES + [True]:
            order = rng.permutation(count)
            batches = [order[i : i + BATCH] for i in range(0, count - BATCH + 1, BATCH)]
            total = len(batches) * BATCH
            suffix = "_cold" if cold else ""

            def direct() -> None:
                for b in batches:
                    for i in b:
                        with open(manifest_paths[i], "rb") as f:
                            f.read()

            def direct_batch() -> None:
                for b in batches:
                    batch = []
                    for i in b:
                        with open(manifest_paths[i], "rb") as f:
                            batch.append(f.read())

            prepare(manifest_paths, cold)
            rates["direct" + suffix].append(_rate(direct, total))
            if not cold:
                prepare(manifest_paths, cold)
                rates["direct_batch"].append(_rate(direct_batch, total))
                rates["miss_alone"].append(_miss_alone(daemon, client, root, manifest_paths, batches, total))
            stub(daemon).DropDataset(pb.DropDatasetRequest(name="miss"))
            register(daemon, "miss", root)
            ds = client.dataset("miss")
            before = client.stats().samples["pfs"]
            daemon_before = stub(daemon).Stats(pb.StatsRequest())
            dropped_before = client.remote.notices.dropped
            prepare(manifest_paths, cold)
            rates["miss" + suffix].append(_rate(lambda: _read_batches(ds, batches), total))
            assert client.stats().samples["pfs"] - before == total, "reads were not all misses"
            seconds, handed, lost = _cached_behind(daemon, client, ds, batches, total, daemon_before, dropped_before)
            behind[suffix].append(seconds)
            passed_on[suffix][0] += handed
            passed_on[suffix][1] += lost
    client.close()
    row: dict[str, object] = {"size": label}
    for key in ("direct_batch", "miss_alone"):
        row[f"{key}_per_s"] = _median(rates[key])
        row[f"{key}_ratio"] = _median(rates[key]) / _median(rates["direct"])
    for suffix in ("", "_cold"):
        direct_rate, miss_rate = _median(rates["direct" + suffix]), _median(rates["miss" + suffix])
        row |= {
            f"direct_read{suffix}_per_s": direct_rate,
            f"miss_path{suffix}_per_s": miss_rate,
            f"miss{suffix}_ratio": miss_rate / direct_rate,
            f"cached_behind{suffix}_seconds": _median(behind[suffix]),
            f"handed_over{suffix}_samples": passed_on[suffix][0],
            f"lost_notices{suffix}_samples": passed_on[suffix][1],
        }
    return row


def _read_batches(ds: Dataset, batches: list[np.ndarray]) -> None:
    """Reads the batches in turn, holding one at a time, as a trainer does (and
    as the direct loop holds one file): keeping every batch would time the
    first touch of a fresh page for every byte read."""
    for b in batches:
        ds.get_batch(b)


def _miss_alone(
    daemon: DaemonProcess, client: Client, root: Path, paths: list[str], batches: list[np.ndarray], total: int
) -> float:
    """Misses per second of the client's read path alone: this process sends
    no notice, so nothing is cached behind it."""
    stub(daemon).DropDataset(pb.DropDatasetRequest(name="miss"))
    register(daemon, "miss", root)
    ds = client.dataset("miss")
    notices = client.remote.notices
    before = client.stats().samples["pfs"]
    prepare(paths, False)
    notices.note = lambda *args: None  # type: ignore[method-assign]
    try:
        rate = _rate(lambda: _read_batches(ds, batches), total)
    finally:
        del notices.note
    assert client.stats().samples["pfs"] - before == total, "reads were not all misses"
    return rate


def _cached_behind(
    daemon: DaemonProcess,
    client: Client,
    ds: Dataset,
    batches: list[np.ndarray],
    count: int,
    before: pb.StatsReply,
    dropped_before: int,
) -> tuple[float, int, int]:
    """(seconds until the daemon cached what the timed run read, samples the
    client handed over, samples whose notice was lost). Checks that each was
    cached once without a PFS read, then reads the run's ids once more: the
    lost ones go through the daemon, which caches them, so every sample is
    cached afterwards."""
    import time

    started = time.perf_counter()
    client.remote.notices.flush(300)
    lost = client.remote.notices.dropped - dropped_before
    while _cached(daemon) < count - lost:
        if time.perf_counter() - started > 300:
            raise RuntimeError("the daemon did not cache the samples read in 300 s")
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    after = stub(daemon).Stats(pb.StatsRequest())
    cached = {
        f: getattr(after.cache_behind, f) - getattr(before.cache_behind, f)
        for f in ("page_cache_samples", "handed_samples")
    }
    assert sum(cached.values()) == count - lost, f"{cached} cached behind the reads of {count} ({lost} lost)"
    assert after.pfs_bytes == before.pfs_bytes, "the daemon read the PFS"
    if lost:
        for b in batches:
            ds.get_batch(b)
    while _cached(daemon) < count:
        if time.perf_counter() - started > 300:
            raise RuntimeError("the samples whose notice was lost were not cached by the next read")
        time.sleep(0.05)
    return seconds, cached["handed_samples"], lost


def _cached(daemon: DaemonProcess) -> int:
    return int(stub(daemon).GetDataset(pb.GetDatasetRequest(name="miss")).cached_samples)


def prepare(paths: list[str], cold: bool) -> None:
    """Backs free memory, then takes the files out of the page cache (``cold``,
    as a PFS serves them: from its servers) or reads them into it."""
    back_free_memory()
    if cold:
        os.sync()
    for path in paths:
        if cold:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        else:
            with open(path, "rb") as f:
                f.read()


def main() -> None:
    tune_malloc()
    wanted = os.environ.get("BENCH_SIZES", ",".join(SIZES)).split(",")
    parts = os.environ.get("BENCH_PARTS", "local,miss").split(",")
    local_rows, miss_rows = [], []
    loads = [load_average()]
    with tempfile.TemporaryDirectory(prefix="dq-bench-reads-") as tmp:
        base = Path(tmp)
        for label, size in SIZES.items():
            if label not in wanted:
                continue
            daemon = DaemonProcess(base / f"node-{label}", dataset_roots=(base,)).start()
            if "local" in parts:
                count = LOCAL_BYTES // size
                progress(f"{label}: local hits over {count} cached samples")
                root = make_files_dataset(base / f"local-{label}", count, sizes=(size,))
                local_rows.append(bench_local(daemon, root, count, label))
            if "miss" in parts:
                progress(f"{label}: misses")
                miss_rows.append(bench_miss(daemon, base, size, label))
            daemon.stop()
    loads.append(load_average())
    report(
        "local_hits",
        local_rows,
        [
            "size",
            "raw_get_xxh3_per_s",
            "client_verified_per_s",
            "verified_ratio",
            "raw_get_per_s",
            "client_unverified_per_s",
            "unverified_ratio",
        ],
    )
    report(
        "miss_path",
        miss_rows,
        [
            "size",
            "direct_read_per_s",
            "miss_path_per_s",
            "miss_ratio",
            "direct_read_cold_per_s",
            "miss_path_cold_per_s",
            "miss_cold_ratio",
            "cached_behind_seconds",
            "cached_behind_cold_seconds",
            "handed_over_samples",
            "handed_over_cold_samples",
            "lost_notices_samples",
            "lost_notices_cold_samples",
            "direct_batch_per_s",
            "direct_batch_ratio",
            "miss_alone_per_s",
            "miss_alone_ratio",
        ],
        extra={"load_average": loads},
    )


if __name__ == "__main__":
    main()
