"""A daemon SIGKILLed mid-epoch and never restarted: the survivors take its
share over in the background (--heal-after), the ranks read every sample of
every epoch exactly once throughout, and once healed the survivors' daemons
read the PFS for none of it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from faultjob import NODES, SIZES, FaultJob
from polling import wait_until

from dataquay.client.placement import owners


def test_a_daemon_killed_mid_epoch_is_healed_by_the_others(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("global", daemon_args=("--heal-after", "1", "--peer-timeout", "2"))
    job.stage()
    share = int((owners(job.plan, 0) == NODES - 1).sum())
    survivors = range(NODES - 1)
    with job.ranks() as group:
        job.check(0, group.epoch(0))
        job.check(1, group.epoch(1, mid=lambda: job.local.kill_node(NODES - 1)))

        def healed() -> bool:
            counts = [job.stats(m).healing for m in survivors]
            return sum(c.pfs_samples for c in counts) == share and not any(c.pending_samples for c in counts)

        wait_until(healed, "the survivors took the dead node's share", poll=0.2)
        counts = [job.stats(m).healing for m in survivors]
        assert sum(c.peer_samples for c in counts) == 0
        assert min(SIZES) * share <= sum(c.pfs_bytes for c in counts) <= max(SIZES) * share
        for epoch in (2, 3):
            before = np.array([job.stats(m).pfs_bytes for m in survivors])
            job.check(epoch, group.epoch(epoch))
            after = np.array([job.stats(m).pfs_bytes for m in survivors])
            # The dead node's ranks read on from the PFS themselves (their
            # daemon is gone); every other read is a cache or peer hit.
            assert (after - before).tolist() == [0] * (NODES - 1), f"epoch {epoch}: survivors read the PFS"
            assert job.tiers[epoch].get("pfs", 0) == 0, job.tiers[epoch]
