"""The fault suite's verdict on what ranks read: every rank its sampler's ids,
in order, each id once per epoch across the job, each with the bytes of its
file on the PFS.

The expected bytes are hashed here from the files themselves, walked in the
manifest's documented id order by this module's own code, so that a fault in
dataquay's manifest or checksum code cannot hide behind the same fault in the
check.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from dataquay.server.tools.trainers import RankEpoch


def pfs_files(root: Path) -> list[Path]:
    """Regular files under ``root`` in id order: depth first, names by their
    bytes, names starting with a dot skipped."""
    out: list[Path] = []
    for entry in sorted(os.scandir(root), key=lambda e: os.fsencode(e.name)):
        if entry.name.startswith("."):
            continue
        if entry.is_dir(follow_symlinks=False):
            out += pfs_files(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            out.append(Path(entry.path))
    return out


def pfs_digests(root: Path) -> np.ndarray:
    """xxh3-64 of every sample of a files dataset, by id."""
    return np.array([xxhash.xxh3_64_intdigest(p.read_bytes()) for p in pfs_files(root)], dtype=np.uint64)


def epoch_problems(
    epoch: int, results: Sequence[RankEpoch], orders: Sequence[np.ndarray], digests: np.ndarray
) -> list[str]:
    """Everything wrong with one epoch of a job, one line each; empty when
    every rank read exactly ``orders[rank]`` with the right bytes and the
    ranks together read every id exactly once."""
    problems: list[str] = []
    for result, order in zip(results, orders, strict=True):
        got = np.asarray(result.ids, dtype=np.int64)
        if got.shape != order.shape or not np.array_equal(got, order):
            differs = next((k for k, (a, b) in enumerate(zip(got, order)) if a != b), min(len(got), len(order)))
            problems.append(
                f"epoch {epoch} rank {result.rank}: read {len(got)} ids, its sampler has {len(order)}; "
                f"first difference at position {differs}"
            )
        if len(result.checksums) != len(result.ids):
            problems.append(
                f"epoch {epoch} rank {result.rank}: {len(result.ids)} ids but {len(result.checksums)} samples"
            )
            continue
        for sample_id, digest in zip(result.ids, result.checksums):
            if not 0 <= sample_id < len(digests):
                problems.append(f"epoch {epoch} rank {result.rank}: id {sample_id} is not in the dataset")
            elif int(digests[sample_id]) != digest:
                problems.append(f"epoch {epoch} rank {result.rank}: id {sample_id} has bytes other than its file's")
    counts = Counter(i for result in results for i in result.ids)
    problems += [f"epoch {epoch}: id {i} read {n} times" for i, n in sorted(counts.items()) if n > 1]
    missing = sorted(set(range(len(digests))) - counts.keys())
    if missing:
        problems.append(f"epoch {epoch}: {len(missing)} ids never read, first {missing[:5]}")
    return problems


def tier_counts(results: Sequence[RankEpoch]) -> dict[str, int]:
    """Samples per client tier, summed over ranks (tiers that served none left out)."""
    totals: Counter[str] = Counter()
    for result in results:
        totals.update(result.samples)
    return {tier: n for tier, n in totals.items() if n}
