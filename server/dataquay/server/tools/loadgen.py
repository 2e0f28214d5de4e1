"""A load generator for one daemon: many concurrent clients reading random
batches through its Read RPC for a fixed time, every byte verified, the
daemon's memory watched.

A trainer's client would barely load the daemon: it serves cached samples
from the LMDB map in its own process, without any RPC. Here every read is one
batched Read call, issued three ways: as the client's miss path does it (unix
socket, payloads through a shared-memory segment), over the unix socket
inline, and over TCP as a caller on another node would. Ids are drawn
uniformly from the whole dataset, so with a cache smaller than the dataset
(the MinIO policy stops inserting when full) a steady share of them are PFS
reads. Each payload's xxh3 is checked against checksums the caller computed
from the PFS files itself, never against what the daemon claims.

Clients are threads of worker processes (``python -m
dataquay.server.tools.loadgen``), each thread with a channel (connection) of its
own. Workers import and connect first and then start together on the
parent's word, so start-up never counts in the figures. The parent samples
the daemon's resident memory once a second: a leak shows as growth after the
warm-up.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any, Self

import grpc
import numpy as np

from dataquay.client.channels import channel_options
from dataquay.client.records import checksum
from dataquay.client.security import Credentials
from dataquay.client.shm import SHM_DIR, Segment
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.errors import DataquayError

#: How the clients call: the client's miss path (unix socket, payloads in
#: shared memory), the unix socket inline, and TCP as a remote caller.
TRANSPORTS = ("shm", "unix", "tcp")
#: Deadline of one Read: a reply slower than this counts as an error.
READ_TIMEOUT_SECONDS = 30.0
#: Pause of a client after a failed call, so a dead daemon is not spun on.
ERROR_PAUSE_SECONDS = 0.05
#: How long workers may take to import, connect and say they are ready.
READY_TIMEOUT_SECONDS = 60.0
#: Dataset of ``dataquay bench load``: sizes from a thumbnail to an ImageNet JPEG.
BENCH_SIZES = (4 << 10, 16 << 10, 64 << 10, 110 << 10)
LMDB_PAGE = 4096
MiB = 1 << 20
_PREFIX = "dq-load "
_TIER_NAMES = {pb.TIER_LOCAL: "local", pb.TIER_PEER: "peer", pb.TIER_PFS: "pfs"}


class LoadError(DataquayError):
    """The load could not be run: a worker did not start, or the inputs disagree."""


@dataclass(frozen=True)
class LoadSettings:
    """What to load: one dataset of one daemon, by how many clients, for how long."""

    dataset: str
    #: The daemon's unix socket.
    socket: str
    #: The daemon's TCP ``HOST:PORT``; empty: the ``tcp`` clients use the socket inline.
    tcp: str = ""
    processes: int = 8
    threads: int = 8
    seconds: float = 60.0
    #: Ids per Read.
    batch: int = 32
    seed: int = 0
    #: Memory growth is measured from this point of the run on; None: a fifth
    #: of the run, at most 10 s.
    warmup_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.processes < 1 or self.threads < 1 or self.batch < 1 or self.seconds <= 0:
            raise LoadError(
                f"a load needs at least one process, thread and id per batch and a positive duration, not "
                f"{self.processes} processes x {self.threads} threads, batches of {self.batch}, {self.seconds} s"
            )

    @property
    def clients(self) -> int:
        return self.processes * self.threads

    @property
    def warmup(self) -> float:
        return self.warmup_seconds if self.warmup_seconds is not None else min(10.0, self.seconds / 5)


@dataclass(frozen=True)
class Figures:
    """Counts, batch latency and throughput of a group of clients."""

    clients: int
    batches: int
    #: Samples received; ``verified`` of them had the right id and bytes.
    samples: int
    verified: int
    bytes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    samples_per_s: float
    mb_per_s: float


@dataclass(frozen=True)
class RssSample:
    """The daemon's resident memory at ``t`` seconds into the run, in bytes."""

    t: float
    vm_rss: int
    rss_anon: int


