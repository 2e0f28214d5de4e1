"""``dataquay demo``: a 4-node cluster on this machine, a synthetic dataset on a
stand-in PFS, staging for a job, a few epochs of 8 training ranks in separate
processes under global and then partial shuffling, and a report.

It shows the partitioned cache at work: after staging, the PFS is not read
again; under global shuffling a rank finds about 1/4 of its samples in its own
node's cache and gets the other 3/4 from the peers that staged them; under
partial shuffling every read is local and the daemons exchange a fraction of
their samples between epochs. The global epochs are compared with the same
epoch read straight from the files, twice: from this machine's page cache,
and through the per-node bandwidth of a shared PFS as ``dataquay bench``
emulates it, which is what trainers on a cluster would read at; the report
says so. Ranks read ahead of themselves (``ds.batches``) and the job has a
batch size, so the daemons fetch the ranks' next steps from their peers
ahead too. Every sample's bytes are checked against the files. Everything
lives in a temporary directory that is removed at the end, and every process
started is stopped.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from dataquay.client import connect
from dataquay.client.malloc import tune_malloc
from dataquay.client.pfs import PfsReader
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.errors import DataquayError
from dataquay.server.sizes import format_bytes
from dataquay.server.tools.data_stall import DIRECT_WORKERS, PFS_BYTES_PER_SECOND
from dataquay.server.tools.demo_report import REAL_STEP, DemoRow, plot, write_json
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.processes import run_command
from dataquay.server.tools.synthetic import make_files_dataset
from dataquay.server.tools.trainers import Direct, RankEpoch, RankGroup

SIZES = (4 << 10, 16 << 10, 64 << 10, 110 << 10, 256 << 10)
NODES = 4
RANKS_PER_NODE = 2
BATCH = 64
SEED = 42
JOB = "demo-job"
PARTIAL_JOB = "demo-partial"
PARTIAL_Q = 0.25
#: Simulated GPU time per batch in the main epochs: short, so that they measure how fast
#: each system loads data (every loader waits on it most of the time).
COMPUTE_SECONDS = 0.002
#: A real GPU's time per batch (50-100 ms), for the epoch that shows the stall a trainer would see.
REAL_STEP_SECONDS = 0.075
#: Batches each rank's client reads ahead of it (``ds.batches``).
READ_AHEAD = 2
HEADER = ("epoch", "samples", "local", "peer", "pfs", "wall s", "samples/s", "MB/s", "data-wait s", "stall %")
WIDTHS = (10, 8, 6, 6, 6, 7, 10, 7, 12, 8)


def _row(cells: Sequence[object]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, WIDTHS))


def _cli(*argv: str) -> None:
    """Runs a dataquay command as a user would type it, and shows it."""
    print(f"$ dataquay {' '.join(argv)}", flush=True)
    if run_command(*argv):
        raise SystemExit(1)


def _expected_checksums(address: str, dataset: str) -> np.ndarray:
    """Checksum of every sample as the files hold it, read once, directly."""
    with connect(address) as client:
        manifest = client.dataset(dataset).manifest
    ids = np.arange(manifest.num_samples)
    reader = PfsReader(manifest, dataset)
    return np.array(
        [checksum(s) for start in range(0, len(ids), 512) for s in reader.read(ids[start : start + 512])],
        dtype=np.uint64,
    )


def _pfs_bytes(cluster: LocalCluster) -> int:
    """Bytes every daemon of the cluster has read from the PFS so far."""
    total = 0
    for daemon in cluster.daemons:
        assert daemon.ready is not None
        with grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()) as channel:
            total += cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10).pfs_bytes
    return int(total)


def _check(epoch: object, results: list[RankEpoch], expected: np.ndarray) -> None:
    """Every sample read exactly once, each with the bytes the files hold."""
    ids = np.concatenate([np.asarray(r.ids, dtype=np.int64) for r in results])
    sums = np.concatenate([np.asarray(r.checksums, dtype=np.uint64) for r in results])
    if len(np.unique(ids)) != len(expected):
        raise DataquayError(f"epoch {epoch}: the ranks read {len(np.unique(ids))} distinct samples of {len(expected)}")
    wrong = np.flatnonzero(sums != expected[ids])
    if len(wrong):
        raise DataquayError(f"epoch {epoch}: sample {ids[wrong[0]]} arrived with bytes that differ from its file")


def _measure(phase: str, label: str, results: list[RankEpoch], step_seconds: float) -> DemoRow:
    """The job's figures for one epoch: samples/s is every rank's samples over the slowest rank's wall time."""
    samples = sum(len(r.ids) for r in results)
    wall = max(r.wall_seconds for r in results)
    return DemoRow(
        phase=phase,
        label=label,
        step_ms=step_seconds * 1e3,
        samples=samples,
        wall_s=wall,
        wait_s=sum(r.wait_seconds for r in results) / len(results),
        stall_pct=100 * sum(r.wait_seconds for r in results) / sum(r.wall_seconds for r in results),
        samples_per_s=samples / wall,
        mb_per_s=sum(r.nbytes for r in results) / wall / 1e6,
    )


