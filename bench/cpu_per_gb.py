"""CPU seconds per GB moved, per data path, against raw baselines in the same run.

CPU time is what a busy node has too little of, and unlike wall time it
barely moves with the machine's load. Each path is measured as the user +
system seconds of every process involved (both daemons, the directory, and
this process as the client; each daemon's children too), read from
/proc/PID/stat before and after the transfer, over the payload bytes moved.

Setup: a directory and two daemons on loopback (LocalCluster); files
datasets of samples of ``SIZE`` bytes as the PFS.

- staging: a ``global`` job on [node-0, node-1]; each node stages what it owns.
- local hit: a client on node-0 reads, in batches of 64, every sample node-0
  owns, checksums checked, ``PASSES`` times after one pass untimed (a job's
  steady state: the client's segments and connections made): as shipped
  (``get_batch``, which reads the node's LMDB in this process where it may),
  and again through the daemon's batch path (the payloads in this process's
  shared-memory segment; what a client gets that may not open the LMDB
  itself), copied out as bytes and as views (``copy=False``).
- peer hit: the same client reads every sample node-1 owns: node-0 fetches
  each batch from node-1 over the bulk path and hands it on; and again with
  ``get_batch(copy=False)``, the client holding views of its shared-memory
  segment, as the raw stream's receiver holds its buffers; and those views
  again in batches of LARGE_BATCH, which spread what the daemon spends per
  call over four times the bytes.
- miss: a dataset no node caches, read through the client from the PFS; the
  daemon's caching behind the reads is waited for and counted.
- exchange: a ``partial`` job with Q = 1 on both nodes, each staged with its
  share; the exchange into epoch 1, whose arrivals take pages new to each
  cache; then, measured together, the exchanges into epochs 2-4, whose
  arrivals take the pages that what each node gave away freed (a job's
  steady state). The daemons keep no spare copies (``--spare-copies-fill
  0``), so that every sample that moves is sent.

Baselines, each in processes of its own, on the same bytes:

- raw stream: one process sends the peer-hit payloads over a loopback TCP
  socket to another, which receives each into a buffer of its own and holds
  a batch's 64 until the next, as a trainer holds what ``get_batch`` returns
  (the target for peer hits and the exchange: <= 1.5x).
- raw stream + put: the same, PUT_PASSES times over (about the bytes the
  measured exchanges move), the receiver putting each batch into an LMDB
  opened as a daemon opens its cache, and deleting what it put a pass
  before (what an exchange must do besides moving bytes: the bound under
  it; for context, not a target).
- raw LMDB: a plain Python process reads the local-hit values from node-0's
  cache with py-lmdb (``get``, a copy of each), in the same batches, and
  computes each xxh3 as the client checks it (the target for local hits:
  <= 1.2x).
- raw PFS + put: a plain process reads the staged dataset's files, frames
  each with its xxh3 and puts them, a batch at a time, into a fresh LMDB
  opened as a daemon opens its cache: what caching from the PFS must do
  (the bound under staging and the misses; for context, not a target).

Every process, baselines included, runs with the allocator settings the
client uses (``tune_malloc``; the daemons also keep to one malloc arena).
The baselines are in bench/cpu_baselines.py.

Each figure is the median of ``--runs`` whole runs, each on a fresh cluster:
a loaded machine moves even CPU time (caches, page faults) by tens of percent.
Before the paths that fill pages for the first time (staging, the misses,
the first exchange) the memory the VM will hand out is backed already
(``back_free_memory``), or they would measure the hypervisor.

    .venv/bin/python bench/cpu_per_gb.py [--mib 600] [--size-kib 110] [--runs 3]   # about 7 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from common import MiB, back_free_memory, progress, report
from cpu_baselines import BATCH, PUT_PASSES, raw_lmdb, raw_pfs_put, raw_stream, row
from cpu_meter import Meter

from dataquay.client import Client, Dataset, connect
from dataquay.client.jobs import job_plan
from dataquay.client.malloc import tune_malloc
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

#: A batch a trainer that asks for more per call reads: what the daemon spends per call, spread wider.
LARGE_BATCH = 256
#: Reads of every cached sample per timed run of the hit paths and their baselines.
PASSES = 48
#: Rounds each hit path is measured in, each followed by its baseline on the
#: same samples: a ratio per round, so that a machine whose load drifts over
#: minutes moves both sides of each ratio alike.
ROUNDS = 4
#: Exchanges measured together once both nodes send and receive (see :func:`exchange`).
STEADY_EPOCHS = 3
#: CPU seconds per GB of a path over its baseline: the targets on the results page.
TARGETS = {
    "peer_hit": ("raw_stream", 1.5),
    "peer_hit_views": ("raw_stream", 1.5),
    "peer_hit_views_large": ("raw_stream", 1.5),
    "exchange": ("raw_stream", 1.5),
    "exchange_steady": ("raw_stream", 1.5),
    "local_hit": ("raw_lmdb", 1.2),
    "local_hit_shm": ("raw_lmdb", 1.2),
    "local_hit_shm_views": ("raw_lmdb", 1.2),
}
#: Ratios with no target: each path over the bound storing sets under it.
CONTEXT = {"exchange_steady": "raw_stream_put", "staging": "raw_pfs_put", "miss": "raw_pfs_put"}


# ------------------------------------------------------------------- cluster


class Rig:
    """Two daemons and a directory, with stubs to each daemon and a client on node-0."""

    def __init__(self, local: LocalCluster) -> None:
        self.local = local
        self.channels = [grpc.insecure_channel(str(d.ready["tcp"]), options=channel_options()) for d in local.daemons]  # type: ignore[index]
        self.stubs = [cache_pb2_grpc.CacheStub(c) for c in self.channels]
        self.client: Client = connect(local.daemons[0].address)
        assert local.directory is not None and local.directory.process is not None
        pids = {f"node{i}": d.process.pid for i, d in enumerate(local.daemons) if d.process is not None}
        self.meter = Meter({**pids, "directory": local.directory.process.pid})

    def close(self) -> None:
        self.client.close()
        for channel in self.channels:
            channel.close()

    def timed(
        self, path: str, nbytes: int | Callable[[], int], run: Callable[[], object], client: bool = True
    ) -> dict[str, object]:
        """Runs ``run`` and counts the CPU of every process over ``nbytes``
        (a function: the bytes known once it ran); this process's only where
        it is the client (not where it merely drives the daemons)."""
        started = time.perf_counter()
        with self.meter.measure() as meter:
            run()
        spent = meter.spent if client else {k: v for k, v in meter.spent.items() if k != "client"}
        return row(path, nbytes if isinstance(nbytes, int) else nbytes(), spent, time.perf_counter() - started)


def _batches(ids: np.ndarray, size: int = BATCH) -> list[list[int]]:
    return [ids[i : i + size].tolist() for i in range(0, len(ids), size)]


def _read_all(ds: Dataset, batches: list[list[int]], size: int, copy: bool = True) -> None:
    held: list[memoryview] | list[bytes] = []
    for batch in batches:
        held = ds.get_batch(batch, copy=copy)  # held for a step, as a trainer holds it
        assert len(held) == len(batch) and sum(map(len, held)) == len(batch) * size


def _read_shm(client: Client, ds: Dataset, batches: list[list[int]], size: int, copy: bool = True) -> None:
    """The batches through the daemon (its reply's payloads in this process's
    shared-memory segment), not the client's own view of the node's LMDB."""
    held: list[bytes] = []
    for batch in batches:
        held = client.remote._read_daemon(ds, np.asarray(batch), None, copy)
        assert len(held) == len(batch) and sum(map(len, held)) == len(batch) * size


def hits(rig: Rig, root: Path, count: int, size: int, home: Path, fills: Callable[[], None]) -> list[dict[str, object]]:
    """Staging and its baseline (``fills`` run before it), local hits, peer
    hits and their baselines, on one dataset."""
    n0 = rig.stubs[0]
    n0.AddDataset(pb.AddDatasetRequest(name="hits", root=str(root)))
    n0.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id="hits", dataset="hits", nodes=["node-0", "node-1"])))

    def stage() -> None:
        for stub in rig.stubs:
            *_, last = stub.Stage(pb.StageRequest(dataset="hits", job="hits"))
            assert not last.error and last.done_samples == last.total_samples, last

    progress(f"staging {count} samples over two nodes")
    rows = [rig.timed("staging", count * size, stage, client=False)]
    paths = sorted(str(p) for p in root.rglob("*.bin"))
    fills()  # as before staging: its pages are new to the LMDB too
    rows.append(raw_pfs_put(paths, home))
    ds = rig.client.dataset("hits")
    owner = ds.sampler(job="hits", rank=0, world_size=2).owners(0)
    rng = np.random.default_rng(0)
    # Each id is read PASSES times, so that every figure spans many clock ticks.
    mine = _batches(rng.permutation(np.flatnonzero(owner == 0))) * PASSES
    theirs_in_order = rng.permutation(np.flatnonzero(owner == 1))
    theirs = _batches(theirs_in_order) * PASSES
    theirs_large = _batches(theirs_in_order, LARGE_BATCH) * PASSES
    before = rig.client.stats().samples
    read = {
        "local_hit": lambda batches: _read_all(ds, batches, size),
        "local_hit_shm": lambda batches: _read_shm(rig.client, ds, batches, size),
        "local_hit_shm_views": lambda batches: _read_shm(rig.client, ds, batches, size, copy=False),
        "peer_hit": lambda batches: _read_all(ds, batches, size),
        "peer_hit_views": lambda batches: _read_all(ds, batches, size, copy=False),
        "peer_hit_views_large": lambda batches: _read_all(ds, batches, size, copy=False),
    }
    info = n0.GetDataset(pb.GetDatasetRequest(name="hits"))
    baselines: dict[str, Callable[[list[list[int]]], dict[str, object]]] = {
        "raw_lmdb": lambda batches: raw_lmdb(rig.local.daemons[0].cache_dir, info.cache_db, batches, home),
        "raw_stream": lambda batches: raw_stream([paths[i] for batch in batches for i in batch], home),
    }
    baseline_rounds: dict[str, list[dict[str, object]]] = {name: [] for name in baselines}
    for path, reader in read.items():
        batches = (theirs_large if path.endswith("large") else theirs) if path.startswith("peer") else mine
        baseline = TARGETS[path][0]
        progress(f"{path.replace('_', ' ')}, in {ROUNDS} rounds each followed by {baseline.replace('_', ' ')}")
        # One pass untimed first: a job's reads find the client's segments and the connections made.
        reader(batches[: len(batches) // PASSES])
        rounds, paired = [], []
        step = len(batches) // ROUNDS
        for chunk in (batches[k * step : (k + 1) * step] for k in range(ROUNDS)):
            rounds.append(rig.timed(path, sum(map(len, chunk)) * size, lambda: reader(chunk)))
            baseline_rounds[baseline].append(baselines[baseline](chunk))
            paired.append(float(rounds[-1]["cpu_s_per_GB"]) / float(baseline_rounds[baseline][-1]["cpu_s_per_GB"]))  # type: ignore[arg-type]
        rows.append({**summed(path, rounds), "paired_ratios": paired})
    after = rig.client.stats().samples
    tiers = {tier: after[tier] - before.get(tier, 0) for tier in after if after[tier] != before.get(tier, 0)}
    # Every id read PASSES times timed and once untimed.
    assert tiers.get("local", 0) * 2 == tiers.get("cache", 0) == 2 * sum(map(len, mine)) // PASSES * (PASSES + 1), tiers
    assert tiers.get("peer", 0) == 3 * sum(map(len, theirs)) // PASSES * (PASSES + 1), tiers
    rows.extend(summed(name, parts) for name, parts in baseline_rounds.items())
    progress("raw stream + put baseline")
    streamed = [paths[i] for batch in theirs for i in batch]
    rows.append(raw_stream(streamed[: len(streamed) * PUT_PASSES // PASSES], home, store=True))
    return rows


def summed(path: str, parts: list[dict[str, object]]) -> dict[str, object]:
    """One row for the rounds ``parts`` of one path: their bytes, wall time and each process's seconds added."""
    totals = ("cpu_s", "wall_s")
    roles = {key[: -len("_s")] for part in parts for key in part if key.endswith("_s") and key not in totals}
    spent = {role: sum(float(part.get(f"{role}_s", 0.0)) for part in parts) for role in sorted(roles)}  # type: ignore[arg-type]
    nbytes = round(sum(float(part["MB"]) for part in parts) * 1e6)  # type: ignore[arg-type]
    return row(path, nbytes, spent, sum(float(part["wall_s"]) for part in parts))  # type: ignore[arg-type]


