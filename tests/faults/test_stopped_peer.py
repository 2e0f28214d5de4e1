"""A daemon frozen with SIGSTOP (a hung node, a debugger, a node swapping
hard) for longer than the peer deadline and its directory lease, then let go
with SIGCONT, while a job in mode ``global`` trains: three quarters of every
rank's reads are peer reads, so the frozen node matters to every rank."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from faultjob import NODES, RANKS_PER_NODE, SAMPLES, FaultJob, seconds_until

#: Kept short so that the stop outlasts it many times over.
PEER_TIMEOUT_SECONDS = 0.5
#: How long the daemon stays stopped: past its lease (1 s in these clusters)
#: and the peer deadline, well short of the client's READ_TIMEOUT_SECONDS.
STOP_SECONDS = 3.0
STOPPED = 3


def test_a_stopped_peer_is_read_around_then_used_again_after_sigcont(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("global", daemon_args=("--peer-timeout", str(PEER_TIMEOUT_SECONDS)))
    job.stage()
    daemon = job.local.daemons[STOPPED]
    name = f"node-{STOPPED}"
    listed_down: list[float] = []
    resumed: list[float] = []
    problems: list[str] = []

    def hold_stopped(stopped_at: float) -> None:
        """Keeps the daemon stopped for STOP_SECONDS, noting when the directory lists it down."""
        try:
            listed_down.append(seconds_until(lambda: name not in job.listed_up(), timeout=STOP_SECONDS))
        except AssertionError as exc:
            problems.append(f"the directory still lists {name} up after {STOP_SECONDS:.0f} s stopped: {exc}")
        finally:
            time.sleep(max(0.0, stopped_at + STOP_SECONDS - time.monotonic()))
            daemon.signal(signal.SIGCONT)
            resumed.append(time.monotonic())

    holder = threading.Thread(target=lambda: hold_stopped(time.monotonic()))

    def stop() -> None:
        daemon.signal(signal.SIGSTOP)
        holder.start()

    try:
        with job.ranks() as group:
            job.check(0, group.epoch(0))
            stalled = group.epoch(1, mid=stop)
            job.check(1, stalled)
            holder.join()
            assert not problems, problems
            recovered = seconds_until(lambda: job.rejoined(STOPPED), timeout=30)
            recovery = time.monotonic() - resumed[0]
            job.check(2, group.epoch(2))
    finally:
        if holder.is_alive():
            holder.join()
        daemon.signal(signal.SIGCONT)

    own = [r for r in stalled if r.rank // RANKS_PER_NODE == STOPPED]
    others = [r for r in stalled if r.rank // RANKS_PER_NODE != STOPPED]
    # The other nodes read the stopped node's samples from the PFS instead.
    assert sum(r.samples.get("pfs", 0) for r in others) > 0, [r.samples for r in others]
    # Its own ranks neither failed nor fell back: their misses waited in its
    # socket until SIGCONT (a stop beyond READ_TIMEOUT_SECONDS would make them
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
        "SIGSTOP a peer daemon mid-epoch, SIGCONT after 3 s", "other nodes read its samples from the PFS; "
        "its own ranks stalled until SIGCONT (no fallback); all peer hits again once it answered",
        recovery, peer_timeout_seconds=PEER_TIMEOUT_SECONDS, stop_seconds=STOP_SECONDS,
        listed_down_after_seconds=round(listed_down[0], 2), rejoin_poll_seconds=round(recovered, 2),
        own_ranks_stall_seconds=round(max(r.wait_seconds for r in own), 2),
    )