def _report(row: DemoRow, results: list[RankEpoch], tiers: Sequence[str]) -> str:
    # Of the reads made during the epoch: with read-ahead, they include the
    # next epoch's first batches and not this one's, read during the last.
    read = sum(sum(r.samples.values()) for r in results) or 1

    def share(*names: str) -> str:
        return f"{100 * sum(r.samples.get(n, 0) for r in results for n in names) / read:.0f}%"

    return _row(
        (
            row.label,
            row.samples,
            *(share(*t.split("+")) if t else "" for t in tiers),
            f"{row.wall_s:.2f}",
            f"{row.samples_per_s:,.0f}",
            f"{row.mb_per_s:,.0f}",
            f"{row.wait_s:.3f}",
            f"{row.stall_pct:.1f}",
        )
    )


def _exchanged(cluster: LocalCluster, job: str, epoch: int, timeout: float = 60.0) -> int:
    """Bytes the cluster's exchange into ``epoch`` sent, once every node finished it."""
    deadline = time.monotonic() + timeout
    while True:
        runs = []
        for daemon in cluster.daemons:
            assert daemon.ready is not None
            with grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()) as channel:
                stats = cache_pb2_grpc.CacheStub(channel).Stats(pb.StatsRequest(), timeout=10)
            runs.append(next((r for r in stats.exchanges if r.job == job and r.epoch == epoch), None))
        if all(r is not None and r.finished for r in runs) or time.monotonic() > deadline:
            return sum(r.sent_bytes for r in runs if r is not None)
        time.sleep(0.1)


TIERS = ("local+cache", "peer", "pfs+fallback")


def _train(
    cluster: LocalCluster, base: Path, job: str, epochs: int, expected: np.ndarray, exchange: bool = False
) -> list[DemoRow]:
    """Runs ``epochs`` epochs of the job's 8 ranks, checks every sample, prints
    a row per epoch; without ``exchange``, then reads the last epoch's ids
    straight from the files, from the page cache and through an emulated PFS."""
    world = NODES * RANKS_PER_NODE
    phase = "partial" if exchange else "global"
    rows: list[DemoRow] = []
    envs = [cluster.rank_env(rank, RANKS_PER_NODE, job) for rank in range(world)]
    print(f"starting {world} ranks ...", end=" ", flush=True)
    with RankGroup(envs, "demo", base / f"ranks-{job}", batch=BATCH, compute_seconds=COMPUTE_SECONDS) as ranks:
        print("joined the job\n")
        print(_row(HEADER) + ("  exchanged for next epoch" if exchange else ""))
        for epoch in range(epochs):
            results = ranks.epoch(epoch, read_ahead=READ_AHEAD)
            _check(epoch, results, expected)
            rows.append(_measure(phase, str(epoch), results, COMPUTE_SECONDS))
            text = _report(rows[-1], results, TIERS)
            if exchange:
                text += f"  {format_bytes(_exchanged(cluster, job, epoch + 1)):>25}"
            print(text, flush=True)
        if not exchange:
            pfs = Direct(PFS_BYTES_PER_SECOND / world, DIRECT_WORKERS)
            for label, direct in (("page cache", Direct()), ("PFS", pfs)):
                results = ranks.epoch(max(epochs - 1, 0), direct=direct)
                _check(label, results, expected)
                rows.append(_measure(phase, label, results, COMPUTE_SECONDS))
                print(_report(rows[-1], results, ("", "", "direct")), flush=True)
    return rows


