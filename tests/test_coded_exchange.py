"""A job with a coded exchange: its daemons multicast XOR packets first, then stream what is left."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from polling import wait_until
from test_exchange import JOB, NODES, SAMPLES, SIZES, Nodes, staged

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster


def multicast_group() -> str:
    """A group and a free port of this host, so that runs beside this one do
    not hear it; the group's pool of 256 addresses stays below 240.0.0.0."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"239.255.{random.randrange(255)}.{random.randrange(1, 255)}:{port}"


def test_a_coded_exchange_delivers_every_moved_sample_and_the_streams_send_only_what_it_did_not(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = staged(
        cluster,
        tmp_path,
        ["--mode", "partial", "--q", "1", "--exchange-coding", "uber"],
        "--exchange-multicast",
        multicast_group(),
    )
    nodes = Nodes(local)
    try:
        manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
        assert job.spec.exchange_coding == "uber"
        plan = job_plan(job, manifest)
        before = owners(plan, 0)
        after = owners(plan, 1, before)
        sizes = np.array([SIZES[i % len(SIZES)] for i in range(SAMPLES)], dtype=np.int64)
        nodes.report(0)
        runs = nodes.wait_exchanged(1)
        assert [run.coded_note for run in runs] == [""] * NODES
        assert [s.exchange_multicast_note for s in nodes.stats()] == [""] * NODES
        assert sum(run.coded_samples_decoded for run in runs) > 0
        # Each node heard the snapshots and the groups it decodes for, nothing else.
        assert [run.coded_foreign_datagrams for run in runs] == [0] * NODES
        assert all(run.coded_bytes_received > 0 for run in runs)
        assert sum(run.coded_packets_sent for run in runs) > 0
        for m in range(NODES):
            mine = np.flatnonzero(after == m)
            assert nodes.holds(m, mine).all()
            nodes.read(m, mine)  # checks every byte
        moved = sizes[before != after].sum()
        # The streams only carry what a receiver had not committed yet when they offered it.
        assert sum(run.sent_bytes for run in runs) < moved
        assert sum(s.exchange_received_bytes for s in nodes.stats()) >= moved
    finally:
        nodes.close()


@pytest.mark.slow
def test_a_daemon_down_during_the_coded_pass_gets_its_share_from_the_streams_after_its_restart(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = staged(
        cluster,
        tmp_path,
        ["--mode", "partial", "--q", "1", "--exchange-coding", "coded"],
        "--exchange-multicast",
        multicast_group(),
    )
    nodes = Nodes(local)
    try:
        manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
        after = owners(job_plan(job, manifest), 1, owners(job_plan(job, manifest), 0))
        local.kill_node(1)
        nodes.report(0, (0, 2, 3))
        wait_until(
            lambda: all((run := nodes.exchange(m, 1)) is not None and run.coded_note for m in (0, 2, 3)),
            "the others gave up waiting for node 1's snapshot",
            poll=0.2,
        )
        local.restart_node(1)
        nodes.refresh(1)
        nodes.report(0, (1,))
        runs = nodes.wait_exchanged(1)
        assert all("snapshot" in run.coded_note for run in runs)
        for m in range(NODES):
            nodes.read(m, np.flatnonzero(after == m))
            assert nodes.holds(m, np.flatnonzero(after == m)).all()
    finally:
        nodes.close()


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace of its own (loopback up, no routes): its daemons cannot disturb the host's."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    name = f"dqcoded{os.getpid()}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
    try:
        done = _ip("-n", name, "link", "set", "lo", "up")
        assert done.returncode == 0, done.stderr
        yield name
    finally:
        _ip("netns", "del", name)


def _in_namespace(namespace: str, rundir: Path, epochs: int, *daemon_args: str, nodes: int = NODES) -> dict[str, Any]:
    """Runs tests/coded_in_namespace.py in ``namespace``: ``epochs`` coded exchanges of a job of ``nodes`` daemons."""
    rundir.mkdir()
    script = Path(__file__).with_name("coded_in_namespace.py")
    command = [sys.executable, str(script), str(rundir), str(epochs), str(nodes), *daemon_args]
    done = subprocess.run(["ip", "netns", "exec", namespace, *command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads((rundir / "result.json").read_text())
    return result


@pytest.mark.parametrize(
    ("percent", "nodes"),
    [(5, NODES), (1, NODES), pytest.param(1, 8, marks=pytest.mark.slow), pytest.param(5, 8, marks=pytest.mark.slow)],
)
def test_lost_datagrams_and_acknowledgements_never_stall_a_coded_pass(
    namespace: str, tmp_path: Path, percent: int, nodes: int
) -> None:
    if shutil.which("nft") is None:
        pytest.skip("needs nftables (nft) to drop datagrams at random")
    group = multicast_group()
    port = group.rpartition(":")[2]
    assert _ip("-n", namespace, "route", "add", "224.0.0.0/4", "dev", "lo").returncode == 0
    # ``percent`` of the pool's datagrams, and of every other UDP datagram: the acknowledgements.
    one_in = 100 // percent
    rules = (
        f"add table inet loss\n"
        f"add chain inet loss in {{ type filter hook input priority 0; }}\n"
        f"add rule inet loss in udp dport {port} numgen random mod {one_in} 0 drop\n"
        f"add rule inet loss in udp sport != {port} udp dport != {port} numgen random mod {one_in} 0 drop\n"
    )
    added = subprocess.run(
        ["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=rules, text=True, capture_output=True, timeout=30
    )
    if added.returncode != 0:
        pytest.skip(f"nftables cannot filter in the namespace: {added.stderr.strip()}")
    result = _in_namespace(namespace, tmp_path / "run", 4, "--exchange-multicast", group, nodes=nodes)
    runs = [run for epoch in result["runs"] for run in epoch]
    assert len(runs) == 4 * nodes
    assert [run["coded_note"] for run in runs] == [""] * len(runs)
    # A pass that waited out a lost acknowledgement would take PASS_SECONDS (60 s).
    assert max(run["elapsed_seconds"] for run in runs) < 20
    assert sum(run["coded_samples_decoded"] for run in runs) > 0
    assert result["exact"] == 4 * SAMPLES  # every sample of every epoch read back, its checksum checked


def test_a_fabric_without_multicast_is_told_at_start_and_exchanges_uncoded_at_once(
    namespace: str, tmp_path: Path
) -> None:
    side = f"dqnm{os.getpid() % 100000}"
    made = [
        _ip("-n", namespace, "link", "add", f"{side}a", "type", "veth", "peer", "name", f"{side}b"),
        _ip("-n", namespace, "addr", "add", "10.78.0.1/24", "dev", f"{side}a"),
        _ip("-n", namespace, "link", "set", f"{side}a", "multicast", "off"),
        _ip("-n", namespace, "link", "set", f"{side}a", "up"),
        _ip("-n", namespace, "link", "set", f"{side}b", "up"),
    ]
    if made[0].returncode != 0:
        pytest.skip(f"cannot make a veth pair: {made[0].stderr.strip()}")
    assert all(step.returncode == 0 for step in made), [step.stderr for step in made]
    result = _in_namespace(
        namespace,
        tmp_path / "run",
        1,
        "--exchange-multicast",
        multicast_group(),
        "--exchange-multicast-interface",
        "10.78.0.1",
    )
    notes = result["multicast_notes"]
    assert all(f"interface {side}a (10.78.0.1) carries no multicast" in note for note in notes), notes
    runs = result["runs"][0]
    assert [run["coded_note"] for run in runs] == notes
    assert [run["coded_packets_sent"] for run in runs] == [0] * NODES
    # At once: no wait for snapshots (SNAPSHOT_SECONDS, 20 s) that no peer could send.
    assert max(run["elapsed_seconds"] for run in runs) < 10
    assert result["exact"] == SAMPLES