def miss(rig: Rig, root: Path, count: int, size: int) -> dict[str, object]:
    """Reads of samples no node caches, through the client, until node-0 has cached them behind."""
    rig.stubs[0].AddDataset(pb.AddDatasetRequest(name="miss", root=str(root)))
    batches = _batches(np.random.default_rng(1).permutation(count))

    def run() -> None:
        _read_all(rig.client.dataset("miss"), batches, size)
        deadline = time.monotonic() + 300
        while rig.stubs[0].GetDataset(pb.GetDatasetRequest(name="miss")).cached_samples < count:
            if time.monotonic() > deadline:
                raise RuntimeError("node-0 did not cache the missed samples behind the reads in 300 s")
            time.sleep(0.05)

    progress(f"misses over {count} samples")
    return rig.timed("miss", count * size, run)


def exchange(rig: Rig, root: Path, count: int, fills: Callable[[], None]) -> list[dict[str, object]]:
    """A ``partial`` job with Q = 1 on both nodes, each staged with its
    share (``fills`` run after): the exchange into epoch 1, whose arrivals take pages new to each
    cache, then those into epochs 2 to 1 + STEADY_EPOCHS together, where
    each receiver writes into the pages that the samples it gave away freed."""
    n0 = rig.stubs[0]
    n0.AddDataset(pb.AddDatasetRequest(name="xch", root=str(root)))
    spec = jpb.JobSpec(job_id="xch", dataset="xch", mode="partial", q=1.0, nodes=["node-0", "node-1"], ranks_per_node=1)
    job = n0.JoinJob(jpb.JoinJobRequest(spec=spec))
    for stub in rig.stubs:
        *_, staged = stub.Stage(pb.StageRequest(dataset="xch", job="xch"))
        assert not staged.error and staged.done_samples == staged.total_samples, staged
    manifest = Manifest(b"".join(c.data for c in n0.GetManifest(pb.GetDatasetRequest(name="xch"))))
    plan = job_plan(job, manifest)
    holders = [owners(plan, 0)]
    for epoch in range(1, 2 + STEADY_EPOCHS):
        holders.append(owners(plan, epoch, holders[-1]))

    def moved(epoch: int) -> np.ndarray:
        return np.flatnonzero(holders[epoch - 1] != holders[epoch])

    finished: list[pb.ExchangeProgress] = []

    def run(epochs: range) -> None:
        finished.clear()
        for epoch in epochs:
            for stub in rig.stubs:  # as each node's rank reports the epoch it starts
                stub.ReportEpoch(jpb.ReportEpochRequest(job_id="xch", epoch=epoch - 1))
            deadline = time.monotonic() + 300
            done: list[pb.ExchangeProgress] = []
            while len(done) < len(rig.stubs):  # each node's sending side, finished
                done = [
                    r
                    for stub in rig.stubs
                    for r in stub.Stats(pb.StatsRequest()).exchanges
                    if r.job == "xch" and r.epoch == epoch and r.finished
                ]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the exchange into epoch {epoch} did not finish in 300 s")
                time.sleep(0.2)  # the daemons' CPU for Stats is counted: ask seldom
            finished.extend(done)

    rows = []
    fills()  # after staging: what the first exchange's pages take
    for path, epochs in (("exchange", range(1, 2)), ("exchange_steady", range(2, 2 + STEADY_EPOCHS))):
        ids = np.concatenate([moved(epoch) for epoch in epochs])
        progress(f"exchange of {len(ids)} samples into epochs {epochs.start}-{epochs.stop - 1}")
        # Over what was sent: a receiver that still holds a sample (given away
        # an epoch before, its delete not due yet) takes it without its bytes.
        sent = rig.timed(path, lambda: sum(r.sent_bytes for r in finished), lambda: run(epochs), client=False)
        planned = int(manifest.sample_length[ids].sum())
        assert 0 < float(sent["MB"]) * 1e6 <= planned, (planned, finished)  # type: ignore[arg-type]
        rows.append(sent)
    return rows


