"""A job on two directory replicas over a 3-member etcd: a replica killed,
then an etcd member, then all of etcd, then a daemon; the job reads on,
exactly and without a PFS read, throughout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultjob import NODES, SAMPLES, FaultJob, make_fault_job
from polling import wait_until

from dataquay.server.tools.etcd_cluster import etcd_binary
from dataquay.server.tools.local_cluster import LocalCluster, node_name

LEASES = ("--lease-seconds", "2", "--heartbeat-seconds", "0.5")


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[LocalCluster]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary (the etcd-server package; make tools)")
    local = LocalCluster(
        tmp_path / "cluster",
        NODES,
        directory_args=LEASES,
        dataset_roots=(tmp_path,),
        directories=2,
        store="etcd",
        etcd_members=3,
    )
    try:
        yield local.start()
    finally:
        local.down()


def test_a_job_reads_on_through_a_killed_replica_a_killed_etcd_member_and_an_etcd_outage(
    replicated: LocalCluster, tmp_path: Path
) -> None:
    job: FaultJob = make_fault_job(replicated, tmp_path, "partial")
    job.stage()
    pfs_after_staging = sum(job.stats(m).pfs_bytes for m in range(NODES))
    etcd = replicated.etcd
    assert etcd is not None
    with job.ranks() as group:
        job.check(0, group.epoch(0))
        wait_until(lambda: job.exchanged(1), "the exchange into epoch 1 finished")
        job.check(1, group.epoch(1, mid=lambda: replicated.kill_directory(0)))
        # The exchanges into the next epochs start and finish with replica 0 gone, then an etcd member.
        wait_until(lambda: job.exchanged(2), "the exchange into epoch 2 finished")
        # Every daemon's beats moved to replica 1 within its lease: none was ever listed down there.
        assert job.listed_up() == {node_name(i) for i in range(NODES)}
        job.check(2, group.epoch(2, mid=lambda: etcd.kill(0)))
        wait_until(lambda: job.exchanged(3), "the exchange into epoch 3 finished")
        # All of etcd gone mid-epoch: as when the one directory is down, the epoch reads on.
        job.check(3, group.epoch(3, mid=lambda: [etcd.kill(i) for i in (1, 2)]))
        etcd.restart(0, 1, 2)
        wait_until(lambda: job.exchanged(4), "the exchange into epoch 4 finished")
        job.check(4, group.epoch(4))
    assert all(sum(tiers.values()) == SAMPLES and "pfs" not in tiers for tiers in job.tiers)
    assert sum(job.stats(m).pfs_bytes for m in range(NODES)) == pfs_after_staging
    # Failure detection goes on at the surviving replica: a daemon killed is listed down within its lease.
    killed = time.monotonic()
    replicated.kill_node(NODES - 1)
    wait_until(lambda: node_name(NODES - 1) not in job.listed_up(), "the killed node listed down", timeout=10)
    assert time.monotonic() - killed < 6
    job.report(
        "directory replica SIGKILLed mid-epoch, then an etcd member, then all of etcd (2 replicas, 3 members)",
        "epochs went on exactly with no PFS read; the other replica detected a killed node",
        time.monotonic() - killed,
    )
