"""`simulate`'s model of a node lost and of a node that joins, held to a
measured run: a real loopback cluster of four daemons, one SIGKILLed after
staging and healed by the others (--heal-after), then a new machine started
under its name that takes its share back from them. The bytes moved by each
change and the PFS bytes of every epoch agree within 5%."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_healing import SIZE, Cluster, N, read, started_job, stats, wait_for

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import JobPlan
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.simulate import Scenario, simulate
from dataquay.server.tools.synthetic import make_files_dataset

NAMES = ["n0", "n1", "n2", "n3"]
#: The node lost after epoch 0 and back before epoch 3 (the model's leaver is the first node).
LEAVE_AT, JOIN_AT, EPOCHS = 1, 3, 4


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    make_files_dataset(tmp_path / "pfs" / "imgs", N, sizes=(SIZE,), classes=3)
    started = Cluster(tmp_path)
    yield started
    started.close()


def within(measured: int, modelled: int) -> bool:
    return abs(measured - modelled) <= 0.05 * max(measured, modelled)


def test_simulate_models_a_node_lost_and_back_within_five_percent_of_a_measured_run(cluster: Cluster) -> None:
    for name in NAMES:
        cluster.start(name)
    owner = started_job(cluster, NAMES)
    live = {name: cluster.stubs[name] for name in NAMES}
    pfs = [sum(stats(stub).pfs_bytes for stub in live.values())]  # epoch 0: staging
    moved = [0]

    def epoch(number: int, healing_pfs: int = 0) -> None:
        """Every sample read once through the live nodes; the epoch's PFS
        bytes, healing's included, noted."""
        before = sum(stats(stub).pfs_bytes for stub in live.values())
        order = np.random.default_rng(number).permutation(N).tolist()
        stubs = list(live.values())
        for m, stub in enumerate(stubs):
            assert pb.TIER_PFS not in {s.tier for s in read(stub, order[m :: len(stubs)])}
        pfs.append(healing_pfs + sum(stats(stub).pfs_bytes for stub in live.values()) - before)

    # Epoch 1: n0 is lost; the others heal its share before their ranks read on.
    cluster.daemons["n0"].kill()
    del live["n0"]
    before = sum(stats(stub).pfs_bytes for stub in live.values())
    share = int((owner == 0).sum())

    def healed() -> bool:
        counts = [stats(stub).healing for stub in live.values()]
        return sum(c.pfs_samples + c.peer_samples for c in counts) == share and not any(
            c.pending_samples for c in counts
        )

    wait_for("the others to heal n0's share", healed)
    counts = [stats(stub).healing for stub in live.values()]
    moved.append(sum(c.pfs_bytes + c.peer_bytes for c in counts))
    epoch(1, healing_pfs=sum(stats(stub).pfs_bytes for stub in live.values()) - before)
    moved.append(0)
    epoch(2)

    # Epoch 3: a new machine under n0's name takes its share from the others.
    late = cluster.start("n0", home="n0-new")
    wait_for("n0 to take its share back", lambda: stats(late).healing.peer_samples == share)
    moved.append(stats(late).healing.peer_bytes + stats(late).healing.pfs_bytes)
    live = {"n0": late, **live}
    epoch(3)

    settings = JobSettings(dataset="imgs", mode="global", nodes=tuple(NAMES), ranks_per_node=1, batch_size=4)
    scenario = Scenario(JobPlan(settings, N, len(NAMES)), SIZE, leave_at=LEAVE_AT, join_at=JOIN_AT, joiner="n0")
    modelled = list(simulate(scenario, EPOCHS))
    assert [e.pfs_bytes for e in modelled] == [N * SIZE, share * SIZE, 0, 0]
    assert all(map(within, pfs, [e.pfs_bytes for e in modelled])), (pfs, [e.pfs_bytes for e in modelled])
    assert all(map(within, moved, [e.moved_bytes for e in modelled])), (moved, [e.moved_bytes for e in modelled])
    assert pfs == [N * SIZE, share * SIZE, 0, 0] and moved[1] == moved[3] == share * SIZE