@dataclass(frozen=True)
class LoadResult:
    """One run: its figures in total and per transport, its errors by kind,
    where the samples came from, and the daemon's memory over time."""

    dataset: str
    num_samples: int
    processes: int
    threads: int
    batch: int
    #: Wall time from the start signal until the last client stopped.
    seconds: float
    total: Figures
    by_transport: dict[str, Figures]
    #: Samples by the tier the daemon served them from (local, peer, pfs).
    tiers: dict[str, int]
    errors: dict[str, int]
    #: The first message of each kind of error.
    error_examples: dict[str, str]
    warmup_seconds: float
    rss: list[RssSample]
    #: Growth after the warm-up: the median of the last quarter of the samples
    #: taken between the warm-up and the end of the run's duration, minus the
    #: median of the first quarter. Medians, because the bytes of the batches
    #: in flight swing single samples by tens of MiB; 0 without samples.
    rss_anon_growth: int
    vm_rss_growth: int

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------ the caller's side


def file_checksums(root: str | os.PathLike[str]) -> np.ndarray:
    """xxh3-64 of every file under ``root`` in the ``files`` format's id order
    (depth first, names in byte order, dot names skipped): the truth a load
    run verifies against, read from the PFS without the daemon."""

    def walk(folder: bytes) -> Iterator[bytes]:
        for name in sorted(os.listdir(folder)):
            if name.startswith(b"."):
                continue
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                yield from walk(path)
            elif os.path.isfile(path):
                yield path

    def digest(path: bytes) -> int:
        with open(path, "rb") as f:
            return checksum(f.read())

    return np.fromiter((digest(p) for p in walk(os.fsencode(root))), dtype=np.uint64)


def run_load(
    settings: LoadSettings, expected: np.ndarray, daemon_pid: int, *, progress: bool = True
) -> LoadResult:
    """Runs ``settings.clients`` clients against the daemon for ``settings.seconds``.

    Args:
        settings: the daemon, the dataset, the clients and the duration.
        expected: xxh3-64 of every sample of the dataset, by id (see
            :func:`file_checksums`).
        daemon_pid: the daemon's process, whose memory is sampled.
        progress: a progress bar on stderr.

    Errors of the run (failed calls, wrong bytes, a worker that died or
    hung) are counted in the result, not raised.

    Raises:
        LoadError: the checksums do not match the dataset's size, or a worker
            could not start.
    """
    with _open_stub(settings.socket) as stub:
        info = stub.GetDataset(pb.GetDatasetRequest(name=settings.dataset), timeout=30)
    if len(expected) != info.num_samples:
        raise LoadError(
            f"{len(expected)} checksums for dataset {settings.dataset!r} of {info.num_samples} samples"
        )
    with tempfile.TemporaryDirectory(prefix="dataquay-load-") as tmp:
        checksums_path = Path(tmp) / "checksums.npy"
        np.save(checksums_path, expected.astype(np.uint64, copy=False))
        shm_bytes = _round_up(settings.batch * (info.sample_size.max + 64), LMDB_PAGE)
        plans = [
            _plan(settings, worker, info, str(checksums_path), shm_bytes) for worker in range(settings.processes)
        ]
        with _Workers(plans, Path(tmp)) as workers:
            return _drive(settings, info, workers, daemon_pid, progress)


def _plan(settings: LoadSettings, worker: int, info: pb.DatasetInfo, checksums: str, shm_bytes: int) -> dict[str, Any]:
    first = worker * settings.threads
    transports = [TRANSPORTS[(first + t) % len(TRANSPORTS)] for t in range(settings.threads)]
    return {
        "worker": worker, "dataset": settings.dataset, "manifest_id": info.manifest_id,
        "num_samples": info.num_samples, "socket": settings.socket, "tcp": settings.tcp,
        "transports": transports, "seconds": settings.seconds, "batch": settings.batch,
        "seed": settings.seed, "checksums": checksums, "shm_bytes": shm_bytes,
    }


