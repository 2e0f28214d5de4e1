"""A job with a coded exchange: its daemons multicast XOR packets first, then stream what is left."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from pathlib import Path

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
    """A group and a free port of this host, so that runs beside this one do not hear it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"239.255.{random.randrange(256)}.{random.randrange(1, 255)}:{port}"


def test_a_coded_exchange_delivers_every_moved_sample_and_the_streams_send_only_what_it_did_not(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = staged(cluster, tmp_path, ["--mode", "partial", "--q", "1", "--exchange-coding", "uber"],
                   "--exchange-multicast", multicast_group())
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
        assert sum(run.coded_samples_decoded for run in runs) > 0
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
    local = staged(cluster, tmp_path, ["--mode", "partial", "--q", "1", "--exchange-coding", "coded"],
                   "--exchange-multicast", multicast_group())
    nodes = Nodes(local)
    try:
        manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
        after = owners(job_plan(job, manifest), 1, owners(job_plan(job, manifest), 0))
        local.kill_node(1)
        nodes.report(0, (0, 2, 3))
        wait_until(lambda: all((run := nodes.exchange(m, 1)) is not None and run.coded_note for m in (0, 2, 3)),
                   "the others gave up waiting for node 1's snapshot", poll=0.2)
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