def _real_step(cluster: LocalCluster, base: Path, job: str, epoch: int, expected: np.ndarray) -> list[DemoRow]:
    """Two epochs of the job at a real GPU step's pace through dataquay, and the
    same ids read straight from the emulated PFS at that pace: the stall a
    trainer would see."""
    world = NODES * RANKS_PER_NODE
    envs = [cluster.rank_env(rank, RANKS_PER_NODE, job) for rank in range(world)]
    pfs = Direct(PFS_BYTES_PER_SECOND / world, DIRECT_WORKERS)
    rows: list[DemoRow] = []
    with RankGroup(envs, "demo", base / "ranks-real-step", batch=BATCH, compute_seconds=REAL_STEP_SECONDS) as ranks:
        print(_row(HEADER))
        # Two epochs through dataquay: the first includes the new rank processes' start.
        runs = ((f"dataquay {epoch}", epoch, None), (f"dataquay {epoch + 1}", epoch + 1, None), ("PFS", epoch, pfs))
        for label, number, direct in runs:
            results = ranks.epoch(number, direct=direct, read_ahead=0 if direct else READ_AHEAD)
            _check(label, results, expected)
            rows.append(_measure(REAL_STEP, label, results, REAL_STEP_SECONDS))
            print(_report(rows[-1], results, TIERS if direct is None else ("", "", "direct")), flush=True)
    return rows


def _cluster_view(rows: Sequence[DemoRow]) -> str:
    """What the rates mean on a cluster, in words."""
    rates = {r.label: r.samples_per_s for r in rows}
    dataquay = float(np.median([rate for label, rate in rates.items() if label.isdigit()]))
    pfs, page_cache = rates["PFS"], rates["page cache"]
    return (
        f"On a cluster: without dataquay, every epoch comes from the shared PFS, here {pfs:,.0f} samples/s;\n"
        f"with dataquay, the global epochs read {dataquay:,.0f} samples/s (median; {dataquay / pfs:.0f}x) and the "
        "PFS not at all after staging.\n"
        f"The page cache's {page_cache:,.0f} samples/s ({dataquay / page_cache:.2f}x of it for dataquay) is what "
        "a node gets only\nwhen the whole dataset fits in its memory and was read before, never from a PFS "
        "shared by many nodes."
    )


