"""Rank processes of a loopback cluster's job, and whole epochs read by them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dataquay.client.wire.records import checksum
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.trainers import RankGroup


def job_ranks(
    local: LocalCluster,
    tmp_path: Path,
    job: str,
    ranks: int,
    ranks_per_node: int,
    compute_seconds: float,
    connect_timeouts: list[float] | None = None,
) -> RankGroup:
    """Every rank of ``job`` over ``local``, reading "imgs" in batches of 16."""
    envs = [local.rank_env(r, ranks_per_node, job) for r in range(ranks)]
    return RankGroup(
        envs,
        "imgs",
        tmp_path / "ranks",
        batch=16,
        compute_seconds=compute_seconds,
        timeout=60,
        connect_timeouts=connect_timeouts,
    )


def read_whole_epoch(group: RankGroup, epoch: int, num_samples: int, payload: Callable[[int], bytes]) -> dict[str, int]:
    """Epoch ``epoch`` read by every rank, each sample once with its bytes; the samples by tier."""
    results = group.epoch(epoch)
    ids = np.concatenate([r.ids for r in results]).astype(np.int64)
    assert sorted(ids.tolist()) == list(range(num_samples))
    sums = np.concatenate([np.asarray(r.checksums, dtype=np.uint64) for r in results])
    assert sums.tolist() == [checksum(payload(i)) for i in ids.tolist()]
    return {t: sum(r.samples[t] for r in results) for t in results[0].samples}
