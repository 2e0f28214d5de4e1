"""A partial job read in a training rhythm: each epoch lasts several times its
exchange, caches from the proportion the
sizing guide advises to ten times it, the ranks of a node each at its own pace and
reading two batches ahead as a DataLoader does, and every rank still reads
its own node's cache: a sample given away stays until every rank of its
node has read it, not only until the first rank enters the next epoch (a
slower rank would then read the rest of its epoch from peers, epoch 0
included), and each receiver gets first what its ranks read first (their
read-ahead asks for the next epoch's first batches while the sender's ranks
still read the epoch before). Nothing is read from the PFS ahead of the
ranks, and so nothing read ahead is thrown away."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from test_exchange import JOB as EXCHANGE_JOB
from test_exchange import partial_cluster

from dataquay.client.job_settings import JobSettings
from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import JobPlan, node_reads
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import node_shares
from dataquay.server.sizes import parse_size
from dataquay.server.tools import free_rank
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.simulate import Scenario, simulate
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

NODES = 3
RANKS_PER_NODE = 2
SAMPLES = 480
SIZE = 8192
BATCH = 8
SECONDS_PER_BATCH = 0.3
JOB = "rhythm"
#: A cache this many times the largest share: the sizing guide's advice (1.05 x
#: share + 16 MiB) in its proportion for a share of about 100 MiB. With these
#: small files the 16 MiB alone would hold the dataset, and nothing given
#: away would ever be deleted.
ADVISED = 1.3
#: Leases no loaded test machine outlasts: a daemon starved of CPU for a
#: second is not marked down, which would move its holders and measure that.
LEASES = ("--lease-seconds", "30", "--heartbeat-seconds", "1")


class Rhythm(NamedTuple):
    """One job's settings and its ranks' pace."""

    q: float
    cache: float  #: the cache, in largest shares
    seconds: float = SECONDS_PER_BATCH  #: the training step per batch
    read_ahead: int = 2  #: batches each rank reads ahead
    epochs: int = 4
    wait: float = 0.0  #: seconds set_epoch may wait for the exchange (Dataset.sampler(wait_for_exchange=...))

    def __str__(self) -> str:
        pace = f"step{self.seconds}-ahead{self.read_ahead}"
        return f"q{self.q}-cache{self.cache}x-{pace}-epochs{self.epochs}-wait{self.wait}"


def payload(i: int) -> bytes:
    return sample_bytes(0, i, SIZE)


def job(rhythm: Rhythm) -> JobPlan:
    settings = JobSettings(
        job_id=JOB,
        mode="partial",
        q=rhythm.q,
        ranks_per_node=RANKS_PER_NODE,
        batch_size=BATCH,
        nodes=tuple(f"n{m}" for m in range(NODES)),
    )
    return JobPlan(settings, num_samples=SAMPLES, num_nodes=NODES)


def capacity(rhythm: Rhythm) -> int:
    """``rhythm.cache`` x the largest share of any node in the epochs read."""
    return int(rhythm.cache * node_shares(job(rhythm), np.full(SAMPLES, SIZE), rhythm.epochs + 1).max())


# The suite runs two; the other q and cache sizes run with the slow ones.
QUICK = [
    Rhythm(q=1.0, cache=ADVISED),
    Rhythm(q=0.5, cache=ADVISED, read_ahead=0),
    pytest.param(Rhythm(q=0.1, cache=ADVISED), marks=pytest.mark.slow),
    pytest.param(Rhythm(q=1.0, cache=10.0), marks=pytest.mark.slow),
]
LONG = [Rhythm(q, cache, epochs=10) for q in (0.1, 0.5, 1.0) for cache in (ADVISED, 2.5, 10.0)]


@pytest.mark.long
@pytest.mark.parametrize("rhythm", QUICK, ids=str)
def test_ranks_that_train_between_batches_read_every_epoch_from_their_own_node(
    cluster: Callable[..., LocalCluster], tmp_path: Path, rhythm: Rhythm
) -> None:
    check_locality(cluster, tmp_path, rhythm)


@pytest.mark.slow
@pytest.mark.parametrize("rhythm", LONG, ids=str)
def test_ten_epochs_read_locally_at_every_q_cache_and_pace(
    cluster: Callable[..., LocalCluster], tmp_path: Path, rhythm: Rhythm
) -> None:
    check_locality(cluster, tmp_path, rhythm)


#: A job with no training step: its ranks read their share faster than the exchange brings it.
NO_STEP = Rhythm(q=1.0, cache=ADVISED, seconds=0.0)


def test_ranks_with_no_step_that_wait_for_the_exchange_read_every_epoch_from_their_own_node(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local, tiers_by_epoch = run_job(cluster, tmp_path, NO_STEP._replace(wait=60.0))
    for epoch, tiers in enumerate(tiers_by_epoch):
        assert tiers["local"] + tiers["cache"] >= 0.99 * sum(tiers.values()), (epoch, tiers_by_epoch)
        assert tiers["fallback"] == 0, (epoch, tiers_by_epoch)
    # The cost shows: the ranks' own count and their daemons' both.
    waits = exchange_waits(tmp_path)
    assert sum(map(sum, waits)) > 0, waits
    held = [metric(local, node, "dataquay_exchange_wait_seconds_total") for node in range(NODES)]
    assert sum(held) > 0, held
    assert [metric(local, node, "dataquay_exchange_wait_timeouts_total") for node in range(NODES)] == [0] * NODES


def test_ranks_with_no_step_that_do_not_wait_read_part_of_an_epoch_from_peers(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local, tiers_by_epoch = run_job(cluster, tmp_path, NO_STEP)
    own = [(t["local"] + t["cache"]) / sum(t.values()) for t in tiers_by_epoch]
    assert min(own[1:]) < 0.99, (own, tiers_by_epoch)
    assert sum(map(sum, exchange_waits(tmp_path))) == 0
    assert sum(metric(local, node, "dataquay_exchange_wait_seconds_total") for node in range(NODES)) == 0


def exchange_waits(tmp_path: Path) -> list[list[float]]:
    """Per epoch, the seconds each rank's set_epoch waited for the exchange."""
    lines = [
        [json.loads(line)["exchange_wait"] for line in (tmp_path / f"rank-{r}.out").read_text().splitlines()]
        for r in range(NODES * RANKS_PER_NODE)
    ]
    return [list(epoch) for epoch in zip(*lines)]


