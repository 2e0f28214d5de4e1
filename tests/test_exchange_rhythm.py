"""A partial job read in a training rhythm: each epoch lasts several times its
exchange, caches in the proportion docs/guides/sizing.md advises, the ranks of a node
each at its own pace, and every rank still reads its own node's cache: a
sample given away stays until every rank of its node has read it, not only
until the first rank enters the next epoch (a slower rank would then read the
rest of its epoch from peers, epoch 0 included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan
from dataquay.client.wire.records import checksum
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import node_shares
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

NODES = 3
RANKS_PER_NODE = 2
SAMPLES = 480
SIZE = 8192
BATCH = 16
EPOCHS = 4
SECONDS_PER_BATCH = 0.3
JOB = "rhythm"


def payload(i: int) -> bytes:
    return sample_bytes(0, i, SIZE)


def tight_capacity(q: float) -> int:
    """1.3 x the largest share of any node in the epochs read: the sizing guide's
    advice (1.05 x share + 16 MiB) in its proportion for a share of about
    100 MiB. With these small files the 16 MiB alone would hold the dataset,
    and nothing given away would ever be deleted."""
    settings = JobSettings(job_id=JOB, mode="partial", q=q, ranks_per_node=RANKS_PER_NODE,
                           nodes=tuple(f"n{m}" for m in range(NODES)))
    plan = JobPlan(settings, num_samples=SAMPLES, num_nodes=NODES)
    return int(1.3 * node_shares(plan, np.full(SAMPLES, SIZE), EPOCHS + 1).max())


@pytest.mark.parametrize("q", [1.0, 0.5])
def test_ranks_that_train_between_batches_read_every_epoch_from_their_own_node(
    cluster: Callable[..., LocalCluster], tmp_path: Path, q: float
) -> None:
    local = cluster(NODES, daemon_args=("--cache-size", str(tight_capacity(q))))
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=(SIZE,))
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert cli_main([
        "stage", "imgs", "--job", JOB, "--mode", "partial", "--q", str(q), "--seed", "5",
        "--quiet", "--directory", local.directory_address,
    ]) == 0
    tiers_by_epoch = run_ranks(local, tmp_path)
    for epoch, tiers in enumerate(tiers_by_epoch):
        # A rank's first read report of an epoch can reach its daemon after the
        # first delete: the odd sample then comes from the PFS (within the 1%).
        assert tiers["local"] >= 0.99 * sum(tiers.values()), (epoch, tiers_by_epoch)
        assert tiers["fallback"] == 0, (epoch, tiers_by_epoch)


def run_ranks(local: LocalCluster, tmp_path: Path) -> list[dict[str, int]]:
    """Every rank run to its end, each at its own pace; each epoch read once
    whole with its bytes, and its samples by tier."""
    script = Path(__file__).with_name("rhythm_rank.py")
    logs = [open(tmp_path / f"rank-{rank}.log", "wb") for rank in range(NODES * RANKS_PER_NODE)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "imgs", str(EPOCHS), str(BATCH), str(SECONDS_PER_BATCH)],
            env={**os.environ, **local.rank_env(rank, RANKS_PER_NODE, JOB)},
            stdout=subprocess.PIPE, stderr=log,
        )
        for rank, log in enumerate(logs)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for log in logs:
            log.close()
    assert [p.returncode for p in procs] == [0] * len(procs), [(tmp_path / f"rank-{r}.log").read_text()
                                                               for r in range(len(procs))]
    lines = [[json.loads(line) for line in out.splitlines()] for out in outputs]
    by_epoch = []
    for epoch in range(EPOCHS):
        reads = [rank[epoch] for rank in lines]
        ids = [i for r in reads for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES))
        assert [s for r in reads for s in r["checksums"]] == [checksum(payload(i)) for i in ids]
        by_epoch.append({t: sum(r["samples"][t] for r in reads) for t in reads[0]["samples"]})
    return by_epoch
