"""One pair of daemons and one exchange round on it, as ``bench/experiments/wire.py``
and ``bench/experiments/exchange_rounds.py`` run them.

A round wipes and restarts node-1, starts a fresh ``partial`` job with Q = 1
and has node-0 ship node-1 what it owns in epoch 1 (checked, committed,
acknowledged); its rate is the payload over the daemon's own elapsed time.
A fresh cache file grows under every round, as under a node's first
exchange. With ``grown`` a round keeps node-1's file from the round before
and only empties it of the dataset (the daemon stopped), so LMDB writes into
pages it freed: the exchange of every later epoch on a node that gives away
as much as it takes.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import back_free_memory, progress, stub, wipe_cache

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import StartupError
from dataquay.server.node.cache.file import DATA_FILE, MAX_DBS
from dataquay.server.node.cache.store_writer import META_DB
from dataquay.server.registry import cache_db_name
from dataquay.server.tools.local_cluster import LocalCluster, NodeHost
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import sample_bytes

#: How often a round asks node-0 whether its exchange finished: its rate is
#: the daemon's own elapsed time, and Stats runs on the sender's event loop.
STATS_POLL_SECONDS = 0.1
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ExchangeRound:
    """What one round moved, how fast, and what it cost each daemon."""

    #: Payload bytes per second of the sender's own elapsed time.
    rate: float
    #: The ids moved.
    given: np.ndarray
    sender_cpu: float
    receiver_cpu: float
    #: Seconds from the run's start to the receiver's first acknowledgement.
    first_delivery: float


def started_pair(home: Path, args: tuple[str, ...], source: str = "", tries: int = 3) -> LocalCluster:
    """A two-node cluster (its daemons from the source tree ``source`` if
    given), started again when its directory lost the race for its heartbeat
    port (a UDP port of the TCP port's number, taken by another process on a
    busy machine)."""
    hosts = {}
    if source:
        path = os.pathsep.join(str(Path(source).resolve() / d) for d in ("protos", "client", "server"))
        hosts = {i: NodeHost("127.0.0.1", ("env", f"PYTHONPATH={path}")) for i in range(2)}
    for attempt in range(tries):
        try:
            return LocalCluster(home / str(attempt), 2, args, dataset_roots=(home.parent,), node_hosts=hosts).start()
        except StartupError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def staged_sender(local: LocalCluster, label: str, root: Path, bench: str) -> tuple[cache_pb2_grpc.CacheStub, Manifest]:
    """Registers the dataset at ``root`` and stages it whole on node-0, the
    sender of every round; returns node-0's stub and the dataset's manifest."""
    n0 = stub(local.daemons[0])
    n0.AddDataset(pb.AddDatasetRequest(name=label, root=str(root)))
    progress(f"{bench} {label}: staging on node-0")
    *_, staged = n0.Stage(pb.StageRequest(dataset=label))
    assert staged.done_samples == staged.total_samples, staged
    return n0, Manifest(b"".join(c.data for c in n0.GetManifest(pb.GetDatasetRequest(name=label))))


def cpu_seconds(daemon: DaemonProcess, main_thread: bool = False) -> float:
    """User and system CPU seconds a daemon's process has used so far (or
    only its main thread, which runs its event loop)."""
    assert daemon.process is not None
    pid = daemon.process.pid
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def emptied(cache_dir: Path, db: str) -> bool:
    """Empties a stopped daemon's cache of the database ``db``, keeping its
    file and the pages it freed; False where there is no cache file yet."""
    if not (cache_dir / DATA_FILE).exists():
        return False
    map_size = (cache_dir / DATA_FILE).stat().st_size + (64 << 20)
    with lmdb.open(str(cache_dir), map_size=map_size, max_dbs=MAX_DBS, writemap=True, sync=False) as env:
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(db.encode(), txn=txn), delete=False)
            txn.put(db.encode(), (0).to_bytes(8, "little"), db=env.open_db(META_DB, txn=txn))
        env.sync(True)
    return True


def exchange_round(
    local: LocalCluster,
    n0: cache_pb2_grpc.CacheStub,
    label: str,
    manifest: Manifest,
    round_: int,
    name: str,
    grown: bool = False,
) -> ExchangeRound:
    """One round of the exchange node-0 -> node-1 on a fresh node-1 (see
    the module's docstring for ``grown``)."""
    local.kill_node(1)
    if not (grown and emptied(local.daemons[1].cache_dir, cache_db_name(label, manifest.manifest_id))):
        wipe_cache(local.daemons[1].cache_dir)
    local.restart_node(1)
    with grpc.insecure_channel(str(local.daemons[1].ready["tcp"]), options=channel_options()) as c1:
        # The restarted receiver loads the dataset before the clock starts, not during the exchange.
        request = pb.ReadRequest(dataset=label, ids=[0], manifest_id=manifest.manifest_id, peer=True)
        list(cache_pb2_grpc.CacheStub(c1).Read(request))
    back_free_memory()
    job_id = f"{name}-{label}-{round_}"
    spec = jpb.JobSpec(
        job_id=job_id, dataset=label, mode="partial", q=1.0, seed=round_, nodes=["node-0", "node-1"], ranks_per_node=1
    )
    plan = job_plan(n0.JoinJob(jpb.JoinJobRequest(spec=spec)), manifest)
    before = owners(plan, 0)
    given = np.flatnonzero((before == 0) & (owners(plan, 1, before) == 1))
    cpu = [cpu_seconds(d) for d in local.daemons]
    n0.ReportEpoch(jpb.ReportEpochRequest(job_id=job_id, epoch=0))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run = next(
            (r for r in n0.Stats(pb.StatsRequest()).exchanges if r.job == job_id and r.epoch == 1 and r.finished), None
        )
        if run is not None:
            break
        time.sleep(STATS_POLL_SECONDS)
    else:
        raise RuntimeError(f"exchange of {job_id} did not finish")
    spent = tuple(cpu_seconds(d) - before_cpu for d, before_cpu in zip(local.daemons, cpu))
    assert run.delivered_samples == run.total_samples == len(given), run
    with grpc.insecure_channel(str(local.daemons[1].ready["tcp"]), options=channel_options()) as c1:
        check = given[:: max(1, len(given) // 8)].tolist()
        got = [
            s
            for chunk in cache_pb2_grpc.CacheStub(c1).Read(pb.ReadRequest(dataset=label, ids=check, peer=True))
            for s in chunk.samples
        ]
        assert [s.data for s in got] == [sample_bytes(0, i, len(s.data)) for i, s in zip(check, got)]
    return ExchangeRound(run.sent_bytes / run.elapsed_seconds, given, spent[0], spent[1], run.first_delivery_seconds)
