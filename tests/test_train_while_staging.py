"""Training while staging: a job's ranks read while `dataquay stage` runs on a
real loopback cluster, each sample is read from the PFS once over staging and
the first epoch (in ``global`` too, where an owner reads what a peer asks of
it ahead of its staging), and the second epoch is all cache hits."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from polling import wait_until

import dataquay.client as dq
from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import node_orders, owners
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.manifest_build import build_manifest
from dataquay.server.node.reads.claims import PfsClaims
from dataquay.server.node.stager import first_epoch_positions, staging_ranges
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

NODES = 2
SAMPLES = 384
SIZE = 8192
BATCH = 16
JOB = "early"
#: Per node: staging its 1.5 MiB share alone takes about 1.5 s, so the ranks'
#: first epoch runs inside it.
PFS_BANDWIDTH = "1000000"


def stats(local: LocalCluster, node: int) -> pb.StatsReply:
    with local.credentials().channel(local.daemons[node].address, channel_options()) as channel:
        return cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=30)


def staging_ended(local: LocalCluster) -> bool:
    runs = [run for i in range(NODES) for run in stats(local, i).staging]
    return len(runs) == NODES and all(run.finished for run in runs)


def read_epoch(ds: dq.Dataset, sampler: dq.Sampler, epoch: int, failures: list[str]) -> None:
    """One rank's epoch, batch by batch, every payload checked."""
    try:
        sampler.set_epoch(epoch)
        ids = sampler.indices()
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH].tolist()
            got = ds.get_batch(batch)
            wrong = [i for i, value in zip(batch, got) if value != sample_bytes(0, i, SIZE)]
            if wrong:
                failures.append(f"rank {sampler.rank}: wrong bytes for {wrong[:5]}")
    except Exception as exc:  # reported by the test, not lost in the thread
        failures.append(f"rank {sampler.rank}: {exc!r}")


@pytest.mark.parametrize(
    ("mode", "background", "bulk"),
    [("local", False, "on"), ("local", True, "on"), ("global", True, "on"), ("global", True, "off")],
    ids=["stage-running", "stage-background", "global-background", "global-background-grpc"],
)
def test_ranks_reading_while_staging_runs_read_each_sample_from_the_pfs_once(
    cluster: Callable[..., LocalCluster], tmp_path: Path, mode: str, background: bool, bulk: str
) -> None:
    """The ranks start with `dataquay stage` (racing it), or once `stage
    --background` returned, its runs still going; every byte exact, the PFS
    read once per sample over staging and epoch 0, epoch 1 all cache hits
    (local ones in ``local``). In ``global`` most of a rank's samples are
    another node's, which that node reads for it ahead of its staging, on
    the bulk path or (``--bulk-listen off``) a gRPC Read."""
    # The overflow prefetch off: with room in the cache it reads the next
    # epoch's copy of what it is still reading for this one (see the notes).
    daemon_args = ("--pfs-bandwidth", PFS_BANDWIDTH, "--prefetch-memory", "0")
    local = cluster(NODES, daemon_args=daemon_args + (("--bulk-listen", "off") if bulk == "off" else ()))
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=(SIZE,))
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    clients = [dq.Client(local.daemons[i].address) for i in range(NODES)]
    try:
        datasets = [client.dataset("imgs") for client in clients]
        staged: list[int] = []
        command = ["stage", "imgs", "--job", JOB, "--mode", mode, "--batch-size", str(BATCH)]
        command += ["--quiet", "--directory", local.directory_address]
        stage = threading.Thread(target=lambda: staged.append(cli_main(command)))
        if background:
            assert cli_main([*command, "--background"]) == 0
            assert not staging_ended(local), "it returned once staging ended"
        samplers = [
            ds.sampler(job=JOB, mode=mode, batch_size=BATCH, rank=i, world_size=NODES) for i, ds in enumerate(datasets)
        ]
        failures: list[str] = []
        ranks = [threading.Thread(target=read_epoch, args=(ds, s, 0, failures)) for ds, s in zip(datasets, samplers)]
        if not background:
            stage.start()
        for rank in ranks:
            rank.start()
        for thread in (stage, *ranks) if not background else ranks:
            thread.join(120)
        assert not failures, failures
        if background:
            wait_until(lambda: staging_ended(local), "staging ended", poll=0.1)
        else:
            assert staged == [0]
        assert [run.error for i in range(NODES) for run in stats(local, i).staging] == [""] * NODES
        dataset_bytes = SAMPLES * SIZE
        pfs_bytes = [stats(local, i).pfs_bytes for i in range(NODES)]
        assert sum(pfs_bytes) == dataset_bytes, f"PFS bytes {pfs_bytes} for a dataset of {dataset_bytes}"

        before = [client.stats().samples for client in clients]
        failures.clear()
        for ds, sampler in zip(datasets, samplers):
            read_epoch(ds, sampler, 1, failures)
        assert not failures, failures
        for client, sampler, was in zip(clients, samplers, before):
            now = client.stats().samples
            read = {tier: now[tier] - was.get(tier, 0) for tier in now}
            assert sum(read.values()) == len(sampler) and not read.get("pfs"), read
            if mode == "local":
                assert read["local"] == len(sampler), read
        assert sum(stats(local, i).pfs_bytes for i in range(NODES)) == dataset_bytes
    finally:
        for client in clients:
            client.close()