def _drive(
    settings: LoadSettings, info: pb.DatasetInfo, workers: _Workers, daemon_pid: int, progress: bool
) -> LoadResult:
    from tqdm import tqdm

    workers.wait_ready(READY_TIMEOUT_SECONDS)
    workers.go()
    started = time.monotonic()
    give_up = started + settings.seconds + READ_TIMEOUT_SECONDS + 10
    rss: list[RssSample] = []
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    total = round(settings.seconds)
    bar = tqdm(
        total=total, unit="s", desc=f"load {settings.clients} clients", disable=not progress,
        file=sys.stderr, bar_format="{desc}: {bar} {n:.0f}/{total} s{postfix}",
    )
    try:
        while True:
            now = time.monotonic() - started
            sample = _rss(daemon_pid, now)
            if sample is None:
                if "daemon exited" not in errors:
                    errors["daemon exited"] += 1
                    examples["daemon exited"] = f"process {daemon_pid} gone {now:.1f} s into the run"
            else:
                rss.append(sample)
            samples, failed = workers.counts()
            bar.set_postfix_str(
                f"{samples / max(now, 1e-9):,.0f} samples/s, {failed} errors"
                + (f", daemon RSS {sample.vm_rss / MiB:.0f} MiB" if sample is not None else ""),
                refresh=False,
            )
            bar.update(min(round(now), total) - bar.n)
            if workers.finished():
                break
            if time.monotonic() > give_up:
                for worker in workers.kill_running():
                    errors["worker hung"] += 1
                    examples.setdefault("worker hung", f"worker {worker} still running {settings.seconds:.0f} s + "
                                        f"{READ_TIMEOUT_SECONDS + 10:.0f} s after the start; killed")
                break
            time.sleep(1.0 - (time.monotonic() - started) % 1.0)
    finally:
        bar.close()
    reports = workers.reports()
    for worker, code, tail in workers.died():
        errors["worker died"] += 1
        examples.setdefault("worker died", f"worker {worker} exited with {code}: {tail}")
    return _result(settings, info, reports, errors, examples, rss)


def _result(
    settings: LoadSettings,
    info: pb.DatasetInfo,
    reports: list[dict[str, Any]],
    errors: Counter[str],
    examples: dict[str, str],
    rss: list[RssSample],
) -> LoadResult:
    tiers: Counter[str] = Counter()
    seconds = max((r["wall"] for r in reports), default=0.0)
    groups: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        errors.update(report["errors"])
        for kind, message in report["examples"].items():
            examples.setdefault(kind, message)
        tiers.update(report["tiers"])
        for transport, counts in report["transports"].items():
            groups.setdefault(transport, []).append(counts)
    by_transport = {t: _figures(groups[t], seconds) for t in TRANSPORTS if t in groups}
    total = _figures([c for t in groups for c in groups[t]], seconds)
    steady = [s for s in rss if settings.warmup <= s.t <= settings.seconds]
    return LoadResult(
        dataset=settings.dataset, num_samples=info.num_samples, processes=settings.processes,
        threads=settings.threads, batch=settings.batch, seconds=seconds, total=total, by_transport=by_transport,
        tiers=dict(tiers), errors=dict(errors), error_examples=examples, warmup_seconds=settings.warmup, rss=rss,
        rss_anon_growth=_growth([s.rss_anon for s in steady]), vm_rss_growth=_growth([s.vm_rss for s in steady]),
    )


