"""A daemon frozen with SIGSTOP (a hung node, a debugger, a node swapping
hard) for longer than the peer deadline and its directory lease, then let go
with SIGCONT, while a job in mode ``global`` trains: three quarters of every
rank's reads are peer reads, so the frozen node matters to every rank."""

from __future__ import annotations

import signal
from collections.abc import Callable

from faultjob import NODES, RANKS_PER_NODE, SAMPLES, FaultJob

#: Kept short so that the stop outlasts it many times over.
PEER_TIMEOUT_SECONDS = 0.5
#: How long the daemon stays stopped: past its lease (1 s in these clusters)
#: and the peer deadline, well short of the client's READ_FLOOR_SECONDS.
STOP_SECONDS = 3.0
STOPPED = 3


def test_a_stopped_peer_is_read_around_then_used_again_after_sigcont(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("global", daemon_args=("--peer-timeout", str(PEER_TIMEOUT_SECONDS)))
    job.stage()
    daemon = job.local.daemons[STOPPED]
    try:
        with job.ranks() as group:
            outage = job.run_outage(
                group,
                STOPPED,
                lambda: daemon.signal(signal.SIGSTOP),
                lambda: daemon.signal(signal.SIGCONT),
                STOP_SECONDS,
            )
    finally:
        daemon.signal(signal.SIGCONT)

    own = [r for r in outage.during if r.rank // RANKS_PER_NODE == STOPPED]
    others = [r for r in outage.during if r.rank // RANKS_PER_NODE != STOPPED]
    # The other nodes read the stopped node's samples from the PFS instead.
    assert sum(r.samples.get("pfs", 0) for r in others) > 0, [r.samples for r in others]
    # Its own ranks neither failed nor fell back: their misses waited in its
    # socket until SIGCONT (a stop beyond READ_FLOOR_SECONDS would make them
    # read the PFS themselves), and their local hits never needed it.
    for r in own:
        assert r.samples.get("fallback", 0) == 0 and r.wait_seconds >= STOP_SECONDS / 2, (r.rank, r.samples)
    # Before and after: every sample a local hit or a peer hit, none from the
    # PFS; the stopped node serves its samples to the others again.
    for epoch in (0, 2):
        assert set(job.tiers[epoch]) == {"local", "peer"}, job.tiers[epoch]
        assert sum(job.tiers[epoch].values()) == SAMPLES
    assert len(job.listed_up()) == NODES
    job.report(
        "SIGSTOP a peer daemon mid-epoch, SIGCONT after 3 s",
        "other nodes read its samples from the PFS; "
        "its own ranks stalled until SIGCONT (no fallback); all peer hits again once it answered",
        outage.recovery_seconds,
        peer_timeout_seconds=PEER_TIMEOUT_SECONDS,
        stop_seconds=STOP_SECONDS,
        listed_down_after_seconds=round(outage.listed_down_seconds, 2),
        own_ranks_stall_seconds=round(max(r.wait_seconds for r in own), 2),
    )
