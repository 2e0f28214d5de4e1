"""A rank's side of a cluster job, without a daemon: the spec it joins with, the
plan it derives from the job record, and the sampler it reads by."""

from __future__ import annotations

import json
import logging
import pickle
import re
from typing import Any

import grpc
import numpy as np
import pytest

from dataquay.client import env
from dataquay.client.client import Client
from dataquay.client.connection import DaemonConnection
from dataquay.client.dataset import Dataset
from dataquay.client.errors import DaemonUnavailableError, JobMismatchError, UnknownDatasetError, UnknownJobError
from dataquay.client.job_settings import JobSettings
from dataquay.client.jobs import job_plan, job_spec, join
from dataquay.client.local import SharedLocalCache
from dataquay.client.manifest import Manifest, ManifestWriter
from dataquay.client.placement import JobPlan, epoch_order, owners, rank_length, rank_order
from dataquay.client.remote import RemoteReader
from dataquay.client.sampler import JobSampler, Sampler
from dataquay.client.stats import ReadStats
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb

_OPTIONAL = ("mode", "q", "seed", "drop_last", "ranks_per_node", "partition", "batch_size")
_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "DATAQUAY_JOB",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def tar_manifest(shards: int = 4, per_shard: int = 25) -> Manifest:
    writer = ManifestWriter("/pfs/shards", "tar")
    for shard in range(shards):
        path = writer.add_path(f"shard-{shard:03d}.tar")
        for i in range(per_shard):
            writer.add_sample(path, 512 * (i + 1), 100)
    return Manifest(writer.to_bytes())


def job_record(manifest: Manifest, **spec: Any) -> jpb.Job:
    """A job as the directory returns it: every setting filled in."""
    settings = {
        "job_id": "run-1",
        "dataset": "imnet",
        "mode": "global",
        "q": 0.0,
        "seed": 11,
        "drop_last": False,
        "nodes": ["n0", "n1"],
        "ranks_per_node": 2,
        "partition": "sample",
        **spec,
    }
    return jpb.Job(spec=jpb.JobSpec(**settings), manifest_id=manifest.manifest_id, num_samples=manifest.num_samples)


class FakeClient:
    """Answers JoinJob like a directory holding ``job`` (ranks per node unset
    until a rank names them) and records the epochs reported."""

    def __init__(self, job: jpb.Job, node: str = "n0") -> None:
        self.job = job
        self.info = pb.InfoReply(node=node)
        self.joins: list[tuple[jpb.JobSpec, bool]] = []
        self.reported: list[tuple[str, int]] = []
        self.reported_ranks: list[int | None] = []
        self.positions: list[tuple[str, int, int, int, bool]] = []

    def join_job(self, spec: jpb.JobSpec, must_exist: bool = False) -> jpb.Job:
        self.joins.append((spec, must_exist))
        for field in _OPTIONAL:
            if spec.HasField(field) and getattr(spec, field) != getattr(self.job.spec, field):
                if field == "ranks_per_node" and not self.job.spec.ranks_per_node:
                    self.job.spec.ranks_per_node = spec.ranks_per_node
                    continue
                raise JobMismatchError(f"job {spec.job_id!r} has {field}={getattr(self.job.spec, field)!r}")
        out = jpb.Job()
        out.CopyFrom(self.job)
        return out

    def report_epoch(self, job_id: str, epoch: int, rank: int | None = None, wait_seconds: float = 0.0) -> None:
        self.reported.append((job_id, epoch))
        self.reported_ranks.append(rank)

    def report_position(self, job_id: str, epoch: int, rank: int, position: int, done: bool) -> None:
        self.positions.append((job_id, epoch, rank, position, done))

    # What a dataset reads through; these tests read no samples, and a fake
    # client pickles without them.
    @property
    def local_cache(self) -> SharedLocalCache:
        return SharedLocalCache(lambda: "")

    @property
    def read_stats(self) -> ReadStats:
        return ReadStats()

    @property
    def remote(self) -> RemoteReader:
        return RemoteReader(DaemonConnection("unix:/nonexistent/dataquay.sock"), ReadStats(), timeout=1.0, verify=True)