def _growth(values: list[int]) -> int:
    if not values:
        return 0
    quarter = max(1, len(values) // 4)
    return int(np.median(values[-quarter:]) - np.median(values[:quarter]))


def _figures(counts: list[dict[str, Any]], seconds: float) -> Figures:
    latencies = np.concatenate(
        [np.frombuffer(base64.b64decode(c["latencies"]), dtype=np.float32) for c in counts] or [np.zeros(0, np.float32)]
    )
    p50, p99, top = (np.percentile(latencies, [50, 99, 100]) * 1e3).tolist() if len(latencies) else (0.0, 0.0, 0.0)
    samples = sum(c["samples"] for c in counts)
    nbytes = sum(c["bytes"] for c in counts)
    return Figures(
        clients=sum(c["clients"] for c in counts), batches=sum(c["batches"] for c in counts), samples=samples,
        verified=sum(c["verified"] for c in counts), bytes=nbytes, p50_ms=p50, p99_ms=p99, max_ms=top,
        samples_per_s=samples / seconds if seconds else 0.0, mb_per_s=nbytes / 1e6 / seconds if seconds else 0.0,
    )


def _rss(pid: int, t: float) -> RssSample | None:
    """VmRSS and RssAnon of ``pid`` from /proc; None once it is gone."""
    fields: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    if len(fields) < 2:
        return None
    return RssSample(round(t, 2), fields["VmRSS"], fields["RssAnon"])


class _Workers:
    """The worker processes and what they have said on stdout."""

    def __init__(self, plans: list[dict[str, Any]], log_dir: Path) -> None:
        self._plans = plans
        self._log_dir = log_dir
        self._procs: list[subprocess.Popen[str]] = []
        self._readers: list[threading.Thread] = []
        self._ready = [threading.Event() for _ in plans]
        self._ticks: list[tuple[int, int]] = [(0, 0)] * len(plans)
        self._done: list[dict[str, Any] | None] = [None] * len(plans)
        self._killed: set[int] = set()

    def __enter__(self) -> Self:
        try:
            for index, plan in enumerate(self._plans):
                with open(self._log_path(index), "w") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "dataquay.server.tools.loadgen"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=log, text=True,
                    )
                self._procs.append(proc)
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(json.dumps(plan) + "\n")
                proc.stdin.flush()
                reader = threading.Thread(target=self._read, args=(index, proc.stdout), daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_running()
        for reader in self._readers:
            reader.join(timeout=5)
        for proc in self._procs:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for index, ready in enumerate(self._ready):
            while not ready.wait(0.1):
                code = self._procs[index].poll()
                if code is not None:
                    raise LoadError(f"load worker {index} exited with {code}: {self._tail(index)}")
                if time.monotonic() > deadline:
                    raise LoadError(f"load worker {index} not ready after {timeout:.0f} s: {self._tail(index)}")

    def go(self) -> None:
        for proc in self._procs:
            assert proc.stdin is not None
            try:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died after saying ready: counted when the run ends

    def counts(self) -> tuple[int, int]:
        """Samples and errors the workers have reported so far."""
        return sum(t[0] for t in self._ticks), sum(t[1] for t in self._ticks)

    def finished(self) -> bool:
        return all(proc.poll() is not None for proc in self._procs)

    def kill_running(self) -> list[int]:
        """Kills the workers still running; returns their indexes.

        A worker that did not exit by itself may have left shared-memory
        segments that the daemon never mapped: those are removed.
        """
        killed = []
        for index, proc in enumerate(self._procs):
            if proc.poll() is None:
                proc.kill()
                killed.append(index)
                self._killed.add(index)
            if proc.wait() != 0:
                for path in SHM_DIR.glob(f"dataquay-{proc.pid}-*"):
                    path.unlink(missing_ok=True)
        return killed

    def reports(self) -> list[dict[str, Any]]:
        for reader in self._readers:
            reader.join(timeout=5)
        return [r for r in self._done if r is not None]

    def died(self) -> list[tuple[int, int | None, str]]:
        """(index, exit code, log tail) of each worker that ended without its report and was not killed."""
        return [
            (index, proc.returncode, self._tail(index))
            for index, proc in enumerate(self._procs)
            if self._done[index] is None and index not in self._killed
        ]

    def _read(self, index: int, stdout: IO[str]) -> None:
        for line in stdout:
            if not line.startswith(_PREFIX):
                continue
            event = json.loads(line[len(_PREFIX):])
            if event["event"] == "ready":
                self._ready[index].set()
            elif event["event"] == "tick":
                self._ticks[index] = (event["samples"], event["errors"])
            elif event["event"] == "done":
                self._done[index] = event

    def _log_path(self, index: int) -> Path:
        return self._log_dir / f"worker-{index}.log"

    def _tail(self, index: int) -> str:
        lines = self._log_path(index).read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-5:]) or "(no output)"


