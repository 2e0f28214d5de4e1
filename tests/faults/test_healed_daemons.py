"""A daemon SIGKILLed mid-epoch: the survivors take its share over in the
background (--heal-after), the ranks read every sample of every epoch
exactly once throughout, and once healed the survivors' daemons read the
PFS for none of it; in mode partial, from the epoch the directory records
it absent, and when it is back it takes its share from them."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from faultjob import JOB, NODES, SIZES, FaultJob
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dataquay.client.placement import owners
from dataquay.server.tools.local_cluster import node_name


def healed(job: FaultJob, survivors: range) -> bool:
    """Whether every survivor fetched its part of a lost node's share: each
    fetched some, and none has any left to fetch."""
    counts = [job.stats(m).healing for m in survivors]
    return all(c.pfs_samples + c.peer_samples > 0 and not c.pending_samples for c in counts)


def absent_nodes(job: FaultJob) -> dict[str, float]:
    """The directory's ``dataquay_directory_absent_nodes``, by job."""
    with urllib.request.urlopen(job.local.live_directory().http_url + "/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
        return {
            s.labels["job"]: s.value for f in families if f.name == "dataquay_directory_absent_nodes" for s in f.samples
        }


def sent_to(job: FaultJob, node: int, epoch: int) -> bool:
    """Whether ``node``'s exchange into ``epoch`` finished, refusing nothing."""
    run = next((x for x in job.stats(node).exchanges if x.epoch == epoch), None)
    return run is not None and run.finished and run.refused_samples == 0


def owners_at(job: FaultJob, epoch: int) -> np.ndarray:
    """The owners of ``epoch`` in a job whose owners move, stepped from epoch 0."""
    current = None
    for step in range(epoch + 1):
        current = owners(job.plan, step, current)
    assert current is not None
    return current


@pytest.mark.parametrize("mode", ["global", "local", "locality"])
def test_a_daemon_killed_mid_epoch_is_healed_by_the_others(fault_job: Callable[..., FaultJob], mode: str) -> None:
    job = fault_job(mode, daemon_args=("--heal-after", "1", "--peer-timeout", "2"))
    job.stage()
    share = int((owners(job.plan, 0) == NODES - 1).sum())
    survivors = range(NODES - 1)
    with job.ranks() as group:
        job.check(0, group.epoch(0))
        job.check(1, group.epoch(1, mid=lambda: job.local.kill_node(NODES - 1)))

        wait_until(lambda: healed(job, survivors), "the survivors took the dead node's share", poll=0.2)
        counts = [job.stats(m).healing for m in survivors]
        # What the ranks' own reads cached meanwhile is not fetched again.
        assert sum(c.peer_samples for c in counts) == 0 and sum(c.pfs_samples for c in counts) <= share
        assert sum(c.pfs_bytes for c in counts) <= max(SIZES) * share
        for epoch in range(2, 10):
            before = np.array([job.stats(m).pfs_bytes for m in survivors])
            job.check(epoch, group.epoch(epoch))
            after = np.array([job.stats(m).pfs_bytes for m in survivors])
            # The dead node's ranks read on from the PFS themselves (their
            # daemon is gone); every other read is a cache or peer hit.
            assert (after - before).tolist() == [0] * (NODES - 1), f"epoch {epoch}: survivors read the PFS"
            assert job.tiers[epoch].get("pfs", 0) == 0, job.tiers[epoch]


def test_a_daemon_killed_mid_epoch_in_partial_mode_is_healed_by_the_others(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("partial", daemon_args=("--heal-after", "1", "--peer-timeout", "2"))
    job.stage()
    dead, survivors = NODES - 1, range(NODES - 1)
    with job.ranks() as group:
        job.check(0, group.epoch(0))
        job.check(1, group.epoch(1, mid=lambda: job.local.kill_node(dead)))
        wait_until(
            lambda: all(job.stats(m).healing.lost_nodes == 1 for m in survivors), "the survivors count the node lost"
        )
        # The next epoch's reports have the directory record the node absent
        # two epochs on, when every node steps its holders alike.
        job.check(2, group.epoch(2))
        absences = list(job.record().absences)
        assert [(a.node, a.from_epoch, a.until_epoch) for a in absences] == [(node_name(dead), 4, 0)]
        cli = [sys.executable, "-m", "dataquay.server.cli"]
        shown = subprocess.run(
            [*cli, "job", "show", JOB, "--directory", job.local.directory_address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert f"{node_name(dead)}  (absent from epoch 4: the others hold its share)" in shown.stdout, shown
        job.check(3, group.epoch(3))
        share = int((owners_at(job, 3) == dead).sum())

        wait_until(lambda: healed(job, survivors), "the survivors took the absent node's share", poll=0.2)
        counts = [job.stats(m).healing for m in survivors]
        assert sum(c.pfs_samples + c.peer_samples for c in counts) <= share
        for epoch in (4, 5, 6):
            before = np.array([job.stats(m).pfs_bytes for m in survivors])
            job.check(epoch, group.epoch(epoch))
            after = np.array([job.stats(m).pfs_bytes for m in survivors])
            # The dead node's ranks read on from the PFS themselves; the
            # survivors' exchange now moves its share among them.
            assert (after - before).tolist() == [0] * (NODES - 1), f"epoch {epoch}: survivors read the PFS"
        assert absent_nodes(job) == {JOB: 1.0}

        # Back on its old cache: it holds its share again two epochs after
        # the report that finds it up, and takes it from the others.
        job.local.restart_node(dead)
        wait_until(lambda: node_name(dead) in job.listed_up(), "the directory lists the node up")
        job.check(7, group.epoch(7))
        assert [(a.node, a.from_epoch, a.until_epoch) for a in job.record().absences] == [(node_name(dead), 4, 9)]
        job.check(8, group.epoch(8))
        # Its share of epoch 9 comes from the others (less what its old cache held).
        wait_until(lambda: all(sent_to(job, m, 9) for m in survivors), "the others' exchange into epoch 9 finished")
        back = job.stats(dead)
        assert back.pfs_bytes == 0 and back.healing.pfs_samples == 0
        assert 0 < back.exchange_received_samples <= int((owners_at(job, 9) == dead).sum())
        for epoch in (9, 10):
            before = np.array([job.stats(m).pfs_bytes for m in range(NODES)])
            job.check(epoch, group.epoch(epoch))
            after = np.array([job.stats(m).pfs_bytes for m in range(NODES)])
            assert (after - before).tolist() == [0] * NODES, f"epoch {epoch}: a node read the PFS"
            assert job.tiers[epoch].get("pfs", 0) == 0, job.tiers[epoch]
        assert absent_nodes(job) == {}