def run_demo(samples: int = 4000, epochs: int = 3, out: Path = Path("dataquay-demo")) -> None:
    """Runs the demo and writes ``out/demo.json`` and, with matplotlib, ``out/demo.png``."""
    tune_malloc()
    world = NODES * RANKS_PER_NODE
    samples = max(samples - samples % world, world)  # no padding: exactly-once is checkable
    with tempfile.TemporaryDirectory(prefix="dataquay-demo-") as tmp:
        base = Path(tmp)
        print(
            f"dataquay demo: a {NODES}-node cluster on this machine, {samples} samples of {len(SIZES)} sizes, "
            f"{world} training ranks ({RANKS_PER_NODE} per node), {epochs} epochs of global shuffling, then "
            f"{epochs} of partial shuffling (--q {PARTIAL_Q})\n"
        )
        root = make_files_dataset(base / "pfs" / "demo", samples, sizes=SIZES, classes=10)
        total = sum(SIZES[i % len(SIZES)] for i in range(samples))
        print(f"PFS        {root}  ({samples} files in 10 class folders, {format_bytes(total)})")
        started = time.perf_counter()
        print(f"cluster    starting a directory and {NODES} daemons ...", end=" ", flush=True)
        with LocalCluster(base / "cluster", NODES, dataset_roots=(base,)) as cluster:
            print(f"up in {time.perf_counter() - started:.1f} s")
            print(f"           directory {cluster.directory_address}, service discovery {cluster.sd_url}")
            print(f"           per-node env files: {cluster.env_path()}, {cluster.base_dir}/node-<i>.env\n")
            _cli("dataset", "add", "demo", str(root), "--addr", cluster.daemons[0].address)
            _cli(
                "stage",
                "demo",
                "--job",
                JOB,
                "--mode",
                "global",
                "--seed",
                str(SEED),
                "--batch-size",
                str(BATCH),
                "--ranks-per-node",
                str(RANKS_PER_NODE),
                "--directory",
                cluster.directory_address,
            )
            expected = _expected_checksums(cluster.daemons[0].address, "demo")
            staged_pfs = _pfs_bytes(cluster)
            print(
                f"\ntraining: {world} rank processes, each with its node's env and RANK/WORLD_SIZE/LOCAL_RANK, "
                f"reading its\nJobSampler's ids in batches of {BATCH} ({READ_AHEAD} read ahead) with "
                f"{COMPUTE_SECONDS * 1e3:.0f} ms of simulated compute per batch; every sample's bytes checked.\n"
                f"A real GPU step takes 50-100 ms per batch; against {COMPUTE_SECONDS * 1e3:.0f} ms every loader, "
                "this one included, spends\nmost of its time waiting, so read the samples/s and MB/s columns here; "
                "`dataquay bench` measures\nthe stall with a 50 ms step (docs/results.md).\n"
            )
            rows = _train(cluster, base, JOB, epochs, expected)
            print(
                f"\n'local' is the rank's own node's cache (read in-process, no RPC); 'peer' came from the\n"
                "node that staged the sample. The last two rows read the last epoch's ids straight from the\n"
                "files, as a trainer without dataquay would: 'page cache' from this machine's memory, where\n"
                "the files of this small dataset sit; 'PFS' through a shared parallel file system's bandwidth\n"
                f"as `dataquay bench` emulates it ({PFS_BYTES_PER_SECOND / 1e6:.0f} MB/s for the cluster, "
                f"{PFS_BYTES_PER_SECOND / NODES / 1e6:.0f} MB/s per node, {DIRECT_WORKERS} readers per rank).\n\n"
                + _cluster_view(rows)
                + "\n\n"
                f"Partial shuffling: each rank reads what its node owns, and between epochs the daemons\n"
                f"exchange samples in the background: with --q {PARTIAL_Q} each node draws {PARTIAL_Q:g} of its "
                f"samples into\nthe epoch's pool and {PARTIAL_Q * (1 - 1 / NODES):g} of them leave it "
                f"(q(1 - 1/M), M = {NODES} nodes).\n"
            )
            _cli(
                "stage",
                "demo",
                "--job",
                PARTIAL_JOB,
                "--mode",
                "partial",
                "--q",
                str(PARTIAL_Q),
                "--seed",
                str(SEED),
                "--ranks-per-node",
                str(RANKS_PER_NODE),
                "--quiet",
                "--directory",
                cluster.directory_address,
            )
            print()
            rows += _train(cluster, base, PARTIAL_JOB, epochs, expected, exchange=True)
            print(
                f"\nAt a real GPU step: {REAL_STEP_SECONDS * 1e3:.0f} ms per batch, two epochs of the global job "
                "through dataquay (fresh rank\nprocesses: the first includes their start) and one straight from "
                "the emulated PFS. This is the\nstall a trainer would see.\n"
            )
            rows += _real_step(cluster, base, JOB, epochs, expected)
            training_pfs = _pfs_bytes(cluster) - staged_pfs
            print()
            _cli("status", "--directory", cluster.directory_address)
        print(
            f"\nDuring training the daemons read {format_bytes(training_pfs)} from the PFS (staging read "
            f"{format_bytes(staged_pfs)} once)."
        )
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "samples": samples,
        "batch": BATCH,
        "partial_q": PARTIAL_Q,
        "pfs_bytes_per_second": PFS_BYTES_PER_SECOND,
    }
    write_json(out / "demo.json", settings, rows)
    plotted = plot(rows, out / "demo.png")
    print(
        f"Results in {out}/demo.json" + (" and demo.png" if plotted else "; no plot (pip install matplotlib for one)")
    )
