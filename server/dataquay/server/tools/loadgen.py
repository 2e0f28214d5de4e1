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

Clients are threads of worker processes (:mod:`dataquay.server.tools.load_worker`),
each thread with a channel (connection) of its own. Workers import and
connect first and then start together on the parent's word, so start-up never counts in the figures. The parent samples
the daemon's resident memory once a second: a leak shows as growth after the
warm-up.
"""

from __future__ import annotations

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Self

import numpy as np

from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.records import checksum
from dataquay.client.wire.security import Credentials
from dataquay.client.wire.shm import SHM_DIR
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.errors import DataquayError
from dataquay.server.tools.load_results import LoadResult, MiB, RssSample, figures, growth
from dataquay.server.tools.load_worker import EVENT_PREFIX, READ_TIMEOUT_SECONDS, READY_TIMEOUT_SECONDS, TRANSPORTS

#: Dataset of ``dataquay bench load``: sizes from a thumbnail to an ImageNet JPEG.
BENCH_SIZES = (4 << 10, 16 << 10, 64 << 10, 110 << 10)
LMDB_PAGE = 4096


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


def run_load(settings: LoadSettings, expected: np.ndarray, daemon_pid: int, *, progress: bool = True) -> LoadResult:
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
        raise LoadError(f"{len(expected)} checksums for dataset {settings.dataset!r} of {info.num_samples} samples")
    with tempfile.TemporaryDirectory(prefix="dataquay-load-") as tmp:
        checksums_path = Path(tmp) / "checksums.npy"
        np.save(checksums_path, expected.astype(np.uint64, copy=False))
        shm_bytes = _round_up(settings.batch * (info.sample_size.max + 64), LMDB_PAGE)
        plans = [_plan(settings, worker, info, str(checksums_path), shm_bytes) for worker in range(settings.processes)]
        with _Workers(plans, Path(tmp)) as workers:
            return _drive(settings, info, workers, daemon_pid, progress)


def _plan(settings: LoadSettings, worker: int, info: pb.DatasetInfo, checksums: str, shm_bytes: int) -> dict[str, Any]:
    first = worker * settings.threads
    transports = [TRANSPORTS[(first + t) % len(TRANSPORTS)] for t in range(settings.threads)]
    return {
        "worker": worker,
        "dataset": settings.dataset,
        "manifest_id": info.manifest_id,
        "num_samples": info.num_samples,
        "socket": settings.socket,
        "tcp": settings.tcp,
        "transports": transports,
        "seconds": settings.seconds,
        "batch": settings.batch,
        "seed": settings.seed,
        "checksums": checksums,
        "shm_bytes": shm_bytes,
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
        total=total,
        unit="s",
        desc=f"load {settings.clients} clients",
        disable=not progress,
        file=sys.stderr,
        bar_format="{desc}: {bar} {n:.0f}/{total} s{postfix}",
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
                    examples.setdefault(
                        "worker hung",
                        f"worker {worker} still running {settings.seconds:.0f} s + "
                        f"{READ_TIMEOUT_SECONDS + 10:.0f} s after the start; killed",
                    )
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
    by_transport = {t: figures(groups[t], seconds) for t in TRANSPORTS if t in groups}
    total = figures([c for t in groups for c in groups[t]], seconds)
    steady = [s for s in rss if settings.warmup <= s.t <= settings.seconds]
    return LoadResult(
        dataset=settings.dataset,
        num_samples=info.num_samples,
        processes=settings.processes,
        threads=settings.threads,
        batch=settings.batch,
        seconds=seconds,
        total=total,
        by_transport=by_transport,
        tiers=dict(tiers),
        errors=dict(errors),
        error_examples=examples,
        warmup_seconds=settings.warmup,
        rss=rss,
        rss_anon_growth=growth([s.rss_anon for s in steady]),
        vm_rss_growth=growth([s.vm_rss for s in steady]),
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
                        [sys.executable, "-m", "dataquay.server.tools.load_worker"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
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
            if not line.startswith(EVENT_PREFIX):
                continue
            event = json.loads(line[len(EVENT_PREFIX) :])
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
        daemon = DaemonProcess(base / "node", ("--cache-size", str(capacity)), dataset_roots=(base,)).start()
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
            "benchmark": "load",
            "machine": _machine(),
            "argv": sys.argv,
            "sizes": list(sizes),
            "cached_samples": staged.done_samples,
            **result.to_json(),
        }
        (out_dir / "load.json").write_text(json.dumps(document, indent=1))
    return result, staged


def _machine() -> str:
    return f"{os.cpu_count()} cores {platform.machine()}, Python {platform.python_version()}, {platform.system()}"