def metric(local: LocalCluster, node: int, name: str) -> float:
    """One unlabelled metric of a daemon, as its metrics endpoint exports it."""
    text = urllib.request.urlopen(local.daemons[node].metrics_url, timeout=30).read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found[1])


@pytest.mark.long
def test_a_cache_short_of_its_share_misses_what_simulate_predicts_every_epoch(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rhythm = Rhythm(q=0.5, cache=0.75, epochs=6)
    local, tiers_by_epoch = run_job(cluster, tmp_path, rhythm)
    # What does not fit is read from the PFS ahead of the ranks; status says
    # how much, and how much of it was thrown away unread.
    capsys.readouterr()
    assert cli_main(["status", "--directory", local.directory_address]) == 0
    printed = re.search(r"prefetched from the PFS (.+); thrown away unread (.+)", capsys.readouterr().out)
    assert printed is not None
    ahead = [daemon_stats(local, node).prefetch for node in range(NODES)]
    assert 0 < parse_size(printed[1]) <= 1.05 * sum(a.overflow_read_bytes for a in ahead)
    assert parse_size(printed[2]) <= 1.05 * sum(a.overflow_wasted_bytes for a in ahead)
    # simulate's epoch 0 is staging; each epoch after misses the part of the
    # share that does not fit, from the PFS or from a peer that still holds
    # it, every epoch about as much: never a growing share. simulate holds a
    # short cache to what the daemons' staging fills (exchange_staging_limit),
    # and counts the first reads of an epoch that come before their sender
    # read, and so shipped, them: over the epochs the misses are what it
    # predicts within 5%; one epoch moves by up to a fifth as the exchange's
    # timing falls.
    scenario = Scenario(job(rhythm), SIZE, capacity(rhythm), read_ahead=rhythm.read_ahead)
    predicted = [(t.pfs_bytes + t.early_read_bytes) / (SAMPLES * SIZE) for t in simulate(scenario, rhythm.epochs)][1:]
    missed = [(t["peer"] + t["pfs"]) / sum(t.values()) for t in tiers_by_epoch][1:]
    assert all(tiers["fallback"] == 0 for tiers in tiers_by_epoch)
    for epoch, (got, want) in enumerate(zip(missed, predicted), 1):
        assert 0.8 * want <= got <= 1.25 * want, (epoch, missed, predicted, tiers_by_epoch)
    assert 0.95 * sum(predicted) <= sum(missed) <= 1.05 * sum(predicted), (missed, predicted)


def run_job(
    cluster: Callable[..., LocalCluster], tmp_path: Path, rhythm: Rhythm
) -> tuple[LocalCluster, list[dict[str, int]]]:
    """The job staged on caches of ``capacity(rhythm)`` and read to its end; its samples by tier, per epoch."""
    local = cluster(NODES, daemon_args=("--cache-size", str(capacity(rhythm))), directory_args=LEASES)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=(SIZE,))
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                "--mode",
                "partial",
                "--q",
                str(rhythm.q),
                "--seed",
                "5",
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    return local, run_ranks(local, tmp_path, rhythm)


