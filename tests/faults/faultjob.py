"""A training job on a 4-node loopback cluster that a fault scenario breaks,
and the record each scenario leaves of how it went.

Set DATAQUAY_FAULT_REPORT to a file name and each scenario appends one JSON
line to it: what was broken, what happened, how long recovery took, and the
samples each tier served per epoch (docs/reliability.md is built from it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from checker import epoch_problems, pfs_digests, tier_counts
from polling import wait_until

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan, owners, rank_order
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import RankEpoch, RankGroup

NODES = 4
RANKS_PER_NODE = 2
SAMPLES = 480  # divides over 8 ranks: no padding, so every id is read exactly once
SIZES = (2000, 3100, 4500)
DATASET = "imgs"
JOB = "faults"
SEED = 7
#: Job settings per mode; ``partial`` moves a quarter of every node's samples each epoch.
MODES: dict[str, tuple[str, ...]] = {
    "global": ("--mode", "global"),
    "partial": ("--mode", "partial", "--q", "0.25"),
    "local": ("--mode", "local"),
    # b = 15: 8 ranks x 15 divides 480, so no step is padded.
    "locality": ("--mode", "locality", "--batch-size", "15"),
}


@dataclass(frozen=True)
class Outage:
    """How a job went through a node's outage (see :meth:`FaultJob.run_outage`)."""

    #: What the ranks read in the epoch of the outage.
    during: list[RankEpoch]
    #: From the cut until the directory listed the node down.
    listed_down_seconds: float
    #: From the mend until the cluster read as before (:meth:`FaultJob.rejoined`).
    recovery_seconds: float


