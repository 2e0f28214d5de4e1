"""The per-epoch exchange between real daemons: what moves, what it costs, what
a trainer sees while it runs, and a daemon killed in the middle of it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from polling import wait_until

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import locality_balance, node_steps, owners
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum, encode_value
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.sizes import format_bytes
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes
from dataquay.server.tools.trainers import RankEpoch, RankGroup

NODES = 4
SAMPLES = 480
SIZES = (2000, 3100, 4500)
JOB = "x1"


def sample_payload(i: int) -> bytes:
    return sample_bytes(0, i, SIZES[i % len(SIZES)])


class Nodes:
    """Stubs of a local cluster's daemons."""

    def __init__(self, local: LocalCluster, job: str = JOB) -> None:
        self.local = local
        self.job = job
        self._channels: list[grpc.Channel] = []
        self.stubs = [self._stub(i) for i in range(len(local.daemons))]

    def _stub(self, index: int) -> cache_pb2_grpc.CacheStub:
        ready = self.local.daemons[index].ready
        assert ready is not None
        channel = grpc.insecure_channel(ready["tcp"], options=channel_options())
        self._channels.append(channel)
        return cache_pb2_grpc.CacheStub(channel)

    def refresh(self, index: int) -> None:
        self.stubs[index] = self._stub(index)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def stats(self) -> list[pb.StatsReply]:
        return [stub.Stats(pb.StatsRequest(), timeout=10) for stub in self.stubs]

    def report(self, epoch: int, indexes: tuple[int, ...] | None = None) -> None:
        """The trainers of nodes ``indexes`` (default all) enter ``epoch``."""
        for index in range(len(self.stubs)) if indexes is None else indexes:
            self.stubs[index].ReportEpoch(jpb.ReportEpochRequest(job_id=self.job, epoch=epoch), timeout=10)

    def exchange(self, index: int, epoch: int) -> pb.ExchangeProgress | None:
        """Node ``index``'s exchange into ``epoch``, once it started."""
        stats = self.stubs[index].Stats(pb.StatsRequest(), timeout=10)
        return next((x for x in stats.exchanges if x.job == self.job and x.epoch == epoch), None)

    def wait_exchanged(self, epoch: int) -> list[pb.ExchangeProgress]:
        """Each node's exchange into ``epoch``, once all have finished."""
        runs: list[pb.ExchangeProgress | None] = []

        def finished() -> bool:
            runs[:] = [self.exchange(m, epoch) for m in range(len(self.stubs))]
            return all(r is not None and r.finished for r in runs)

        wait_until(finished, f"every node finished its exchange into epoch {epoch}", poll=0.1)
        return [r for r in runs if r is not None]

    def read(self, index: int, ids: np.ndarray) -> list[pb.Sample]:
        """``ids`` read for the job through node ``index``, their bytes checked."""
        request = pb.ReadRequest(dataset="imgs", ids=ids.tolist(), job=self.job)
        samples = [s for chunk in self.stubs[index].Read(request) for s in chunk.samples]
        assert [s.data for s in samples] == [sample_payload(i) for i in ids.tolist()]
        return samples

    def wait_until_held(self, index: int, ids: np.ndarray, held: bool = True) -> None:
        """Waits until node ``index`` holds all of ``ids`` (or, with ``held`` False, none)."""
        wait_until(
            lambda: self.holds(index, ids).all() if held else not self.holds(index, ids).any(),
            f"node {index} {'holds all' if held else 'holds none'} of {ids}",
            poll=0.1,
        )

    def holds(self, index: int, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` node ``index`` has in its cache (a peer read flags the rest)."""
        request = pb.ReadRequest(dataset="imgs", ids=ids.tolist(), peer=True)
        got = {s.id: not s.missing for chunk in self.stubs[index].Read(request) for s in chunk.samples}
        return np.array([got[i] for i in ids.tolist()], dtype=bool)


def staged(
    cluster: Callable[..., LocalCluster], tmp_path: Path, job_args: list[str], *daemon_args: str, nodes: int = NODES
) -> LocalCluster:
    """``nodes`` daemons with dataset "imgs" registered and staged for job JOB (2 ranks per node)."""
    local = cluster(nodes, daemon_args=daemon_args)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                JOB,
                *job_args,
                "--ranks-per-node",
                "2",
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )
    return local


def partial_cluster(
    cluster: Callable[..., LocalCluster], tmp_path: Path, *daemon_args: str, q: float = 0.5
) -> tuple[Nodes, np.ndarray]:
    """4 daemons, dataset "imgs" staged for a partial job; returns the job's
    owner arrays for epochs 0-3."""
    local = staged(cluster, tmp_path, ["--mode", "partial", "--q", str(q)], *daemon_args)
    nodes = Nodes(local)
    manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
    job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
    plan = job_plan(job, manifest)
    epochs = [owners(plan, 0)]
    for epoch in range(1, 4):
        epochs.append(owners(plan, epoch, epochs[-1]))
    return nodes, np.stack(epochs)


@pytest.fixture
def sizes() -> np.ndarray:
    return np.array([SIZES[i % len(SIZES)] for i in range(SAMPLES)], dtype=np.int64)


def test_the_exchange_moves_exactly_what_changes_owner_and_the_next_epoch_is_local(
    cluster: Callable[..., LocalCluster], tmp_path: Path, sizes: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes, epoch_owners = partial_cluster(cluster, tmp_path, "--spare-copies-fill", "0")
    try:
        nodes.report(0)
        runs = nodes.wait_exchanged(1)
        before, after = epoch_owners[0], epoch_owners[1]
        for m, run in enumerate(runs):
            given = (before == m) & (after != m)
            assert run.total_samples == run.delivered_samples == given.sum()
            assert run.sent_bytes == run.delivered_bytes == sizes[given].sum()
            assert run.unavailable_samples == run.refused_samples == 0
            assert 0 < run.first_delivery_seconds <= run.elapsed_seconds
        for m in range(NODES):
            assert nodes.holds(m, np.flatnonzero(after == m)).all()
        stats = nodes.stats()
        assert sum(s.exchange_received_bytes for s in stats) == sizes[before != after].sum()
        capsys.readouterr()
        assert cli_main(["status", "--directory", nodes.local.directory_address]) == 0
        status = capsys.readouterr().out
        for m, run in enumerate(runs):
            assert f"node-{m}  x1   1           {run.delivered_samples}/{run.total_samples}" in status
        assert f"exchange received {format_bytes(sizes[before != after].sum())}" in status
        assert cli_main(["status", "--directory", nodes.local.directory_address, "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert [n["info"]["name"] for n in document["nodes"]] == [f"node-{m}" for m in range(NODES)]
        assert [int(n["stats"]["exchanges"][0]["delivered_samples"]) for n in document["nodes"]] == [
            run.delivered_samples for run in runs
        ]
        watch = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dataquay.server.cli",
                "status",
                "--directory",
                nodes.local.directory_address,
                "--watch",
                "0.2",
                "--json",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        with watch:
            assert watch.stdout is not None
            snapshots = [json.loads(watch.stdout.readline()) for _ in range(2)]
            watch.kill()
        assert all(len(snapshot["nodes"]) == NODES for snapshot in snapshots)

        nodes.report(1)  # epoch 0 is over: given-away samples may go
        pfs_before = [s.pfs_bytes for s in stats]
        for m in range(NODES):
            assert {s.tier for s in nodes.read(m, np.flatnonzero(after == m))} == {pb.TIER_CACHE}
        assert [s.pfs_bytes for s in nodes.stats()] == pfs_before
        # Entering epoch 1 also started the exchange into epoch 2, which may
        # hand some of them back.
        for m in range(NODES):
            nodes.wait_until_held(m, np.flatnonzero((before == m) & (after != m) & (epoch_owners[2] != m)), False)
    finally:
        nodes.close()


def test_a_sample_not_yet_exchanged_comes_from_its_previous_owner_and_stays(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    # A bandwidth cap of 1 byte/s keeps the exchange from getting anywhere.
    nodes, epoch_owners = partial_cluster(cluster, tmp_path, "--exchange-bandwidth", "1")
    try:
        nodes.report(1)
        before, after = epoch_owners[0], epoch_owners[1]
        incoming = np.flatnonzero((after == 0) & (before != 0))
        assert not nodes.holds(0, incoming).any()
        pfs_before = [s.pfs_bytes for s in nodes.stats()]
        assert {s.tier for s in nodes.read(0, incoming)} == {pb.TIER_PEER}
        stats = nodes.stats()
        assert stats[0].previous_owner_samples == len(incoming)
        assert [s.pfs_bytes for s in stats] == pfs_before
        nodes.wait_until_held(0, incoming)  # read from its previous owner, and now cached here
    finally:
        nodes.close()


def test_a_sample_that_never_moved_comes_from_the_node_that_held_it_epochs_ago(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    # No exchange gets anywhere, and no read ahead takes the PFS for what is elsewhere.
    nodes, epoch_owners = partial_cluster(cluster, tmp_path, "--exchange-bandwidth", "1", "--prefetch-memory", "0")
    try:
        nodes.report(1)
        nodes.report(2)
        nodes.report(3)
        staged_on_0 = epoch_owners[0] == 0
        # Owned by node 1 in epoch 3, by neither node 0 nor node 1 in epochs 1 and 2:
        # only node 0, which staged it in epoch 0, holds it.
        wanted = np.flatnonzero(staged_on_0 & (epoch_owners[3] == 1) & (epoch_owners[2] > 1) & (epoch_owners[1] > 1))
        assert len(wanted)
        pfs_before = [s.pfs_bytes for s in nodes.stats()]
        assert {s.tier for s in nodes.read(1, wanted)} == {pb.TIER_PEER}
        assert [s.pfs_bytes for s in nodes.stats()] == pfs_before
        nodes.wait_until_held(1, wanted)
    finally:
        nodes.close()


def test_offers_the_receiver_does_not_own_are_refused_and_it_keeps_serving(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    nodes, epoch_owners = partial_cluster(cluster, tmp_path)
    try:
        foreign = np.flatnonzero(epoch_owners[1] != 0)[:5]
        offer = pb.ExchangeOffer(job=JOB, dataset="imgs", epoch=1, sender="node-1", ids=foreign.tolist())
        with pytest.raises(grpc.RpcError) as refused:
            list(nodes.stubs[0].Exchange(iter([pb.ExchangeMessage(offer=offer)]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "5 of 5 offered ids are not held by this node in epoch 1" in refused.value.details()

        with pytest.raises(grpc.RpcError) as no_offer:
            list(nodes.stubs[0].Exchange(iter([pb.ExchangeMessage()]), timeout=10))
        assert no_offer.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        mine = np.flatnonzero((epoch_owners[1] == 0) & (epoch_owners[0] == 1))[:3]
        offer = pb.ExchangeOffer(job=JOB, dataset="imgs", epoch=1, sender="node-1", ids=mine.tolist())
        bad = pb.Sample(id=int(mine[0]), value=encode_value(b"not the bytes", checksum(b"other bytes")))
        good = pb.Sample(id=int(mine[1]), value=encode_value(sample_payload(int(mine[1]))))
        replies = list(
            nodes.stubs[0].Exchange(
                iter([pb.ExchangeMessage(offer=offer), pb.ExchangeMessage(samples=[bad, good])]), timeout=10
            )
        )
        assert [list(r.held) for r in replies] == [[], [int(mine[1])]]
        assert nodes.holds(0, mine).tolist() == [False, True, False]
        assert nodes.stats()[0].node == "node-0"
    finally:
        nodes.close()


def test_a_daemon_killed_mid_exchange_redoes_its_part_and_nothing_is_lost(
    cluster: Callable[..., LocalCluster], tmp_path: Path, sizes: np.ndarray
) -> None:
    nodes, epoch_owners = partial_cluster(cluster, tmp_path)
    before, after = epoch_owners[0], epoch_owners[1]
    given = [(before == m) & (after != m) for m in range(NODES)]
    to_stopped = [g & (after == 2) for g in given]
    assert to_stopped[1].any() and (given[1] & ~to_stopped[1]).any()
    # A stopped receiver answers no offer: every stream into node 2 waits
    # there, so the others deliver exactly their shares for nodes 0, 1 and 3,
    # and node 1 dies with part of its own share delivered and part not.
    stopped = nodes.local.daemons[2]
    try:
        stopped.signal(signal.SIGSTOP)
        try:
            nodes.report(0, (0, 1, 3))

            def delivered_all_but_node_2s() -> bool:
                runs = [nodes.exchange(m, 1) for m in (0, 1, 3)]
                return [r.delivered_samples if r else -1 for r in runs] == [
                    (given[m] & ~to_stopped[m]).sum() for m in (0, 1, 3)
                ]

            wait_until(delivered_all_but_node_2s, "nodes 0, 1 and 3 delivered all they give nodes other than 2")
            nodes.local.kill_node(1)
        finally:
            stopped.signal(signal.SIGCONT)
        nodes.report(0, (2,))
        nodes.local.restart_node(1)
        nodes.refresh(1)
        runs = nodes.wait_exchanged(1)
        for m, run in enumerate(runs):
            assert run.total_samples == run.delivered_samples == given[m].sum()
            assert run.unavailable_samples == run.refused_samples == 0
        # Redone after the restart, node 1's run sent only what node 2 lacked.
        assert runs[1].sent_bytes == sizes[to_stopped[1]].sum()
        pfs_before = [s.pfs_bytes for s in nodes.stats()]
        nodes.report(1)
        for m in range(NODES):
            assert {s.tier for s in nodes.read(m, np.flatnonzero(after == m))} == {pb.TIER_CACHE}
        assert [s.pfs_bytes for s in nodes.stats()] == pfs_before
    finally:
        nodes.close()


# ------------------------------------------------- 8 ranks, 3 epochs, each mode

MODE_ARGS = {
    "partial": ("--mode", "partial", "--q", "0.25"),
    "local": ("--mode", "local"),
    "locality": ("--mode", "locality", "--batch-size", "12"),  # 8 x 12 divides 480: no padding
}


def rank_group(local: LocalCluster, tmp_path: Path) -> RankGroup:
    # Nothing read ahead at join: each epoch's tiers count exactly its own reads.
    envs = [{**local.rank_env(r, 2, JOB), "DATAQUAY_JOIN_READ_AHEAD": "0"} for r in range(NODES * 2)]
    return RankGroup(envs, "imgs", tmp_path / "ranks", batch=16, timeout=60)


def assert_every_sample_once_and_intact(results: list[RankEpoch]) -> None:
    ids = np.concatenate([r.ids for r in results]).astype(np.int64)
    sums = np.concatenate([np.asarray(r.checksums, dtype=np.uint64) for r in results])
    assert sorted(ids.tolist()) == list(range(SAMPLES))
    assert sums.tolist() == [checksum(sample_payload(i)) for i in ids.tolist()]


@pytest.mark.parametrize("mode", MODE_ARGS)
def test_eight_ranks_read_every_sample_once_per_epoch_in_each_mode(
    cluster: Callable[..., LocalCluster], tmp_path: Path, mode: str
) -> None:
    local = staged(cluster, tmp_path, list(MODE_ARGS[mode]))
    nodes = Nodes(local)
    manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
    plan = job_plan(nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True)), manifest)
    epoch_owners = owners(plan, 0)
    try:
        with rank_group(local, tmp_path) as group:
            for epoch in range(3):
                results = group.epoch(epoch)
                assert_every_sample_once_and_intact(results)
                assert [len(r.ids) for r in results] == [SAMPLES // 8] * 8
                counts = {t: sum(r.samples[t] for r in results) for t in results[0].samples}
                assert counts["pfs"] == counts["fallback"] == 0
                if mode == "locality":
                    assert counts["peer"] == locality_balance(plan, epoch).moved.sum()
                else:  # each rank reads what its node owns
                    assert counts["local"] == SAMPLES
                    for r, result in enumerate(results):
                        assert (epoch_owners[result.ids] == r // 2).all()
                if mode == "partial":
                    nodes.wait_exchanged(epoch + 1)
                    epoch_owners = owners(plan, epoch + 1, epoch_owners)
                    for m in range(NODES):
                        assert nodes.holds(m, np.flatnonzero(epoch_owners == m)).all()
    finally:
        nodes.close()


@pytest.mark.parametrize("mode", ["locality", "global"])
def test_the_next_steps_transfers_are_fetched_before_the_ranks_ask(
    cluster: Callable[..., LocalCluster], tmp_path: Path, mode: str
) -> None:
    local = staged(cluster, tmp_path, ["--mode", mode, "--batch-size", "12"])
    nodes = Nodes(local)
    try:
        manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
        plan = job_plan(job, manifest)
        steps = node_steps(plan, 0, 0)
        foreign = [owners(plan, 0)[step] != 0 for step in steps]

        def read_step(step: int) -> list[pb.Sample]:
            request = pb.ReadRequest(dataset="imgs", ids=steps[step].tolist(), job=JOB)
            return [s for chunk in nodes.stubs[0].Read(request) for s in chunk.samples]

        def peer_samples() -> int:
            return sum(p.samples for p in nodes.stats()[0].peers)

        # The join planned the epoch and fetched its first 4 steps'
        # transfers before any rank read (the epoch has 5 steps: 480 ids in
        # global batches of 8 x 12); reading step 0 fetches the 4 after it.
        first = sum(int(f.sum()) for f in foreign[:4])
        assert first > 0
        wait_until(lambda: peer_samples() >= first, "the first steps' transfers were fetched", poll=0.1)
        assert peer_samples() == first
        ahead = first + int(foreign[4].sum())
        for step in range(5):
            samples = read_step(step)
            assert [s.data for s in samples] == [sample_payload(i) for i in steps[step].tolist()]
            assert [s.tier == pb.TIER_PEER for s in samples] == foreign[step].tolist()
            if step == 0:
                wait_until(lambda: peer_samples() >= ahead, "the next steps' transfers were fetched", poll=0.1)
        stats = nodes.stats()[0]
        assert stats.prefetched_samples == ahead
        # Reading the epoch's last step fetched the next epoch's first 4
        # steps' transfers as well; no step asked a peer itself.
        next_foreign = [owners(plan, 1)[step] != 0 for step in node_steps(plan, 1, 0)]
        ahead_next = sum(int(f.sum()) for f in next_foreign[:4])
        wait_until(
            lambda: peer_samples() >= ahead + ahead_next, "the next epoch's first transfers were fetched", poll=0.1
        )
        assert peer_samples() == ahead + ahead_next
        # A read that names the next epoch, before the job enters it, takes them.
        next_step = node_steps(plan, 1, 0)[0]
        request = pb.ReadRequest(dataset="imgs", ids=next_step.tolist(), job=JOB, epoch=1)
        samples = [s for chunk in nodes.stubs[0].Read(request) for s in chunk.samples]
        assert [s.data for s in samples] == [sample_payload(i) for i in next_step.tolist()]
        assert [s.tier == pb.TIER_PEER for s in samples] == next_foreign[0].tolist()
        assert nodes.stats()[0].prefetched_samples == ahead + int(next_foreign[0].sum())
    finally:
        nodes.close()