def test_staging_follows_the_order_the_nodes_ranks_read_in_epoch_0(tmp_path: Path) -> None:
    """Mode local deals each node its own permutation: staging in the job-wide
    permutation's order would race the ranks; it stages their order instead."""
    manifest = Manifest(build_manifest(make_files_dataset(tmp_path, 64, sizes=(100,))).to_bytes())
    spec = jpb.JobSpec(job_id=JOB, dataset="imgs", mode="local", seed=3, nodes=["a", "b"], ranks_per_node=2)
    job = jpb.Job(spec=spec, manifest_id=manifest.manifest_id)
    plan = job_plan(job, manifest)
    epoch_owners = owners(plan, 0)
    position = first_epoch_positions(plan, epoch_owners)
    for node in range(2):
        held = np.flatnonzero(epoch_owners == node)
        staged = np.concatenate([r.ids for r in staging_ranges(manifest, held, position)])
        read = node_orders(plan, 0, node, epoch_owners).T.ravel()  # rank after rank, step by step
        assert staged.tolist() == list(dict.fromkeys(read.tolist()))


def test_a_read_takes_over_what_staging_has_not_started_and_waits_for_what_it_has() -> None:
    claims = PfsClaims()
    run, reader = object(), object()
    claims.reserve("db", run, np.arange(8), 8)
    mine, _ = claims.claim("db", [0, 1, 2, 3], run, started=False, reserved_only=True)
    assert mine == [0, 1, 2, 3]
    assert claims.start("db", [0, 1], run) == [0, 1]  # its thread got to them
    got, theirs = claims.claim("db", [1, 2, 5], reader, started=True, steal=True)
    assert got == [2, 5] and list(theirs) == [1]  # 2 queued, 5 only reserved: taken over
    assert claims.start("db", [2, 3], run) == [3]  # the run's thread skips 2
    later, _ = claims.claim("db", [5, 6], run, started=False, reserved_only=True)
    assert later == [6]  # 5 is the reader's: never read twice
    claims.resolve("db", {1: b"one"}, run)
    assert theirs[1].result(timeout=1) == b"one"
    claims.release("db", [0, 1, 2, 3, 6], run)
    claims.release("db", got, reader)
    assert claims.reserved_mask("db", np.arange(8)).tolist() == [False] * 4 + [True, False, False, True]


def test_what_a_run_reserves_or_a_read_claims_is_coming_until_it_ends() -> None:
    """What a peer's read may wait for (PeerAnswers.coming): what a run
    reserved (all it is asked for at once, then narrowed to what it finds
    missing), and what is being read from its reservation, but not another
    read's claim."""
    claims = PfsClaims()
    run, reader = object(), object()
    claims.reserve("db", run, np.arange(6), 8)
    claims.narrow("db", run, np.array([1, 2, 3, 4]))  # 0 and 5 were cached
    claims.claim("db", [3], run, started=False, reserved_only=True)  # queued by the run
    claims.claim("db", [4, 7], reader, started=True, steal=True)  # 4 taken over; 7 staging never wanted
    assert claims.coming_mask("db", np.arange(8)).tolist() == [False, True, True, True, True, False, False, False]
    claims.release("db", [3], run)
    claims.release("db", [4, 7], reader)
    claims.unreserve("db", run)
    assert not claims.coming_mask("db", np.arange(8)).any()
