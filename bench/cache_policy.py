"""Cache policy: the daemon's insert-once cache against an LRU of the same capacity.

The daemon's cache follows the "MinIO" policy: a sample is inserted once and
never evicted for capacity; once full, misses are served from the PFS. The
usual alternative, LRU, evicts the least recently used sample to make room for
each miss. Training reads every sample once per epoch in a fresh random
order, so a sample's next use is on average an epoch away; with a dataset
larger than the cache, LRU has usually evicted it by then, while the
insert-once cache keeps whatever it holds and hits it in every epoch.

This measures both on a dataset twice the capacity, over the same access
sequence (a fresh permutation per epoch, read in batches), both starting cold,
so epoch 0 is all compulsory misses on either side:

- insert once: a real daemon with ``--cache-size``, read through the client;
  hits are the client's ``local`` and ``cache`` reads, misses its
  ``pfs`` reads. LMDB stores a value in whole pages, so the samples the cache
  actually holds (its effective capacity) are counted, not assumed.
- LRU: :class:`~dataquay.server.tools.lru_baseline.LruCache`, LMDB plus an LRU
  index capped at the same capacity in payload bytes, reading misses from the
  dataset's files. Counting payload bytes spares it LMDB's page overhead, so
  it holds more samples than the daemon does: the comparison favours LRU.

Expected, for a capacity fraction c: insert once hits c in every epoch after
the first. LRU hits a sample only if fewer than c·D other samples were read
since its last use; with independent uniform permutations that is
c + (1 - c)·ln(1 - c) of the reads (15.3% for c = 1/2).

Writes bench/results/cache_policy.{json,md,png} (``--quick``: a smaller run,
written as cache_policy-quick.*).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import RESULTS, KiB, MiB, progress, register, report, stub

from dataquay.client import connect
from dataquay.client.manifest import Manifest
from dataquay.client.pfs import PfsReader
from dataquay.client.wire.records import CHECKSUM_BYTES
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools.lru_baseline import LruCache, expected_lru_hit_fraction
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

SAMPLE_BYTES = 64 * KiB
EPOCHS = 5
BATCH = 64
SEED = 6
DATASET = "policy"
REPO = Path(__file__).resolve().parents[1]
#: How long the cache must stay unchanged before the daemon's writer counts as drained.
SETTLE_SECONDS = 0.3
LMDB_PAGE_BYTES = 4096
#: What LMDB puts in front of a value stored in overflow pages.
LMDB_OVERFLOW_HEADER_BYTES = 16


@dataclass(frozen=True)
class Setup:
    """One run's sizes: the dataset is ``num_samples`` of SAMPLE_BYTES each."""

    cache_bytes: int
    num_samples: int

    @property
    def dataset_bytes(self) -> int:
        return self.num_samples * SAMPLE_BYTES


FULL = Setup(cache_bytes=64 * MiB, num_samples=2048)
QUICK = Setup(cache_bytes=16 * MiB, num_samples=512)


@dataclass(frozen=True)
class InsertOnceRun:
    """What the daemon did: hits per epoch and what its cache held after each."""

    hits: list[int]
    cached_samples: list[int]
    cache_used_bytes: int
    cache_full: bool
    manifest: Manifest


