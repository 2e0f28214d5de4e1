"""The directory service killed in the middle of a job and started again."""

from __future__ import annotations

import time
from collections.abc import Callable

from faultjob import NODES, SAMPLES, FaultJob


def test_the_job_reads_on_without_the_directory_and_after_its_restart(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("partial")
    job.stage()
    pfs_after_staging = sum(job.stats(m).pfs_bytes for m in range(NODES))
    with job.ranks() as group:
        job.check(0, group.epoch(0))
        job.check(1, group.epoch(1, mid=job.local.kill_directory))
        started = time.monotonic()
        job.local.restart_directory()
        job.local.wait_for_nodes(up=[f"node-{i}" for i in range(NODES)], timeout=30)
        recovery = time.monotonic() - started
        job.check(2, group.epoch(2))
    assert all(sum(tiers.values()) == SAMPLES and "pfs" not in tiers for tiers in job.tiers)
    assert sum(job.stats(m).pfs_bytes for m in range(NODES)) == pfs_after_staging
    job.report(
        "directory killed mid-epoch, restarted after the epoch",
        "epochs went on from the caches; the job and its nodes were back on restart",
        recovery,
    )
