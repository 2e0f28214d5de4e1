"""A partial job whose directory goes away for three epoch boundaries: the
daemons start each epoch's exchange from the job record they hold, so every
rank keeps reading its own node's cache, with no PFS read, during the outage
and after it; the directory, back on its state file and port, learns the
epochs it missed from the daemons' queued reports.

Caches hold four times the tightest the rhythm test uses, so that what
this test measures is the outage: an exchange into an epoch is done before
the epoch, and a sample read where it is not is one no exchange brought.
Taken away by SIGKILL (a crash: the daemons' calls are refused at once) and
by SIGSTOP (a hung host: their calls wait for their deadline), ranks in
their own processes at their own pace, as in a real job.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import grpc
import pytest
from test_exchange_rhythm import ADVISED, BATCH, JOB, NODES, RANKS_PER_NODE, SAMPLES, SIZE, Rhythm, capacity, payload

from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.tools import free_rank
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

EPOCHS = 7
#: Each epoch lasts some seconds: longer than the exchange into the next on a
#: loaded machine, and than the directory's restart.
SECONDS_PER_BATCH = 0.5
#: The directory goes away once the job is in this epoch ...
AWAY_IN = 1
#: ... and comes back once every rank has entered this one: three boundaries later.
BACK_IN = AWAY_IN + 3
RANKS = NODES * RANKS_PER_NODE


def directory_epoch(local: LocalCluster) -> int | None:
    """The job's epoch as the directory holds it; None while it does not answer."""
    with local.credentials().channel(local.directory_address, channel_options()) as channel:
        try:
            job = directory_pb2_grpc.DirectoryStub(channel).GetJob(jpb.GetJobRequest(job_id=JOB), timeout=2.0)
        except grpc.RpcError:
            return None
    return int(job.epoch) if job.started else -1


def wait_until(what: str, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextmanager
def ranks_running(local: LocalCluster, tmp_path: Path) -> Iterator[list[list[dict]]]:
    """Every rank of the job in its own process; yields each rank's epoch
    records, appended as the rank prints them."""
    logs = [open(tmp_path / f"rank-{rank}.log", "wb") for rank in range(RANKS)]
    procs = [
        subprocess.Popen(
            free_rank.command("imgs", EPOCHS, BATCH, SECONDS_PER_BATCH, read_ahead=0),
            env={**os.environ, **local.rank_env(rank, RANKS_PER_NODE, JOB)},
            stdout=subprocess.PIPE,
            stderr=log,
        )
        for rank, log in enumerate(logs)
    ]
    records: list[list[dict]] = [[] for _ in procs]
    errors: queue.Queue[BaseException] = queue.Queue()

    def collect(out: IO[bytes], into: list[dict]) -> None:
        try:
            for line in out:
                into.append(json.loads(line))
        except ValueError as exc:
            errors.put(exc)

    readers = [threading.Thread(target=collect, args=(p.stdout, records[r]), daemon=True) for r, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    try:
        yield records
        for proc in procs:
            proc.wait(timeout=180)
        for reader in readers:
            reader.join(timeout=10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for log in logs:
            log.close()
    assert errors.empty(), errors.get()
    assert [p.returncode for p in procs] == [0] * RANKS, [
        (tmp_path / f"rank-{r}.log").read_text() for r in range(RANKS)
    ]


def epoch_tiers(records: list[list[dict]]) -> list[dict[str, int]]:
    """Each epoch's samples by tier, once every epoch was read exactly once
    whole, every byte right."""
    by_epoch = []
    for epoch in range(EPOCHS):
        reads = [rank[epoch] for rank in records]
        assert [r["epoch"] for r in reads] == [epoch] * RANKS
        ids = [i for r in reads for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES)), epoch
        assert [s for r in reads for s in r["checksums"]] == [checksum(payload(i)) for i in ids], epoch
        by_epoch.append({t: sum(r["samples"][t] for r in reads) for t in reads[0]["samples"]})
    return by_epoch


@pytest.mark.long
@pytest.mark.parametrize("outage", ["kill", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_directory_away_for_three_epoch_boundaries_costs_no_locality_and_learns_the_epochs_after(
    cluster: Callable[..., LocalCluster], tmp_path: Path, outage: str
) -> None:
    local = cluster(NODES, daemon_args=("--cache-size", str(4 * capacity(Rhythm(q=1.0, cache=ADVISED, epochs=EPOCHS)))))
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
                "1",
                "--seed",
                "5",
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    directory = local.directory
    assert directory is not None
    with ranks_running(local, tmp_path) as records:
        wait_until("the job reaches its first epoch boundary", lambda: directory_epoch(local) == AWAY_IN, 60)
        if outage == "kill":
            local.kill_directory()
        else:
            directory.signal(signal.SIGSTOP)
        away = time.monotonic()
        try:
            wait_until(f"every rank enters epoch {BACK_IN}", lambda: all(len(rank) >= BACK_IN for rank in records), 90)
        finally:
            if outage == "kill":
                local.restart_directory()
            else:
                directory.signal(signal.SIGCONT)
        back = time.monotonic()
        # The directory restarted on its state file knew only the epoch it
        # persisted; the daemons' queued reports bring it up to the ranks'.
        wait_until("the directory learns the epochs it missed", lambda: (directory_epoch(local) or -1) >= BACK_IN, 30)
    assert back - away > 3 * SECONDS_PER_BATCH
    tiers = epoch_tiers(records)
    for epoch, counts in enumerate(tiers):
        assert counts["local"] + counts["cache"] >= 0.99 * SAMPLES, (epoch, tiers)
        assert counts["pfs"] == 0 and counts["fallback"] == 0, (epoch, tiers)
    assert directory_epoch(local) == EPOCHS - 1
    # A report of an epoch the job has left (a node's, queued through the
    # outage) is absorbed: the epoch never goes back.
    with local.node_credentials().channel(local.directory_address, channel_options()) as channel:
        late = jpb.ReportEpochRequest(job_id=JOB, epoch=AWAY_IN, node="node-0")
        assert directory_pb2_grpc.DirectoryStub(channel).ReportEpoch(late, timeout=5).epoch == EPOCHS - 1
    assert directory_epoch(local) == EPOCHS - 1