def epoch_orders(num_samples: int, epochs: int, seed: int) -> list[np.ndarray]:
    """A fresh uniform permutation of the dataset per epoch."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(num_samples) for _ in range(epochs)]


def batches(order: np.ndarray) -> list[list[int]]:
    return [order[start : start + BATCH].tolist() for start in range(0, len(order), BATCH)]


def wait_for_writer(cache: cache_pb2_grpc.CacheStub, timeout: float = 60.0) -> pb.StatsReply:
    """The daemon's stats once its writer has drained: inserts are queued and
    committed in the background, and the next epoch must see the cache they leave."""
    deadline = time.monotonic() + timeout
    last = cache.Stats(pb.StatsRequest())
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < SETTLE_SECONDS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon's cache kept changing for {timeout:.0f} s")
        time.sleep(0.05)
        now = cache.Stats(pb.StatsRequest())
        if now.cache_entries != last.cache_entries:
            stable_since = time.monotonic()
        last = now
    return last


def run_insert_once(root: Path, home: Path, setup: Setup, orders: list[np.ndarray]) -> InsertOnceRun:
    """The orders read through the client from a real daemon with a cold cache of ``setup.cache_bytes``."""
    daemon = DaemonProcess(home, ("--cache-size", str(setup.cache_bytes)), dataset_roots=(root,)).start()
    try:
        register(daemon, DATASET, root)
        daemon_stub = stub(daemon)
        client = connect(daemon.address)
        try:
            dataset = client.dataset(DATASET)
            hits: list[int] = []
            cached: list[int] = []
            before = client.stats().samples
            for epoch, order in enumerate(orders):
                for ids in batches(order):
                    dataset.get_batch(ids)
                after = client.stats().samples
                delta = {tier: after[tier] - before[tier] for tier in after}
                before = after
                if delta["peer"] or delta["fallback"]:
                    raise RuntimeError(f"epoch {epoch} read from tiers a lone daemon should not use: {delta}")
                hits.append(delta["local"] + delta["cache"])
                stats = wait_for_writer(daemon_stub)
                cached.append(stats.cache_entries)
                progress(f"insert once, epoch {epoch}: {hits[-1]} hits, {stats.cache_entries} cached")
            manifest = Manifest(bytes(dataset.manifest.data))
        finally:
            client.close()
        return InsertOnceRun(hits, cached, stats.cache_used_bytes, stats.cache_full, manifest)
    finally:
        daemon.stop()


def run_lru(manifest: Manifest, path: Path, capacity: int, orders: list[np.ndarray]) -> list[int]:
    """Hits per epoch of :class:`LruCache` over the same orders, misses read from the files."""
    pfs = PfsReader(manifest, DATASET)
    hits: list[int] = []
    with LruCache(path, capacity) as cache:
        for epoch, order in enumerate(orders):
            epoch_hits = 0
            for ids in batches(order):
                _, batch_hits = cache.read_batch(ids, pfs.read)
                epoch_hits += batch_hits
            hits.append(epoch_hits)
            progress(f"LRU, epoch {epoch}: {epoch_hits} hits, {len(cache.keys())} cached")
    return hits


def host() -> dict[str, str]:
    """nproc, the CPU model, the kernel and Python: the machine line of the report."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def plot(minio_pct: list[float], lru_pct: list[float], capacity_pct: float, lru_capacity_pct: float, out: Path) -> bool:
    """Hit ratio per epoch of both policies, capacity fractions dashed; False
    (with a note) when matplotlib is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = list(range(len(minio_pct)))
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot(epochs, minio_pct, "o-", label="insert once (dataquay daemon)")
    ax.plot(epochs, lru_pct, "s-", label="LRU, same capacity")
    ax.axhline(capacity_pct, linestyle="--", color="grey", label=f"daemon's effective capacity ({capacity_pct:.1f}%)")
    if abs(lru_capacity_pct - capacity_pct) >= 0.5:
        ax.axhline(lru_capacity_pct, linestyle=":", color="grey", label=f"LRU's capacity ({lru_capacity_pct:.1f}%)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("hit ratio, % of reads")
    ax.set_xticks(epochs)
    ax.set_ylim(0, 100)
    ax.set_title("Dataset = 2x cache, random permutation per epoch")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def markdown(
    rows: list[dict[str, object]],
    setup: Setup,
    run: InsertOnceRun,
    lru_capacity_samples: int,
    command: str,
    wall_seconds: float,
    load_average: float,
    plotted: bool,
    name: str,
) -> str:
    """The section for docs/results.md."""
    machine = host()
    effective = run.cached_samples[0]
    nominal = setup.cache_bytes // SAMPLE_BYTES
    c = effective / setup.num_samples
    c_lru = lru_capacity_samples / setup.num_samples
    p = expected_lru_hit_fraction(c_lru)
    noise = 100 * math.sqrt(p * (1 - p) / setup.num_samples)
    setting = (
        f"A files dataset of {setup.num_samples:,} samples of {SAMPLE_BYTES // KiB} KiB "
        f"({setup.dataset_bytes / MiB:.0f} MiB), a cache of {setup.cache_bytes / MiB:.0f} MiB, "
        f"{len(rows)} epochs, each a fresh random permutation read in batches of {BATCH}; both caches start "
        "cold and see the same sequence. **Insert once**: a real daemon (`--cache-size "
        f"{setup.cache_bytes // MiB}M`) read through the client; hits are its `local` + `cache` reads. "
        "**LRU**: LMDB plus an LRU index (`LruCache` of `dataquay.server.tools.lru_baseline`) capped at the same "
        "bytes of payload, misses read from the files."
    )
    pages = math.ceil((SAMPLE_BYTES + CHECKSUM_BYTES + LMDB_OVERFLOW_HEADER_BYTES) / LMDB_PAGE_BYTES)
    capacity = (
        f"Effective capacity: the daemon's cache filled at {effective:,} samples "
        f"({run.cache_used_bytes / MiB:.1f} MiB of LMDB map), not the nominal {nominal:,} "
        f"({setup.cache_bytes / MiB:.0f} MiB / {SAMPLE_BYTES // KiB} KiB): "
        f"{100 * effective / nominal:.1f}% of it, a capacity fraction of {100 * c:.1f}% "
        f"rather than {100 * nominal / setup.num_samples:.1f}%. LMDB stores a large value in whole "
        f"{LMDB_PAGE_BYTES // KiB} KiB overflow pages behind a {LMDB_OVERFLOW_HEADER_BYTES}-byte header, and "
        f"the daemon frames each sample with a checksum of {CHECKSUM_BYTES} bytes, so a {SAMPLE_BYTES // KiB} KiB "
        f"sample takes {pages} pages. The LRU counts payload bytes only and holds {lru_capacity_samples:,} "
        f"samples ({100 * c_lru:.1f}%): the comparison favours it. The daemon's cache held "
        f"{' / '.join(f'{n:,}' for n in run.cached_samples)} samples after each epoch."
    )
    expectation = (
        f"Expected: insert once hits its capacity fraction c in every epoch after the first ({100 * c:.1f}%); "
        "LRU hits a sample only if fewer than c·D others were read since its last use, under independent "
        f"uniform permutations c + (1 - c)·ln(1 - c) of the reads: {100 * p:.1f}% at its c = {c_lru:.3f} "
        f"({100 * expected_lru_hit_fraction(c):.1f}% at the daemon's). Epoch 0 is all compulsory misses for "
        "both. The LRU looks up a whole batch before inserting the batch's misses (as the daemon does), which "
        "keeps each sample up to a batch longer than the formula assumes, and one epoch's figure varies by "
        f"about ±{noise:.1f} points (one standard deviation of a hit ratio over {setup.num_samples:,} reads)."
    )
    machine_line = (
        f"Machine: {machine['nproc']} cores ({machine['cpu']}), Linux {machine['kernel']}, "
        f"Python {machine['python']}, load average {load_average:.1f} at the start (other work running); "
        f"{wall_seconds:.0f} s wall for the run, dataset generation included."
    )
    table = [
        "| epoch | insert once, hit % | LRU, hit % | capacity fraction (daemon, effective), % | LRU expected, % |",
        "|---:|---:|---:|---:|---:|",
    ]
    table += [
        f"| {row['epoch']} | {row['minio_hit_pct']:.1f} | {row['lru_hit_pct']:.1f} "
        f"| {row['capacity_pct']:.1f} | {row['lru_expected_pct']:.1f} |"
        for row in rows
    ]
    lines = [
        "### Cache policy: insert once vs LRU",
        "",
        "```",
        command,
        "```",
        "",
        machine_line,
        "",
        setting,
        "",
        *table,
        "",
        capacity,
        "",
        expectation,
    ]
    if plotted:
        lines += ["", f"![hit ratio per epoch](bench/results/{name}.png)"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a {QUICK.cache_bytes // MiB} MiB cache, not {FULL.cache_bytes // MiB} MiB",
    )
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    name = "cache_policy-quick" if args.quick else "cache_policy"
    command = " ".join(
        [os.path.relpath(sys.executable, REPO), "bench/cache_policy.py", *(["--quick"] if args.quick else [])]
    )
    started = time.perf_counter()
    load_average = os.getloadavg()[0]
    orders = epoch_orders(setup.num_samples, EPOCHS, SEED)
    with tempfile.TemporaryDirectory(prefix="dq-cache-policy-") as tmp:
        progress(f"writing {setup.num_samples} samples of {SAMPLE_BYTES // KiB} KiB")
        root = make_files_dataset(Path(tmp) / "pfs", setup.num_samples, sizes=(SAMPLE_BYTES,), seed=SEED)
        run = run_insert_once(root, Path(tmp) / "daemon", setup, orders)
        lru_hits = run_lru(run.manifest, Path(tmp) / "lru", setup.cache_bytes, orders)
    wall = time.perf_counter() - started

    total = setup.num_samples
    capacity_pct = 100 * run.cached_samples[0] / total
    lru_capacity_samples = setup.cache_bytes // SAMPLE_BYTES
    lru_capacity_pct = 100 * lru_capacity_samples / total
    minio_pct = [100 * hits / total for hits in run.hits]
    lru_pct = [100 * hits / total for hits in lru_hits]
    rows: list[dict[str, object]] = [
        {
            "epoch": epoch,
            "minio_hit_pct": minio_pct[epoch],
            "lru_hit_pct": lru_pct[epoch],
            "capacity_pct": capacity_pct,
            "lru_expected_pct": 0.0 if epoch == 0 else 100 * expected_lru_hit_fraction(lru_capacity_pct / 100),
            "minio_hits": run.hits[epoch],
            "lru_hits": lru_hits[epoch],
            "reads": total,
            "minio_cached_samples": run.cached_samples[epoch],
            "lru_capacity_samples": lru_capacity_samples,
            "lru_capacity_pct": lru_capacity_pct,
            "cache_bytes": setup.cache_bytes,
            "sample_bytes": SAMPLE_BYTES,
            "minio_cache_used_bytes": run.cache_used_bytes,
            "wall_seconds": wall,
        }
        for epoch in range(EPOCHS)
    ]
    report(name, rows, ["epoch", "minio_hit_pct", "lru_hit_pct", "capacity_pct", "lru_expected_pct"])
    print(
        f"expected: insert once = capacity fraction {capacity_pct:.1f}% every epoch after the first; "
        f"LRU = c + (1-c)ln(1-c) = {rows[-1]['lru_expected_pct']:.1f}% at its c = {lru_capacity_pct / 100:.3f} "
        "(a sample's reuse is an epoch away, and an epoch's scan evicts it first)"
    )
    if not run.cache_full:
        print("note: the daemon's cache never reported full; the dataset did not fill it")
    plotted = plot(minio_pct, lru_pct, capacity_pct, lru_capacity_pct, RESULTS / f"{name}.png")
    (RESULTS / f"{name}.md").write_text(
        markdown(rows, setup, run, lru_capacity_samples, command, wall, load_average, plotted, name)
    )
    print(f"{wall:.0f} s; wrote {RESULTS / name}.{{json,md{',png' if plotted else ''}}}")


if __name__ == "__main__":
    main()