def check_locality(cluster: Callable[..., LocalCluster], tmp_path: Path, rhythm: Rhythm) -> None:
    local, tiers_by_epoch = run_job(cluster, tmp_path, rhythm)
    for epoch, tiers in enumerate(tiers_by_epoch):
        assert tiers["local"] + tiers["cache"] >= 0.99 * sum(tiers.values()), (epoch, tiers_by_epoch)
        assert tiers["fallback"] == 0, (epoch, tiers_by_epoch)
    for node in range(NODES):
        ahead = daemon_stats(local, node).prefetch
        # Nothing read ahead is thrown away. A roomy cache holds every sample it
        # owns; an exchange that a loaded machine delays past a rank's read-ahead
        # leaves the overflow prefetcher the odd sample to read from the PFS in
        # time, within the 1% the locality above allows.
        assert ahead.overflow_wasted_bytes == 0, (node, ahead)
        assert ahead.overflow_read_samples <= 0.01 * rhythm.epochs * SAMPLES / NODES, (node, ahead)


def daemon_stats(local: LocalCluster, node: int) -> pb.StatsReply:
    with local.credentials().channel(local.daemons[node].address, channel_options()) as channel:
        return cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=30)


def run_ranks(local: LocalCluster, tmp_path: Path, rhythm: Rhythm) -> list[dict[str, int]]:
    """Every rank run to its end, each at its own pace; each epoch read once
    whole with its bytes, and its samples by tier."""
    # Files, not pipes: a pipe read only once the ranks before it ended fills and stops its rank.
    count = NODES * RANKS_PER_NODE
    logs = [open(tmp_path / f"rank-{rank}.log", "wb") for rank in range(count)]
    outs = [open(tmp_path / f"rank-{rank}.out", "wb") for rank in range(count)]
    try:
        procs = [
            subprocess.Popen(
                free_rank.command("imgs", rhythm.epochs, BATCH, rhythm.seconds, rhythm.read_ahead, rhythm.wait),
                env={**os.environ, **local.rank_env(rank, RANKS_PER_NODE, JOB)},
                stdout=out,
                stderr=log,
            )
            for rank, (log, out) in enumerate(zip(logs, outs))
        ]
        for proc in procs:
            proc.wait(timeout=60 + 30 * rhythm.epochs)
    finally:
        for file in logs + outs:
            file.close()
    assert [p.returncode for p in procs] == [0] * len(procs), [
        (tmp_path / f"rank-{r}.log").read_text() for r in range(len(procs))
    ]
    lines = [[json.loads(line) for line in (tmp_path / f"rank-{r}.out").read_text().splitlines()] for r in range(count)]
    by_epoch = []
    for epoch in range(rhythm.epochs):
        reads = [rank[epoch] for rank in lines]
        ids = [i for r in reads for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES))
        assert [s for r in reads for s in r["checksums"]] == [checksum(payload(i)) for i in ids]
        by_epoch.append({t: sum(r["samples"][t] for r in reads) for t in reads[0]["samples"]})
    return by_epoch


def test_a_rank_that_entered_the_epoch_keeps_what_it_has_not_read_before_it_reports_a_position(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    # Its first position report goes out 16 ids or a quarter of a second
    # after it entered the epoch; the other rank of its node may enter the next
    # epoch meanwhile.
    nodes, epoch_owners = partial_cluster(cluster, tmp_path, "--spare-copies-fill", "0")
    try:
        stub = nodes.stubs[0]
        manifest = Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
        plan = job_plan(
            stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=EXCHANGE_JOB), must_exist=True)), manifest
        )
        for node in range(len(nodes.stubs)):
            for rank in (2 * node, 2 * node + 1):
                nodes.stubs[node].ReportEpoch(
                    jpb.ReportEpochRequest(job_id=EXCHANGE_JOB, epoch=0, rank=rank), timeout=10
                )
        nodes.wait_exchanged(1)
        readers = node_reads(plan, 0, 0, epoch_owners[0]).rank
        gone = (epoch_owners[0] == 0) & (epoch_owners[1] != 0) & (epoch_owners[2] != 0)
        first, second = np.flatnonzero(gone & (readers == 0)), np.flatnonzero(gone & (readers == 1))
        assert len(first) and len(second)
        stub.ReportEpoch(jpb.ReportEpochRequest(job_id=EXCHANGE_JOB, epoch=1, rank=0), timeout=10)
        nodes.wait_until_held(0, first, held=False)
        assert nodes.holds(0, second).all()
        stub.ReportEpoch(jpb.ReportEpochRequest(job_id=EXCHANGE_JOB, epoch=1, rank=1), timeout=10)
        nodes.wait_until_held(0, second, held=False)
    finally:
        nodes.close()
