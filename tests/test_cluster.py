"""A whole cluster on loopback: `dataquay cluster up|down`, and a job of 8
ranks in separate processes over 4 daemons, with nodes and the directory
killed under it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.sampler import JobSampler
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.tools.env_files import read_env_file
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.pids import stat_state
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes
from dataquay.server.tools.trainers import RankEpoch, RankGroup

NODES = 4
RANKS_PER_NODE = 2
SAMPLES = 480  # divides over 8 ranks: no padding, so exactly-once is checkable
SIZES = (2000, 3100, 4500)
JOB = "job-1"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *args], capture_output=True, text=True, timeout=90
    )


def running(pid: int) -> bool:
    try:
        state = stat_state(Path(f"/proc/{pid}/stat"))
    except OSError:
        return False
    return state != "Z"


def test_cluster_up_writes_env_files_and_down_stops_every_process(tmp_path: Path) -> None:
    base = tmp_path / "my cluster"  # a space: the env files must quote it
    up = run_cli("cluster", "up", "--nodes", str(NODES), "--base-dir", str(base), "--cache-size", "64M")
    try:
        assert up.returncode == 0, up.stderr
        assert f"source {shlex.quote(str(base / 'cluster.env'))}" in up.stdout
        assert f"dataquay cluster down --base-dir {shlex.quote(str(base))}" in up.stdout
        record = json.loads((base / "cluster.json").read_text())
        pids = [record["directory"]["pid"], *(d["pid"] for d in record["daemons"])]
        assert all(running(pid) for pid in pids)  # outlived `cluster up`

        env = read_env_file(base / "cluster.env")
        assert env["DATAQUAY_CLUSTER_DIR"] == str(base) and env["DATAQUAY_NODES"] == str(NODES)
        nodes = [read_env_file(base / f"node-{i}.env") for i in range(NODES)]
        assert [n["DATAQUAY_NODE_NAME"] for n in nodes] == [f"node-{i}" for i in range(NODES)]
        assert all(n["DATAQUAY_DIRECTORY"] == env["DATAQUAY_DIRECTORY"] for n in nodes)
        sourced = subprocess.run(
            ["sh", "-c", 'set -a; . "$1"; . "$2"; set +a; env', "sh", base / "cluster.env", base / "node-1.env"],
            capture_output=True,
            text=True,
            check=True,
            env={"PATH": os.environ["PATH"]},
        ).stdout.splitlines()
        assert {**env, **nodes[1]}.items() <= dict(line.partition("=")[::2] for line in sourced).items()

        with urllib.request.urlopen(env["DATAQUAY_SD_URL"], timeout=10) as reply:
            groups = json.load(reply)
        targets = {t for g in groups for t in g["targets"]}
        assert targets == {n["DATAQUAY_METRICS_URL"].removeprefix("http://").removesuffix("/metrics") for n in nodes}

        again = run_cli("cluster", "up", "--nodes", "2", "--base-dir", str(base))
        assert again.returncode == 1 and f"already running in {base}" in again.stderr

        down = run_cli("cluster", "down", "--base-dir", str(base))
        assert down.returncode == 0, down.stderr
        assert not any(running(pid) for pid in pids)
        assert not (base / "cluster.json").exists() and not (base / "cluster.env").exists()
        gone = run_cli("cluster", "down", "--base-dir", str(base))
        assert gone.returncode == 1 and f"no cluster in {base}" in gone.stderr
    finally:
        leftover = LocalCluster.load(base)
        if leftover is not None:
            leftover.down()


def test_cluster_down_after_the_processes_died_cleans_up(tmp_path: Path) -> None:
    base = tmp_path / "c"
    local = LocalCluster(base, 1, detached=True).start()
    local.kill_node(0)
    local.kill_directory()
    loaded = LocalCluster.load(base)
    assert loaded is not None and loaded.running() == []
    down = run_cli("cluster", "down", "--base-dir", str(base))
    assert down.returncode == 0 and "was not running" in down.stdout
    assert not (base / "cluster.json").exists()


# ------------------------------------------------------------ a job of 8 ranks


def expected_checksums() -> np.ndarray:
    """The checksum of every sample as make_files_dataset wrote it."""
    return np.array([checksum(sample_bytes(0, i, SIZES[i % len(SIZES)])) for i in range(SAMPLES)], dtype=np.uint64)


def staged_cluster(cluster: Callable[..., LocalCluster], tmp_path: Path) -> LocalCluster:
    """4 daemons with the dataset "imgs" registered and staged for job JOB."""
    local = cluster(NODES)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                "--ranks-per-node",
                str(RANKS_PER_NODE),
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    return local


def ranks(local: LocalCluster, tmp_path: Path) -> RankGroup:
    envs = [local.rank_env(r, RANKS_PER_NODE, JOB) for r in range(NODES * RANKS_PER_NODE)]
    return RankGroup(envs, "imgs", tmp_path / "ranks", batch=16, timeout=60)


def assert_every_sample_once_and_intact(results: list[RankEpoch], expected: np.ndarray) -> None:
    ids = np.concatenate([r.ids for r in results]).astype(np.int64)
    sums = np.concatenate([np.asarray(r.checksums, dtype=np.uint64) for r in results])
    assert sorted(ids.tolist()) == list(range(SAMPLES))
    assert np.array_equal(sums, expected[ids])


def tiers(results: list[RankEpoch]) -> dict[str, int]:
    return {t: sum(r.samples[t] for r in results) for t in results[0].samples}


def daemon_stats(local: LocalCluster) -> list[pb.StatsReply]:
    out = []
    for daemon in local.daemons:
        assert daemon.ready is not None
        with grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()) as channel:
            out.append(cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10))
    return out


def get_job(local: LocalCluster) -> jpb.Job:
    with grpc.insecure_channel(local.directory_address, options=channel_options()) as channel:
        job: jpb.Job = directory_pb2_grpc.DirectoryStub(channel).GetJob(jpb.GetJobRequest(job_id=JOB), timeout=10)
        return job


def test_global_epochs_read_every_sample_once_from_local_and_peer_caches(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = staged_cluster(cluster, tmp_path)
    expected = expected_checksums()
    pfs_after_staging = [s.pfs_bytes for s in daemon_stats(local)]
    peer_samples = 0
    with ranks(local, tmp_path) as group:
        assert group.nodes == [f"node-{r // RANKS_PER_NODE}" for r in range(NODES * RANKS_PER_NODE)]
        for epoch in range(2):
            results = group.epoch(epoch)
            assert_every_sample_once_and_intact(results, expected)
            counts = tiers(results)
            assert counts["pfs"] == counts["fallback"] == 0
            # Each node staged a quarter: the rest of a global epoch comes from peers.
            assert 0.15 < counts["local"] / SAMPLES < 0.35 and counts["peer"] > SAMPLES // 2
            peer_samples += counts["peer"]
    stats = daemon_stats(local)
    assert [s.pfs_bytes for s in stats] == pfs_after_staging
    assert sum(t.samples for s in stats for t in s.reads if t.tier == pb.TIER_PEER) == peer_samples
    assert sum(p.samples for s in stats for p in s.peers) == peer_samples


def test_a_rank_whose_daemon_is_down_joins_through_the_directory_and_reads_its_epoch(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(2)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[1].address]) == 0
    assert (
        cli_main(
            ["stage", "imgs", "--job", JOB, "--ranks-per-node", "1", "--quiet", "--directory", local.directory_address]
        )
        == 0
    )
    local.kill_node(0)
    job = get_job(local)
    with grpc.insecure_channel(local.directory_address, options=channel_options()) as channel:
        request = pb.GetDatasetRequest(name="imgs")
        manifest = Manifest(b"".join(c.data for c in directory_pb2_grpc.DirectoryStub(channel).GetManifest(request)))
    sampler = JobSampler(job, job_plan(job, manifest), rank=0, world_size=2)
    sampler.set_epoch(0)
    want = sampler.indices()

    # Rank 0's DATAQUAY_ADDR names the dead daemon's socket; DATAQUAY_DIRECTORY is set. It need not
    # wait out connect's whole timeout for a daemon known to be gone.
    with RankGroup(
        [local.rank_env(0, 1, JOB)], "imgs", tmp_path / "ranks", batch=16, timeout=90, connect_timeouts=[0.5]
    ) as group:
        (result,) = group.epoch(0)
    assert result.ids == want.tolist()
    assert result.checksums == expected_checksums()[want].tolist()
    assert result.samples["fallback"] == len(want) == SAMPLES // 2


def test_daemon_killed_mid_epoch_serves_its_samples_from_pfs_and_is_listed_down(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = staged_cluster(cluster, tmp_path)
    expected = expected_checksums()
    with ranks(local, tmp_path) as group:
        results = group.epoch(0, mid=lambda: local.kill_node(3))
        assert_every_sample_once_and_intact(results, expected)
        counts = tiers(results)
        assert counts["pfs"] + counts["fallback"] > 0
        nodes = local.wait_for_nodes(up=["node-0", "node-1", "node-2"], down=["node-3"], timeout=15)
        assert [n.state for n in nodes] == [jpb.NODE_UP] * 3 + [jpb.NODE_DOWN]

        capsys.readouterr()
        assert cli_main(["status", "--directory", local.directory_address]) == 0
        status = capsys.readouterr().out
        assert "node-3  down" in status and "job-1" in status
        assert cli_main(["stage", "imgs", "--job", JOB, "--quiet", "--directory", local.directory_address]) == 1
        assert "failed on 1 of 4 nodes: node-3 (down)" in capsys.readouterr().err

        local.restart_node(3)
        local.wait_for_nodes(up=[f"node-{i}" for i in range(NODES)], timeout=15)
        assert_every_sample_once_and_intact(group.epoch(1), expected)


def test_directory_restarted_mid_job_keeps_the_job_and_the_job_goes_on(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = staged_cluster(cluster, tmp_path)
    expected = expected_checksums()
    job_before = get_job(local)
    pfs_after_staging = sum(s.pfs_bytes for s in daemon_stats(local))
    with ranks(local, tmp_path) as group:
        results = group.epoch(0, mid=local.kill_directory)
        assert_every_sample_once_and_intact(results, expected)
        local.restart_directory()
        assert get_job(local).spec == job_before.spec
        local.wait_for_nodes(up=[f"node-{i}" for i in range(NODES)], timeout=15)
        results = group.epoch(1)
        assert_every_sample_once_and_intact(results, expected)
        assert tiers(results)["pfs"] == tiers(results)["fallback"] == 0
    assert sum(s.pfs_bytes for s in daemon_stats(local)) == pfs_after_staging
