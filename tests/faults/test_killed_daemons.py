"""Daemons killed with SIGKILL while a job trains: during staging, in the
middle of an epoch, and in the middle of the exchange between epochs."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import numpy as np
import pytest
from faultjob import JOB, NODES, SAMPLES, FaultJob
from polling import wait_until

from dataquay.client.placement import owners
from dataquay.protos import cache_pb2 as pb


def owners_at(job: FaultJob, epoch: int) -> np.ndarray:
    return owners(job.plan, epoch)


@pytest.mark.parametrize("mode", ["global", "partial"])
def test_a_daemon_killed_mid_epoch_is_replaced_by_the_pfs_and_rejoins(
    fault_job: Callable[..., FaultJob], mode: str
) -> None:
    job = fault_job(mode)
    job.stage()
    recovery: list[float] = []
    of_node_3 = np.flatnonzero(owners_at(job, 1) == 3)[:8].tolist()

    def kill_then_restart() -> None:
        job.local.kill_node(3)
        job.local.wait_for_nodes(down=["node-3"], timeout=30)
        started = time.monotonic()
        job.local.restart_node(3)
        job.local.wait_for_nodes(up=[f"node-{i}" for i in range(NODES)], timeout=30)
        # Recovered: its peers read its samples from it again, not from the PFS.
        for peer in range(3):
            wait_until(
                lambda: "pfs" not in job.read_tiers(peer, of_node_3),
                f"node {peer} reads node 3's samples from it",
                poll=0.1,
            )
        recovery.append(time.monotonic() - started)

    with job.ranks() as group:
        # Node 3's daemon dies halfway through epoch 1 and is restarted after it.
        job.check(0, group.epoch(0))
        if mode == "partial":
            wait_until(lambda: job.exchanged(1), "the exchange into epoch 1 finished")
        job.check(1, group.epoch(1, mid=lambda: job.local.kill_node(3)))
        if mode == "global":
            # Its ranks' misses and the other nodes' reads of its samples go to the PFS.
            assert job.tiers[1].get("fallback", 0) > 0 and job.tiers[1].get("pfs", 0) > 0
        else:
            # Every sample of the epoch was in its reader's node cache: the
            # dead daemon's LMDB still serves its own ranks.
            assert job.tiers[1] == {"local": SAMPLES}
        kill_then_restart()
        job.check(2, group.epoch(2))
    outcome = {
        "global": "its ranks read the PFS directly (client fallback); peers read its samples from the PFS",
        "partial": "its ranks kept reading its LMDB directly; nothing else needed it",
    }[mode]
    job.report("SIGKILL a daemon mid-epoch", outcome, recovery[0])


def test_a_daemon_killed_during_staging_finishes_staging_after_a_restart(fault_job: Callable[..., FaultJob]) -> None:
    # Each node's share is about 380 KB: at 100 KB/s staging takes a few seconds.
    job = fault_job("partial", daemon_args=("--pfs-bandwidth", "100K"))
    staging = subprocess.Popen(job.stage_command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: job.stats(2).cache_entries > 0, "node 2 cached some of its share")
        job.local.kill_node(2)
        _, err = staging.communicate(timeout=60)
    finally:
        staging.kill()
        staging.wait()
    assert staging.returncode == 1 and "node-2" in err, err
    started = time.monotonic()
    job.local.restart_node(2)
    partly = job.stats(2).cache_entries
    job.stage()
    recovery = time.monotonic() - started
    owned = [int((owners_at(job, 0) == m).sum()) for m in range(NODES)]
    assert [job.stats(m).cache_entries for m in range(NODES)] == owned
    assert 0 < partly < owned[2]
    with job.ranks() as group:
        for epoch in range(3):
            if epoch:
                # Samples still on their way to a new owner would be read from the old one.
                wait_until(lambda: job.exchanged(epoch), f"the exchange into epoch {epoch} finished")
            job.check(epoch, group.epoch(epoch))
    assert all(tiers == {"local": SAMPLES} for tiers in job.tiers), job.tiers
    job.report(
        "SIGKILL a daemon during staging",
        "restaging resumed from what it had cached; epochs all local",
        recovery,
        cached_before_restage=partly,
        share=owned[2],
    )


def test_a_daemon_killed_in_the_middle_of_the_exchange_redoes_its_part(fault_job: Callable[..., FaultJob]) -> None:
    # At 1 byte/s no exchange gets its first chunk out, however long half an
    # epoch takes: node 1's is certain to be unfinished when it is killed. It
    # comes back uncapped; the others' exchanges stay held, so epoch 1 reads
    # what they had to give from its previous owner.
    job = fault_job("partial", daemon_args=("--exchange-bandwidth", "1"))
    job.stage()
    recovery: list[float] = []
    redone: list[pb.ExchangeProgress] = []

    def exchange_into_1() -> pb.ExchangeProgress | None:
        return next((x for x in job.stats(1).exchanges if x.job == JOB and x.epoch == 1), None)

    def finished() -> bool:
        run = exchange_into_1()
        return run is not None and run.finished

    def kill_mid_exchange() -> None:
        # The run is listed once its placements and books are built, which on
        # a loaded machine can be after half of epoch 0.
        wait_until(exchange_into_1, "node 1's exchange into epoch 1 started")
        before = exchange_into_1()
        assert before is not None and before.delivered_samples == 0 < before.total_samples
        job.local.kill_node(1)
        started = time.monotonic()
        job.local.daemon_args = ()
        job.local.restart_node(1)
        wait_until(finished, "node 1's redone exchange into epoch 1 finished")
        recovery.append(time.monotonic() - started)
        run = exchange_into_1()
        assert run is not None
        redone.append(run)

    with job.ranks() as group:
        job.run_epochs(group, mid={0: kill_mid_exchange})
    after = redone[0]
    given = int(((owners_at(job, 0) == 1) & (owners_at(job, 1) != 1)).sum())
    assert after.delivered_samples == after.total_samples == given
    assert after.unavailable_samples == after.refused_samples == 0
    job.report(
        "SIGKILL a daemon mid-exchange",
        "the restarted daemon redid its part; nothing read twice or lost",
        recovery[0],
        tiers_note="epoch 1 reads not yet delivered come from the previous owner",
    )