@dataclass
class FaultJob:
    """A 4-node cluster, the dataset "imgs" registered on it, and job "faults"
    of 8 ranks (2 per node) in one mode; see the ``fault_job`` fixture."""

    local: LocalCluster
    root: Path
    mode: str
    work_dir: Path
    #: xxh3 of every file, hashed before any fault touched the PFS.
    digests: np.ndarray
    #: Per epoch: samples by tier, summed over ranks.
    tiers: list[dict[str, int]] = field(default_factory=list)

    @property
    def plan(self) -> JobPlan:
        mode_args = dict(zip(MODES[self.mode][::2], MODES[self.mode][1::2]))
        q = float(mode_args.get("--q", 0.0))
        batch_size = int(mode_args.get("--batch-size", 0))
        # The job's record names its dataset and nodes, which placement hashes.
        settings = JobSettings(
            dataset=DATASET,
            mode=self.mode,
            q=q,
            seed=SEED,
            ranks_per_node=RANKS_PER_NODE,
            batch_size=batch_size,
            nodes=tuple(node_name(i) for i in range(NODES)),
        )
        return JobPlan(settings, SAMPLES, NODES)

    def stage_command(self) -> list[str]:
        """The CLI that creates the job and stages each node's share of it."""
        return [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "stage",
            DATASET,
            "--job",
            JOB,
            *MODES[self.mode],
            "--seed",
            str(SEED),
            "--ranks-per-node",
            str(RANKS_PER_NODE),
            "--quiet",
            "--directory",
            self.local.directory_address,
        ]

    def stage(self) -> subprocess.CompletedProcess[str]:
        """Stages the job; fails the test unless every node staged its share."""
        done = subprocess.run(self.stage_command(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done

    def ranks(self, batch: int = 16) -> RankGroup:
        """The job's ranks, each where its node's daemon runs (its network namespace, if any)."""
        ranks = range(NODES * RANKS_PER_NODE)
        envs = [self.local.rank_env(r, RANKS_PER_NODE, JOB) for r in ranks]
        prefixes = [self.local.daemons[r // RANKS_PER_NODE].prefix for r in ranks]
        return RankGroup(envs, DATASET, self.work_dir / "ranks", batch=batch, timeout=90, prefixes=prefixes)

    def check(self, epoch: int, results: Sequence[RankEpoch]) -> None:
        """Fails the test on any wrong, missing or duplicated sample; keeps the tiers."""
        orders = [rank_order(self.plan, epoch, rank) for rank in range(NODES * RANKS_PER_NODE)]
        problems = epoch_problems(epoch, results, orders, self.digests)
        assert not problems, "\n".join(problems)
        self.tiers.append(tier_counts(results))

    def run_epochs(self, group: RankGroup, epochs: int = 3, mid: dict[int, Callable[[], None]] | None = None) -> None:
        """Runs and checks ``epochs`` epochs; ``mid[e]`` breaks something halfway through epoch e."""
        for epoch in range(epochs):
            self.check(epoch, group.epoch(epoch, mid=(mid or {}).get(epoch)))

    def run_outage(
        self, group: RankGroup, node: int, cut: Callable[[], None], mend: Callable[[], None], seconds: float
    ) -> Outage:
        """Epoch 0; then halfway through epoch 1 ``cut()`` cuts ``node`` off and
        the ranks read on while, ``seconds`` later and once the directory lists
        it down (the outage outlasts its lease however slowly the directory
        notices), ``mend()`` brings it back; once it rejoined, epoch 2. Every
        epoch is checked."""
        name = node_name(node)
        listed_down: list[float] = []
        mended: list[float] = []
        problems: list[str] = []

        def hold(cut_at: float) -> None:
            try:
                listed_down.append(wait_until(lambda: name not in self.listed_up(), f"the directory lists {name} down"))
            except AssertionError as exc:
                problems.append(str(exc))
            finally:
                time.sleep(max(0.0, cut_at + seconds - time.monotonic()))
                mend()
                mended.append(time.monotonic())

        holder = threading.Thread(target=lambda: hold(time.monotonic()))

        def start_outage() -> None:
            cut()
            holder.start()

        try:
            self.check(0, group.epoch(0))
            during = group.epoch(1, mid=start_outage)
            self.check(1, during)
            holder.join()
            assert not problems, problems
            wait_until(lambda: self.rejoined(node), f"{name} rejoined")
            recovery = time.monotonic() - mended[0]
            self.check(2, group.epoch(2))
        finally:
            if holder.is_alive():
                holder.join()
        return Outage(during, listed_down[0], recovery)

    def stats(self, index: int) -> pb.StatsReply:
        ready = self.local.daemons[index].ready
        assert ready is not None
        with grpc.insecure_channel(ready["tcp"], options=channel_options()) as channel:
            reply: pb.StatsReply = cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10)
            return reply

    def exchanged(self, epoch: int) -> bool:
        """Whether every node's exchange into ``epoch`` finished."""
        runs = [
            next((x for x in self.stats(m).exchanges if x.job == JOB and x.epoch == epoch), None) for m in range(NODES)
        ]
        return all(run is not None and run.finished for run in runs)

    def read_tiers(self, through: int, ids: Sequence[int]) -> list[str]:
        """Where node ``through``'s daemon gets ``ids`` from when its ranks miss
        them in this job (local, peer, pfs), asked over its unix socket as they would."""
        request = pb.ReadRequest(dataset=DATASET, ids=ids, job=JOB)
        with self.local.credentials().channel(self.local.daemons[through].address, channel_options()) as channel:
            chunks = cache_pb2_grpc.CacheStub(channel).Read(request, timeout=30)
            return [pb.Tier.Name(s.tier).removeprefix("TIER_").lower() for c in chunks for s in c.samples]

    def listed_up(self) -> set[str]:
        """The nodes the directory lists as up."""
        local = self.local
        with local.credentials().channel(local.live_directory().address, channel_options()) as channel:
            reply = directory_pb2_grpc.DirectoryStub(channel).ListNodes(dpb.ListNodesRequest(), timeout=10)
        return {n.info.name for n in reply.nodes if n.state == jpb.NODE_UP}

    def record(self) -> jpb.Job:
        """The job as the directory keeps it."""
        local = self.local
        with local.credentials().channel(local.live_directory().address, channel_options()) as channel:
            job: jpb.Job = directory_pb2_grpc.DirectoryStub(channel).GetJob(jpb.GetJobRequest(job_id=JOB), timeout=10)
            return job

    def rejoined(self, node: int, epoch: int = 0) -> bool:
        """Whether the cluster is whole again after a fault of ``node``: the
        directory lists every node up, ``node`` reads a sample of every other
        node as a peer hit, and every other node one of ``node``'s (owners
        of ``epoch``)."""
        if self.listed_up() != {node_name(i) for i in range(NODES)}:
            return False
        held = owners(self.plan, epoch)
        sample = {j: int(np.flatnonzero(held == j)[0]) for j in range(NODES)}
        pairs = [(node, j) for j in range(NODES) if j != node] + [(i, node) for i in range(NODES) if i != node]
        return all(self.read_tiers(i, [sample[j]]) == ["peer"] for i, j in pairs)

    def report(self, scenario: str, outcome: str, recovery_seconds: float | None, **more: object) -> None:
        """Appends this scenario's record to DATAQUAY_FAULT_REPORT, if set."""
        path = os.environ.get("DATAQUAY_FAULT_REPORT")
        if not path:
            return
        record = {
            "scenario": scenario,
            "mode": self.mode,
            "outcome": outcome,
            "recovery_seconds": None if recovery_seconds is None else round(recovery_seconds, 2),
            "tiers": self.tiers,
            **more,
        }
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def make_fault_job(local: LocalCluster, work_dir: Path, mode: str) -> FaultJob:
    """Writes the dataset's files, hashes them and registers them with the cluster."""
    root = make_files_dataset(work_dir / "pfs", SAMPLES, sizes=SIZES)
    added = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "dataset",
            "add",
            DATASET,
            str(root),
            "--addr",
            local.daemons[0].address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    return FaultJob(local, root, mode, work_dir, pfs_digests(root))