@contextmanager
def _open_stub(address: str) -> Iterator[cache_pb2_grpc.CacheStub]:
    channel = Credentials.from_env().channel(address, channel_options())
    try:
        yield cache_pb2_grpc.CacheStub(channel)
    finally:
        channel.close()


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


# ------------------------------------------------------------- the workers' side


class _LoadClient:
    """One client: a thread with its own channel, reading random batches until the deadline."""

    def __init__(self, plan: dict[str, Any], index: int, expected: np.ndarray) -> None:
        self.plan = plan
        self.transport: str = plan["transports"][index]
        self.expected = expected
        self.rng = np.random.default_rng((plan["seed"], plan["worker"], index))
        address = plan["tcp"] if self.transport == "tcp" and plan["tcp"] else plan["socket"]
        options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        self.channel = Credentials.from_env().channel(address, options)
        self.stub = cache_pb2_grpc.CacheStub(self.channel)
        self.segment = Segment(plan["shm_bytes"]) if self.transport == "shm" else None
        self.batches = self.samples = self.verified = self.bytes = 0
        self.latencies: list[float] = []
        self.tiers: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def connect(self) -> None:
        self.stub.Info(pb.InfoRequest(), timeout=READY_TIMEOUT_SECONDS, wait_for_ready=True)

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                self._one_batch()
        except Exception as exc:  # counted: a client that crashes is an error of the run, not of the worker
            self._error(f"client crashed: {type(exc).__name__}", str(exc))

    def _one_batch(self) -> None:
        plan = self.plan
        ids = self.rng.integers(0, plan["num_samples"], plan["batch"])
        request = pb.ReadRequest(dataset=plan["dataset"], ids=ids.tolist(), manifest_id=plan["manifest_id"])
        if self.segment is not None:
            request.shm_name, request.shm_size = self.segment.name, self.segment.size
        started = time.perf_counter()
        try:
            samples = [s for chunk in self.stub.Read(request, timeout=READ_TIMEOUT_SECONDS) for s in chunk.samples]
        except grpc.RpcError as exc:
            self._error(f"rpc {exc.code().name}", str(exc.details()))
            time.sleep(ERROR_PAUSE_SECONDS)
            return
        self.latencies.append(time.perf_counter() - started)
        self.batches += 1
        self.samples += len(samples)
        self._verify(ids.tolist(), samples)

    def _verify(self, ids: list[int], samples: list[pb.Sample]) -> None:
        if len(samples) != len(ids):
            self._error("wrong sample count", f"{len(samples)} samples for {len(ids)} ids")
            return
        in_shm = False
        for want, sample in zip(ids, samples):
            if sample.id != want:
                self._error("wrong id", f"sample {sample.id} where {want} was due")
                continue
            if sample.in_shm:
                if self.segment is None or sample.shm_offset + sample.length > self.segment.size:
                    self._error("bad shm offset", f"sample {want} at {sample.shm_offset}+{sample.length}")
                    continue
                data = self.segment.map[sample.shm_offset : sample.shm_offset + sample.length]
                in_shm = True
            else:
                data = sample.data
            digest, truth = checksum(data), int(self.expected[want])
            if digest != truth:
                self._error("wrong bytes", f"sample {want}: xxh3 {digest:#018x}, the PFS file's {truth:#018x}")
            elif sample.checksum != digest:
                self._error("wrong checksum field", f"sample {want}: {sample.checksum:#018x} for {digest:#018x}")
            else:
                self.verified += 1
                self.bytes += len(data)
                self.tiers[_TIER_NAMES.get(sample.tier, "unspecified")] += 1
        if in_shm and self.segment is not None:
            self.segment.daemon_mapped()

    def _error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, message)

    def close(self) -> None:
        self.channel.close()
        if self.segment is not None:
            self.segment.close()


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def _worker_main() -> None:
    """A worker process: reads its plan from stdin, connects, says ready,
    runs its clients from "go" until the deadline, reports and exits."""
    plan = json.loads(sys.stdin.readline())
    expected = np.load(plan["checksums"], mmap_mode="r")
    clients: list[_LoadClient] = []
    try:
        for index in range(len(plan["transports"])):
            clients.append(_LoadClient(plan, index, expected))
        for client in clients:
            client.connect()
        _say({"event": "ready"})
        if sys.stdin.readline().strip() != "go":
            return
        started = time.monotonic()
        deadline = started + plan["seconds"]
        threads = [threading.Thread(target=c.run, args=(deadline,), daemon=True) for c in clients]
        for thread in threads:
            thread.start()
        while alive := [thread for thread in threads if thread.is_alive()]:
            alive[0].join(1.0)
            _say({"event": "tick", "samples": sum(c.samples for c in clients),
                  "errors": sum(sum(c.errors.values()) for c in clients)})
        _say({"event": "done", **_report(clients, time.monotonic() - started)})
    finally:
        for client in clients:
            client.close()


