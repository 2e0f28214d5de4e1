"""A real network partition: node 3's daemon and ranks run in a network
namespace of their own, joined to the rest of the cluster (directory and
daemons on the host side of a veth pair) by that veth alone. Mid-epoch the
link goes down for longer than the peer deadline and the directory lease,
then comes back.

The node's ranks run in its namespace, as trainers share their node's
network: they talk to their daemon over its unix socket, which a namespace
does not cut, so the partition separates the node from the cluster, never
the trainers from their daemon.
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from faultjob import NODES, RANKS_PER_NODE, SAMPLES, make_fault_job

from dataquay.server.tools.local_cluster import LocalCluster, NodeHost

PEER_TIMEOUT_SECONDS = 0.5
#: Daemons are listed down a second after their last heartbeat.
LEASES = ("--lease-seconds", "1", "--heartbeat-seconds", "0.2")
#: How long the link stays down: past the lease and the peer deadline.
CUT_SECONDS = 3.0
CUT = 3


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Link:
    """A network namespace and the veth pair that is its only way out."""

    netns: str
    host_side: str
    far_side: str
    host_address: str
    far_address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Runs a command inside the namespace."""
        return ("ip", "netns", "exec", self.netns)

    def set(self, up: bool) -> None:
        """Takes the namespace's end of the link down (the host's end loses
        its carrier: packets to the node vanish) or brings it back."""
        done = ip("-n", self.netns, "link", "set", self.far_side, "up" if up else "down")
        assert done.returncode == 0, done.stderr


def free_subnet() -> int:
    """A third octet x with 10.77.x.0/24 unused on this machine."""
    used = ip("-4", "addr", "show").stdout + ip("-4", "route", "show").stdout
    free = [x for x in range(1, 255) if f"10.77.{x}." not in used]
    assert free, "every 10.77.x.0/24 is in use"
    return random.choice(free)


def in_other_netns(pid: int) -> bool:
    return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")


@pytest.fixture
def link() -> Iterator[Link]:
    """A namespace joined to this one by a veth pair; skips where namespaces
    cannot be made (not root, no CAP_NET_ADMIN, no ``ip``)."""
    token = secrets.token_hex(3)
    netns = f"dq-part-{token}"
    try:
        created = ip("netns", "add", netns)
    except FileNotFoundError as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    if created.returncode != 0:
        pytest.skip(f"network namespaces unavailable: ip netns add: {created.stderr.strip()}")
    host_side = f"dq{token}h"
    try:
        x = free_subnet()
        made = Link(netns, host_side, f"dq{token}f", f"10.77.{x}.1", f"10.77.{x}.2")
        for args in (
            ("netns", "exec", made.netns, "true"),
            ("link", "add", made.host_side, "type", "veth", "peer", "name", made.far_side, "netns", made.netns),
            ("addr", "add", f"{made.host_address}/24", "dev", made.host_side),
            ("link", "set", made.host_side, "up"),
            ("-n", made.netns, "addr", "add", f"{made.far_address}/24", "dev", made.far_side),
            ("-n", made.netns, "link", "set", made.far_side, "up"),
            ("-n", made.netns, "link", "set", "lo", "up"),
        ):
            done = ip(*args)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the namespace's link: ip {' '.join(args)}: {done.stderr.strip()}")
        yield made
    finally:
        ip("link", "del", host_side)
        ip("netns", "del", netns)


def test_a_partitioned_node_is_read_around_listed_down_and_rejoins(link: Link, tmp_path: Path) -> None:
    local = LocalCluster(
        tmp_path / "cluster",
        NODES,
        ("--peer-timeout", str(PEER_TIMEOUT_SECONDS)),
        LEASES,
        host=link.host_address,
        node_hosts={CUT: NodeHost(link.far_address, link.prefix)},
    )
    try:
        local.start()
        daemon = local.daemons[CUT]
        assert daemon.ready is not None and daemon.ready["tcp"].startswith(f"{link.far_address}:")
        assert daemon.process is not None and in_other_netns(daemon.process.pid)
        job = make_fault_job(local, tmp_path, "global")
        job.stage()
        try:
            with job.ranks() as group:
                assert group.nodes == [f"node-{r // RANKS_PER_NODE}" for r in range(NODES * RANKS_PER_NODE)]
                outage = job.run_outage(group, CUT, lambda: link.set(up=False), lambda: link.set(up=True), CUT_SECONDS)
        finally:
            link.set(up=True)
    finally:
        local.down()

    own = [r for r in outage.during if r.rank // RANKS_PER_NODE == CUT]
    others = [r for r in outage.during if r.rank // RANKS_PER_NODE != CUT]
    # Both sides read what sits across the cut from the PFS, each through its
    # own daemon: no trainer lost its daemon, so none fell back.
    assert sum(r.samples.get("pfs", 0) for r in others) > 0, [r.samples for r in others]
    assert sum(r.samples.get("pfs", 0) for r in own) > 0, [r.samples for r in own]
    assert all(r.samples.get("fallback", 0) == 0 for r in outage.during), [r.samples for r in outage.during]
    for epoch in (0, 2):
        assert set(job.tiers[epoch]) == {"local", "peer"}, job.tiers[epoch]
        assert sum(job.tiers[epoch].values()) == SAMPLES
    job.report(
        "network partition of one node mid-epoch (veth down 3 s)",
        "both sides read across the cut from the PFS "
        "through their own daemons; the node was listed down, then up; all peer hits again once it answered",
        outage.recovery_seconds,
        peer_timeout_seconds=PEER_TIMEOUT_SECONDS,
        cut_seconds=CUT_SECONDS,
        listed_down_after_seconds=round(outage.listed_down_seconds, 2),
    )