def test_job_spec_sets_only_the_settings_given_even_when_falsy() -> None:
    bare = job_spec("run-1", "imnet")
    assert (bare.job_id, bare.dataset, list(bare.nodes)) == ("run-1", "imnet", [])
    assert not any(bare.HasField(field) for field in _OPTIONAL)
    spec = job_spec("run-1", "imnet", seed=0, drop_last=False, q=0.0, nodes=["b", "a"])
    assert [f for f in _OPTIONAL if spec.HasField(f)] == ["q", "seed", "drop_last"]
    assert list(spec.nodes) == ["b", "a"]
    full = job_spec(
        "run-1",
        "imnet",
        mode="global",
        q=0.5,
        seed=3,
        drop_last=True,
        ranks_per_node=8,
        partition="shard",
        batch_size=32,
    )
    assert all(full.HasField(f) for f in _OPTIONAL)
    assert (full.mode, full.q, full.seed, full.drop_last, full.ranks_per_node, full.partition, full.batch_size) == (
        "global",
        0.5,
        3,
        True,
        8,
        "shard",
        32,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"job_id": ""}, "job id"),
        ({"mode": "scatter"}, "mode must be one of global"),
        ({"partition": "file"}, "partition must be one of sample, shard"),
    ],
)
def test_job_spec_refuses_what_no_job_can_have(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        job_spec(**{"job_id": "run-1", "dataset": "imnet", **kwargs})


def test_job_plan_follows_the_job_record() -> None:
    manifest = tar_manifest()
    plan = job_plan(job_record(manifest, seed=5, drop_last=True), manifest)
    assert plan == JobPlan(
        JobSettings("run-1", "imnet", seed=5, drop_last=True, nodes=("n0", "n1"), ranks_per_node=2), 100, 2
    )
    assert plan.groups is None
    sharded = job_plan(job_record(manifest, partition="shard", nodes=["a", "b", "c"]), manifest)
    assert sharded.num_nodes == 3 and sharded.settings.partition == "shard"
    assert sharded.groups is not None
    assert np.array_equal(sharded.groups, manifest.shard_groups())
    by_shard = owners(sharded, 0)
    for shard in range(4):
        assert len(set(by_shard[shard * 25 : (shard + 1) * 25].tolist())) == 1


def test_job_plan_carries_the_batch_size_that_locality_needs() -> None:
    manifest = tar_manifest()
    plan = job_plan(job_record(manifest, mode="locality", batch_size=8), manifest)
    settings = JobSettings(
        "run-1", "imnet", mode="locality", seed=11, batch_size=8, nodes=("n0", "n1"), ranks_per_node=2
    )
    assert plan == JobPlan(settings, 100, 2)
    with pytest.raises(ValueError, match="batch_size must be at least 1 for mode locality"):
        job_plan(job_record(manifest, mode="locality"), manifest)


@pytest.mark.parametrize(
    "settings",
    [{"mode": "global"}, {"mode": "local"}, {"mode": "partial", "q": 0.5}, {"mode": "locality", "batch_size": 3}],
)
def test_job_sampler_follows_every_mode_epoch_by_epoch(settings: dict[str, Any]) -> None:
    manifest = tar_manifest()
    job = job_record(manifest, **settings)
    plan = job_plan(job, manifest)
    sampler = JobSampler(job, plan, rank=3, world_size=4)
    for epoch in (0, 1, 2, 4, 3):
        sampler.set_epoch(epoch)
        assert np.array_equal(sampler.owners(), owners(plan, epoch))
        assert np.array_equal(sampler.indices(), rank_order(plan, epoch, 3))
        assert len(sampler) == rank_length(plan) == len(sampler.indices())


def test_job_plan_refuses_a_dataset_replaced_since_the_job_began() -> None:
    old, new = tar_manifest(), tar_manifest(per_shard=26)
    with pytest.raises(JobMismatchError, match="dataset 'imnet' was replaced since job 'run-1' started"):
        job_plan(job_record(old), new)


def test_a_job_no_rank_has_joined_has_owners_but_no_rank_orders_yet() -> None:
    manifest = tar_manifest()
    plan = job_plan(job_record(manifest, ranks_per_node=0), manifest)
    assert np.array_equal(owners(plan, 0), owners(job_plan(job_record(manifest), manifest), 0))
    with pytest.raises(ValueError, match="no ranks per node yet"):
        rank_order(plan, 0, 0)


def test_shard_groups_are_files_for_tar_and_npy_and_folders_for_files() -> None:
    assert tar_manifest(3, 2).shard_groups().tolist() == [0, 0, 1, 1, 2, 2]
    writer = ManifestWriter("/pfs/imgs", "files")
    for name, label in [("cat/1.jpg", "cat"), ("dog/2.jpg", "dog"), ("cat/3.jpg", "cat"), ("4.jpg", None)]:
        writer.add_sample(writer.add_path(name), 0, 10, label)
    groups = Manifest(writer.to_bytes()).shard_groups()
    assert groups.dtype == np.int32
    assert groups.tolist() == [0, 1, 0, 2 + 3]  # unlabelled: after the 2 labels, by its path index


def test_join_sets_ranks_per_node_from_the_world_when_no_rank_knew_them() -> None:
    manifest = tar_manifest()
    client = FakeClient(job_record(manifest, ranks_per_node=0, nodes=["n0", "n1", "n2"]))
    job = join(client, job_spec("run-1", "imnet"), world_size=12)
    assert job.spec.ranks_per_node == 4
    assert [(spec.ranks_per_node, must) for spec, must in client.joins] == [(0, False), (4, True)]
    assert join(client, job_spec("run-1", "imnet"), world_size=12).spec.ranks_per_node == 4
    assert len(client.joins) == 3


def test_join_refuses_a_world_that_does_not_divide_over_the_nodes() -> None:
    client = FakeClient(job_record(tar_manifest(), ranks_per_node=0, nodes=["n0", "n1", "n2"]))
    with pytest.raises(ValueError, match="world size 10 does not divide over the 3 nodes of job 'run-1'"):
        join(client, job_spec("run-1", "imnet"), world_size=10)


def test_job_sampler_reads_the_placement_order_and_reports_epochs() -> None:
    manifest = tar_manifest()
    job = job_record(manifest)
    plan = job_plan(job, manifest)
    reporter = FakeClient(job)
    samplers = [JobSampler(job, plan, rank=r, world_size=4, reporter=reporter) for r in range(4)]
    assert isinstance(samplers[0], Sampler)
    assert [s.node for s in samplers] == [0, 0, 1, 1]
    for epoch in (0, 3):
        for s in samplers:
            s.set_epoch(epoch)
        assert all(np.array_equal(s.indices(), rank_order(plan, epoch, s.rank)) for s in samplers)
        assert all(list(s) == rank_order(plan, epoch, s.rank).tolist() and len(s) == 25 for s in samplers)
    assert reporter.reported == [("run-1", 0)] * 4 + [("run-1", 3)] * 4
    assert reporter.reported_ranks == [0, 1, 2, 3] * 2  # its node keeps what it gave away until they read it
    # Each rank's read position: a step in (16 ids), and once it read its whole epoch (25 ids).
    assert reporter.positions == [
        ("run-1", epoch, r, position, position == 25) for epoch in (0, 3) for r in range(4) for position in (16, 25)
    ]
    assert np.array_equal(samplers[2].owners(), owners(plan, 3))
    assert "job='run-1'" in repr(samplers[1]) and "node=0" in repr(samplers[1])


@pytest.mark.parametrize(
    ("rank", "world", "message"),
    [
        (4, 4, "rank 4 is outside the world: world size 4 = 2 nodes x 2 ranks per node of job 'run-1'"),
        (-1, 4, "rank -1 is outside the world"),
        (0, 6, "world size 6 does not match the job's 4 = 2 nodes x 2 ranks per node"),
    ],
)
def test_job_sampler_refuses_a_rank_outside_the_jobs_world(rank: int, world: int, message: str) -> None:
    manifest = tar_manifest()
    job = job_record(manifest)
    with pytest.raises(ValueError, match=re.escape(message)):
        JobSampler(job, job_plan(job, manifest), rank=rank, world_size=world)


def test_job_sampler_pickles_with_its_job_plan_and_epoch() -> None:
    manifest = tar_manifest()
    job = job_record(manifest, partition="shard")
    sampler = JobSampler(job, job_plan(job, manifest), rank=3, world_size=4)
    sampler.set_epoch(2)
    copy = pickle.loads(pickle.dumps(sampler))
    assert (copy.job, copy.plan, copy.epoch, copy.node) == (job, sampler.plan, 2, 1)
    assert np.array_equal(copy.indices(), sampler.indices())
    assert np.array_equal(copy.owners(), sampler.owners())


@pytest.mark.parametrize("settings", [{"mode": "global"}, {"mode": "partial", "q": 0.5}])
def test_a_restarted_job_sampler_resumes_the_epoch_in_the_jobs_order(settings: dict[str, Any]) -> None:
    manifest = tar_manifest()
    job = job_record(manifest, **settings)
    plan = job_plan(job, manifest)
    sampler = JobSampler(job, plan, rank=3, world_size=4)
    sampler.set_epoch(3)
    ids = iter(sampler)
    head = [next(ids) for _ in range(7)]
    state = json.loads(json.dumps(sampler.state_dict()))
    assert (state["job"], state["epoch"], state["position"]) == ("run-1", 3, 7)
    reporter = FakeClient(job)
    restarted = JobSampler(job, plan, rank=3, world_size=4, reporter=reporter)
    restarted.load_state_dict(state)
    restarted.set_epoch(3)
    assert head + list(restarted) == rank_order(plan, 3, 3).tolist()
    restarted.set_epoch(4)
    assert list(restarted) == rank_order(plan, 4, 3).tolist()
    assert reporter.reported == [("run-1", 3), ("run-1", 4)]


def test_a_job_sampler_refuses_the_state_of_another_job() -> None:
    manifest = tar_manifest()
    job, other = job_record(manifest), job_record(manifest, job_id="run-2")
    state = JobSampler(job, job_plan(job, manifest), rank=0, world_size=4).state_dict()
    sampler = JobSampler(other, job_plan(other, manifest), rank=0, world_size=4)
    with pytest.raises(ValueError, match=re.escape("saved with job='run-1' but this sampler has job='run-2'")):
        sampler.load_state_dict(state)


@pytest.mark.parametrize(("nodes", "ranks_per_node"), [(["n0", "n1", "n2"], 2), (["n0", "n1", "n2"], 1)])
def test_a_job_in_mode_global_resumes_on_another_world_size_in_the_same_order(
    nodes: list[str], ranks_per_node: int
) -> None:
    manifest = tar_manifest()
    job = job_record(manifest)
    plan = job_plan(job, manifest)
    ranks = [JobSampler(job, plan, rank=r, world_size=4) for r in range(4)]
    heads = []
    for sampler in ranks:
        sampler.set_epoch(2)
        ids = iter(sampler)
        heads.append([next(ids) for _ in range(3)])
    state = json.loads(json.dumps(ranks[1].state_dict()))
    world = len(nodes) * ranks_per_node  # 4 ranks resumed on 6, or on 3
    wider = job_record(manifest, nodes=nodes, ranks_per_node=ranks_per_node)
    wider_plan = job_plan(wider, manifest)
    resumed = [JobSampler(wider, wider_plan, rank=r, world_size=world) for r in range(world)]
    for sampler in resumed:
        sampler.load_state_dict(state)
        sampler.set_epoch(2)
    tails = [list(sampler) for sampler in resumed]
    read = [i for step in zip(*heads) for i in step] + [i for step in zip(*tails) for i in step]
    order = epoch_order(manifest.num_samples, job.spec.seed, 2).tolist()
    # Every id once, in the global order; only the last step's padding repeats ids.
    assert read[: manifest.num_samples] == order and len(read) - manifest.num_samples < world


def test_a_job_that_deals_each_node_its_own_samples_refuses_a_state_of_another_world() -> None:
    manifest = tar_manifest()
    job = job_record(manifest, mode="local")
    state = JobSampler(job, job_plan(job, manifest), rank=0, world_size=4).state_dict()
    wider = job_record(manifest, mode="local", nodes=["n0", "n1", "n2"])
    sampler = JobSampler(wider, job_plan(wider, manifest), rank=0, world_size=6)
    with pytest.raises(ValueError, match="mode local deals each node its own samples"):
        sampler.load_state_dict(state)


def dataset(client: FakeClient, manifest: Manifest) -> Dataset:
    return Dataset(
        client,
        pb.DatasetInfo(name="imnet"),
        manifest,
        local=client.local_cache,
        remote=client.remote,
        stats=client.read_stats,
    )


def test_dataset_sampler_without_a_job_is_the_plain_sampler() -> None:
    manifest = tar_manifest()
    ds = dataset(FakeClient(job_record(manifest)), manifest)
    sampler = ds.sampler(rank=1, world_size=3)
    assert type(sampler) is Sampler
    assert (sampler.seed, sampler.drop_last, sampler.shuffle) == (0, False, True)
    assert list(sampler) == list(Sampler(100, rank=1, world_size=3))
    assert ds.job is None
    with pytest.raises(ValueError, match="mode, partition apply to cluster jobs: pass job= or set DATAQUAY_JOB"):
        ds.sampler(mode="global", partition="shard")
    with pytest.raises(ValueError, match="batch_size apply to cluster jobs"):
        ds.sampler(batch_size=32)


def test_dataset_sampler_joins_the_job_from_the_environment_and_binds_the_dataset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest = tar_manifest()
    client = FakeClient(job_record(manifest, ranks_per_node=0, nodes=["n0", "n1"]), node="n1")
    monkeypatch.setenv("DATAQUAY_JOB", "run-1")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ds = dataset(client, manifest)
    sampler = ds.sampler(seed=11)
    assert isinstance(sampler, JobSampler)
    assert (sampler.rank, sampler.world_size, sampler.node, sampler.plan.settings.ranks_per_node) == (5, 8, 1, 4)
    spec, must_exist = client.joins[0]
    assert (spec.job_id, spec.dataset, spec.seed, spec.ranks_per_node, must_exist) == ("run-1", "imnet", 11, 4, False)
    assert not spec.HasField("mode") and not spec.HasField("drop_last")
    assert ds.job == "run-1" and pickle.loads(pickle.dumps(ds)).job == "run-1"
    with pytest.raises(JobMismatchError, match="seed"):
        ds.sampler(seed=12)
    with pytest.raises(ValueError, match="reads for job 'run-1'; open it again"):
        ds.sampler(job="run-2")
    with pytest.raises(ValueError, match="shuffle=False"):
        ds.sampler(shuffle=False)


def test_a_rank_placed_on_another_node_than_it_runs_on_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    manifest = tar_manifest()
    ds = dataset(FakeClient(job_record(manifest), node="n1"), manifest)
    with caplog.at_level(logging.WARNING, logger="dataquay.client"):
        ds.sampler(job="run-1", rank=0, world_size=4)
    assert "rank 0 runs on node 'n1' but job 'run-1' places it on 'n0'" in caplog.text


def test_environment_names_the_job_and_the_ranks_per_node_only_when_set() -> None:
    assert env.job_id({}) is None and env.job_id({"DATAQUAY_JOB": " "}) is None
    assert env.job_id({"DATAQUAY_JOB": "run-1"}) == "run-1"
    assert env.local_world_size({}) is None
    assert env.local_world_size({"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert env.local_world_size({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"}) == 8


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _RefusingStub:
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.refusal = _Refusal(code, details)

    def JoinJob(self, request: jpb.JoinJobRequest, timeout: float) -> jpb.Job:
        raise self.refusal

    def ReportEpoch(self, request: jpb.ReportEpochRequest, timeout: float) -> jpb.Job:
        raise self.refusal

    def ReportClientStats(self, request: object, timeout: float) -> None:
        raise self.refusal


def unconnected_client(address: str = "unix:/nonexistent/dataquay.sock") -> Client:
    """A client as a spawned worker unpickles it: it connects on first use."""
    client = Client.__new__(Client)
    client.__setstate__({"address": address, "timeout": 1.0, "verify": True, "info": b""})
    return client


@pytest.mark.parametrize(
    ("code", "must_exist", "error"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, False, JobMismatchError),
        (grpc.StatusCode.NOT_FOUND, True, UnknownJobError),
        (grpc.StatusCode.NOT_FOUND, False, UnknownDatasetError),
    ],
)
def test_join_job_refusals_become_errors_a_user_can_catch(
    monkeypatch: pytest.MonkeyPatch, code: grpc.StatusCode, must_exist: bool, error: type[Exception]
) -> None:
    client = unconnected_client()
    refusing = _RefusingStub(code, "job 'run-1' has seed=1, not 2")
    monkeypatch.setattr(client._connection, "_channel_stub", lambda: refusing)
    with pytest.raises(error, match="job 'run-1' has seed=1"):
        client.join_job(job_spec("run-1", "imnet", seed=2), must_exist=must_exist)
    client.report_epoch("run-1", 3)  # best effort: never raises


def test_report_epoch_without_a_daemon_does_not_stop_training(caplog: pytest.LogCaptureFixture) -> None:
    client = unconnected_client()
    with caplog.at_level(logging.DEBUG, logger="dataquay.client"):
        client.report_epoch("run-1", 3)
    assert "epoch 3 of job 'run-1' not reported" in caplog.text
    with pytest.raises(DaemonUnavailableError):
        client.join_job(job_spec("run-1", "imnet"))
    client.close()