def medians(runs: list[list[dict[str, object]]]) -> list[dict[str, object]]:
    """Per path, the row of the run with the median CPU per GB (its split
    between processes kept whole), with every run's figure beside it."""
    out = []
    for rows in zip(*runs):
        ranked = sorted(rows, key=lambda r: float(r["cpu_s_per_GB"]))
        median = {**ranked[len(ranked) // 2], "runs_cpu_s_per_GB": [r["cpu_s_per_GB"] for r in rows]}
        if "paired_ratios" in median:
            median["paired_ratios"] = [ratio for r in rows for ratio in r["paired_ratios"]]  # type: ignore[attr-defined]
        out.append(median)
    return out


def ratios(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each path's CPU per GB over its baseline's, the median against the
    target, every ratio it is the median of beside it: for the hit paths one
    per round of every run (each round followed by its baseline on the same
    samples), for the others one per run (a loaded machine moves a path and
    its baseline together). Then the ratios kept for context (target None)."""
    per_gb = {str(r["path"]): r.get("runs_cpu_s_per_GB", [r["cpu_s_per_GB"]]) for r in rows}
    paired = {str(r["path"]): r["paired_ratios"] for r in rows if "paired_ratios" in r}
    compared: list[tuple[str, str, float | None]] = [(p, b, t) for p, (b, t) in TARGETS.items()]
    compared += [(p, b, None) for p, b in CONTEXT.items()]
    out = []
    for path, baseline, target in compared:
        if path in paired and target is not None:
            runs = [float(ratio) for ratio in paired[path]]  # type: ignore[attr-defined]
        elif path in per_gb and baseline in per_gb:
            runs = [float(a) / float(b) for a, b in zip(per_gb[path], per_gb[baseline], strict=True)]  # type: ignore[call-overload]
        else:
            continue
        ratio = statistics.median(runs)
        met = None if target is None else ratio <= target
        out.append({"path": path, "baseline": baseline, "ratio": ratio, "runs": runs, "target": target, "met": met})
    return out


def run(base: Path, total_bytes: int, size: int, backed: bool = False) -> list[dict[str, object]]:
    """Every path and baseline on datasets of ``total_bytes`` in all: 1/5 for
    the hits (read PASSES times), 1/10 for the misses, 7/10 for the exchange
    (which moves about a quarter of its dataset an epoch: what an exchange
    costs once per epoch, whatever it moves, spread as a job's epochs spread it)."""
    count = max(2 * BATCH, int(total_bytes * 0.2) // size)
    miss_count = max(BATCH, int(total_bytes * 0.1) // size)
    exchange_count = max(2 * BATCH, int(total_bytes * 0.7) // size)
    home = base / "work"
    home.mkdir(parents=True)
    roots = {
        name: make_files_dataset(base / "pfs" / name, n, sizes=(size,))
        for name, n in (("hits", count), ("miss", miss_count), ("xch", exchange_count))
    }
    # Given-away samples deleted at once: every sample that moves is sent, into pages that others freed.
    with LocalCluster(base / "cluster", 2, dataset_roots=(base,), daemon_args=("--spare-copies-fill", "0")) as local:
        rig = Rig(local)
        try:
            fills = back_free_memory if backed else lambda: None
            fills()
            rows = hits(rig, roots["hits"], count, size, home, fills)
            fills()
            rows.append(miss(rig, roots["miss"], miss_count, size))
            rows.extend(exchange(rig, roots["xch"], exchange_count, fills))
        finally:
            rig.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=600, help="MiB of datasets in all")
    parser.add_argument("--size-kib", type=int, default=110, help="bytes of every sample, in KiB")
    parser.add_argument("--runs", type=int, default=3, help="whole runs, each on a fresh cluster; medians reported")
    args = parser.parse_args()
    tune_malloc()  # as the daemons and the client run
    load = [os.getloadavg()]
    runs = []
    for index in range(args.runs):
        progress(f"run {index + 1} of {args.runs}")
        with tempfile.TemporaryDirectory(prefix="dq-bench-cpu-") as tmp:
            runs.append(run(Path(tmp), args.mib * MiB, args.size_kib * 1024, backed=True))
    rows = medians(runs)
    load.append(os.getloadavg())
    compared = ratios(rows)
    extra = {"load_average_start_end": load, "ratios": compared}
    columns = ["path", "MB", "cpu_s", "cpu_s_per_GB", "client_s", "node0_s", "node1_s", "directory_s"]
    columns += ["sender_s", "receiver_s", "reader_s", "wall_s"]
    report("cpu_per_gb", rows, columns, extra)
    print()
    for r in compared:
        verdict = "for context" if r["met"] is None else f"target <= {r['target']}x: {'met' if r['met'] else 'NOT met'}"
        print(f"{r['path']}: {r['ratio']:.2f}x {r['baseline']} ({verdict})")
    print(f"load average (1, 5, 15 min) at start {load[0]}, at end {load[1]}")


if __name__ == "__main__":
    main()