def _report(clients: Sequence[_LoadClient], wall: float) -> dict[str, Any]:
    transports: dict[str, dict[str, Any]] = {}
    for transport in dict.fromkeys(c.transport for c in clients):
        mine = [c for c in clients if c.transport == transport]
        latencies = np.array([x for c in mine for x in c.latencies], dtype=np.float32)
        transports[transport] = {
            "clients": len(mine), "batches": sum(c.batches for c in mine), "samples": sum(c.samples for c in mine),
            "verified": sum(c.verified for c in mine), "bytes": sum(c.bytes for c in mine),
            "latencies": base64.b64encode(latencies.tobytes()).decode(),
        }
    errors: Counter[str] = Counter()
    tiers: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for client in clients:
        errors.update(client.errors)
        tiers.update(client.tiers)
        for kind, message in client.examples.items():
            examples.setdefault(kind, message)
    return {"wall": wall, "transports": transports, "errors": dict(errors), "examples": examples, "tiers": dict(tiers)}


# ------------------------------------------------------------ dataquay bench load


def partial_cache_size(sizes: Sequence[int], fraction: float) -> int:
    """A ``--cache-size`` whose LMDB map holds about ``fraction`` of samples of ``sizes``.

    A value of more than half a page takes whole overflow pages (its 8-byte
    checksum and a 16-byte header included); the B-tree and the environment's
    own pages add a little, reserved here as 64 pages plus 32 bytes a sample.
    """
    pages = sum(_round_up(size + 8 + 16, LMDB_PAGE) for size in sizes)
    return int(fraction * (pages + 32 * len(sizes))) + 64 * LMDB_PAGE


def register_and_stage(address: str, name: str, root: str | os.PathLike[str]) -> pb.StageProgress:
    """Registers ``root`` as dataset ``name`` and stages it as far as the cache takes it.

    Raises:
        LoadError: staging stopped with an error or skipped samples.
    """
    with _open_stub(address) as stub:
        stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root), format=pb.FORMAT_FILES), timeout=60)
        *_, last = stub.Stage(pb.StageRequest(dataset=name), timeout=600)
    if last.error or last.failed_samples:
        raise LoadError(f"staging {name!r} failed: {last.error or last.first_failure}")
    return last


