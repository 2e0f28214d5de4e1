"""A job checkpointed on 4 ranks resumes on 3 and on 6 through a real
loopback cluster: the ranks read through their nodes' daemons, the job is
dropped at the directory (its allocation ended) and joined again under the
same id on another node set, and the resumed ranks read the rest of the
epoch's job-wide order, each sample once, then the next epoch's order."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from dataquay.client import connect
from dataquay.client.dataset import Dataset
from dataquay.client.placement import epoch_order
from dataquay.client.sampler import Sampler
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

N, SIZE, SEED, EPOCH, STEPS = 96, 1500, 7, 2, 5
PAYLOADS = [sample_bytes(0, i, SIZE) for i in range(N)]


def ranks(
    local: LocalCluster, nodes: int, per_node: int, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[Sampler, Dataset]]:
    """The job's ranks, ``per_node`` on each of the first ``nodes`` nodes, each
    joined through its node's daemon; (sampler, dataset) per rank."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    names = [node_name(m) for m in range(nodes)]
    joined = []
    for rank in range(nodes * per_node):
        ds = connect(local.daemons[rank // per_node].address).dataset("imgs")
        sampler = ds.sampler(job="resume", nodes=names, seed=SEED, rank=rank, world_size=nodes * per_node)
        sampler.set_epoch(EPOCH)
        joined.append((sampler, ds))
    return joined


def read_steps(group: list[tuple[Sampler, Dataset]], steps: int | None = None) -> list[int]:
    """What the ranks read step by step, rank after rank; every payload checked."""
    iters = [iter(sampler) for sampler, _ in group]
    first = group[0][0]
    read = []
    for _ in range(len(first) - first.position if steps is None else steps):
        for ids, (_, ds) in zip(iters, group):
            i = next(ids)
            assert ds.get_batch([i]) == [PAYLOADS[i]]
            read.append(i)
    return read


@pytest.mark.parametrize(("nodes", "per_node"), [(3, 1), (3, 2)])
def test_a_job_of_four_ranks_resumes_on_three_or_six_in_the_same_order(
    cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: int, per_node: int
) -> None:
    local = cluster(3)
    root = make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,))
    with grpc.insecure_channel(grpc_target(local.daemons[0].address), options=channel_options()) as channel:
        cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)))
    before = ranks(local, 2, 2, monkeypatch)
    try:
        head = read_steps(before, STEPS)
        states = [json.loads(json.dumps(sampler.state_dict())) for sampler, _ in before]
    finally:
        close(before)
    with grpc.insecure_channel(grpc_target(local.directory_address), options=channel_options()) as channel:
        directory_pb2_grpc.DirectoryStub(channel).DropJob(jpb.DropJobRequest(job_id="resume"))

    after = ranks(local, nodes, per_node, monkeypatch)
    try:
        for sampler, _ in after:
            sampler.load_state_dict(states[sampler.rank % 4])
            sampler.set_epoch(EPOCH)
        tail = read_steps(after)
        order = epoch_order(N, SEED, EPOCH).tolist()
        # Every id of the epoch once, in its order; only the last step's padding repeats ids.
        assert (head + tail)[:N] == order and len(head + tail) - N < nodes * per_node
        for sampler, _ in after:
            sampler.set_epoch(EPOCH + 1)
        assert read_steps(after) == epoch_order(N, SEED, EPOCH + 1).tolist()
    finally:
        close(after)


def close(group: list[tuple[Sampler, Dataset]]) -> None:
    for _, ds in group:
        ds.client.close()