def bench_load(
    seconds: float = 60.0,
    processes: int = 8,
    threads: int = 8,
    batch: int = 32,
    *,
    samples: int = 4096,
    sizes: Sequence[int] = BENCH_SIZES,
    cached: float = 0.75,
    out_dir: Path | None = None,
    progress: bool = True,
) -> tuple[LoadResult, pb.StageProgress]:
    """``dataquay bench load``: a daemon of its own on a temporary directory,
    a synthetic files dataset of ``samples`` of which its cache holds about
    ``cached``, and ``processes`` x ``threads`` clients for ``seconds``.

    Writes ``load.json`` to ``out_dir`` when given. Returns the result and
    what staging cached.
    """
    from dataquay.server.tools.processes import DaemonProcess
    from dataquay.server.tools.synthetic import make_files_dataset

    if not 0 < cached <= 1:
        raise LoadError(f"the cached share of the dataset must be in (0, 1], not {cached}")
    settings = LoadSettings("load", "", "", processes, threads, seconds, batch)
    with tempfile.TemporaryDirectory(prefix="dataquay-bench-load-") as tmp:
        base = Path(tmp)
        if progress:
            print(f"writing {samples} samples, staging about {cached:.0%} of them", file=sys.stderr, flush=True)
        root = make_files_dataset(base / "pfs", samples, sizes=sizes)
        expected = file_checksums(root)
        capacity = partial_cache_size([sizes[i % len(sizes)] for i in range(samples)], cached)
        daemon = DaemonProcess(base / "node", ("--cache-size", str(capacity))).start()
        try:
            staged = register_and_stage(daemon.address, "load", root)
            assert daemon.ready is not None
            settings = replace(settings, socket=daemon.address, tcp=daemon.ready["tcp"])
            result = run_load(settings, expected, int(daemon.ready["pid"]), progress=progress)
        finally:
            daemon.stop()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        document = {
            "benchmark": "load", "machine": _machine(), "argv": sys.argv, "sizes": list(sizes),
            "cached_samples": staged.done_samples, **result.to_json(),
        }
        (out_dir / "load.json").write_text(json.dumps(document, indent=1))
    return result, staged


def format_summary(result: LoadResult) -> str:
    """One table (a row per transport and one for all clients), then errors,
    tiers and the daemon's memory, for a terminal."""
    header = ("transport", "clients", "batches", "samples", "verified", "p50 ms", "p99 ms", "max ms", "samples/s",
              "MB/s")
    rows = [
        (name, f.clients, f.batches, f.samples, f.verified, f"{f.p50_ms:.1f}", f"{f.p99_ms:.1f}", f"{f.max_ms:.1f}",
         f"{f.samples_per_s:,.0f}", f"{f.mb_per_s:,.1f}")
        for name, f in [*result.by_transport.items(), ("all", result.total)]
    ]
    cells = [list(map(str, header)), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    errors = ", ".join(f"{kind} x{n} (first: {result.error_examples.get(kind, '')})"
                       for kind, n in sorted(result.errors.items()))
    served = sum(result.tiers.values()) or 1
    lines.append(f"{result.processes} processes x {result.threads} threads, batches of {result.batch}, "
                 f"{result.seconds:.1f} s")
    lines.append(f"errors: {errors or 'none'}")
    lines.append("served from: " + ", ".join(f"{t} {100 * n / served:.0f}%" for t, n in sorted(result.tiers.items())))
    if result.rss:
        first, last = result.rss[0], result.rss[-1]
        lines.append(
            f"daemon RSS: {first.vm_rss / MiB:.1f} -> {last.vm_rss / MiB:.1f} MiB "
            f"(anon {first.rss_anon / MiB:.1f} -> {last.rss_anon / MiB:.1f} MiB); growth after the "
            f"{result.warmup_seconds:.0f} s warm-up {result.vm_rss_growth / MiB:+.1f} MiB "
            f"(anon {result.rss_anon_growth / MiB:+.1f} MiB), medians of its first and last quarter"
        )
    return "\n".join(lines)


def _machine() -> str:
    return f"{os.cpu_count()} cores {platform.machine()}, Python {platform.python_version()}, {platform.system()}"


if __name__ == "__main__":
    _worker_main()
