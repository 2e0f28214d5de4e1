"""Simulated training ranks of a cluster job, one process each, as torchrun
would start them: what the demo and the cluster tests run.

A rank process (``python -m dataquay.server.tools.trainers``) takes everything from its
environment, like a real trainer: its node's daemon (DATAQUAY_ADDR), the job
(DATAQUAY_JOB) and its place in the job (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE). It joins the job through its daemon and then obeys one
command per line on stdin: read an epoch of its sampler's ids in batches, or
read the same ids straight from the PFS for comparison. It answers one JSON
line per command on stdout with what it read (ids and their checksums), where
the samples came from and how long it waited for them.

:class:`RankGroup` is the launcher's side: it starts the ranks, releases
every epoch to all of them at once (a barrier, so epochs are timed as a
job's), and can stop them all in the middle of an epoch to let a test break
something there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from dataquay.client.client import CONNECT_TIMEOUT
from dataquay.server.errors import DataquayError

#: Marks the protocol's lines on a rank's stdout, so that stray prints cannot confuse it.
_PREFIX = "dq-rank "


class RankError(DataquayError):
    """A rank process failed, or did not answer in time."""


@dataclass(frozen=True)
class RankEpoch:
    """What one rank read in one epoch (or in the direct-from-PFS pass)."""

    rank: int
    node: str
    epoch: int
    ids: list[int]
    checksums: list[int]
    #: Samples and bytes by client tier (local, cache, peer, pfs, fallback).
    samples: dict[str, int]
    bytes: dict[str, int]
    wall_seconds: float
    wait_seconds: float

    @property
    def nbytes(self) -> int:
        return sum(self.bytes.values())


# --------------------------------------------------------------- the rank


def _say(out: TextIO, **event: Any) -> None:
    out.write(_PREFIX + json.dumps(event) + "\n")
    out.flush()


def _rank_main(dataset: str, batch: int, compute_seconds: float, connect_timeout: float) -> None:
    """Joins the job, then runs commands from stdin until it closes."""
    from dataquay.client import connect

    out = sys.stdout
    client = connect(timeout=connect_timeout)
    try:
        ds = client.dataset(dataset)
        sampler = ds.sampler()
        _say(out, event="joined", node=client.info.node)
        for line in sys.stdin:
            command = json.loads(line)
            sampler.set_epoch(command["epoch"])
            direct = Direct(**command["direct"]) if command["direct"] is not None else None
            pause_at = len(sampler) // 2 if command["pause_mid"] else -1

            def pause() -> float:
                started = time.perf_counter()
                _say(out, event="mid")
                sys.stdin.readline()
                return time.perf_counter() - started

            before = client.stats()
            started = time.perf_counter()
            if direct is None:
                ids, sums, _, paused = _read_through_dataquay(
                    ds, sampler, batch, compute_seconds, command["read_ahead"], pause_at, pause
                )
                after = client.stats()
                tiers = {t: after.samples[t] - before.samples[t] for t in after.samples}
                sizes = {t: after.bytes[t] - before.bytes[t] for t in after.bytes}
                wait = after.data_wait_seconds - before.data_wait_seconds
            else:
                ids, sums, _, wait, tiers, sizes = _read_direct(ds, sampler, batch, compute_seconds, direct)
                paused = 0.0
            wall = time.perf_counter() - started - paused
            _say(
                out,
                event="epoch",
                epoch=command["epoch"],
                ids=ids,
                checksums=sums,
                samples=tiers,
                bytes=sizes,
                wall=wall,
                wait=wait,
            )
    finally:
        client.close()


def _read_through_dataquay(
    ds: Any,
    sampler: Any,
    batch: int,
    compute_seconds: float,
    read_ahead: int,
    pause_at: int,
    pause: Callable[[], float],
) -> tuple[list[int], list[int], int, float]:
    """One epoch of the sampler through the client: (ids, checksums, bytes, seconds paused)."""
    from dataquay.client.wire.records import checksum

    ids = sampler.indices().tolist()
    sums: list[int] = []
    nbytes = 0
    paused = 0.0
    # The batches first: zip then runs them to their end, which leaves the
    # next epoch's first batches read ahead.
    for samples, start in zip(ds.batches(sampler, batch, read_ahead=read_ahead), range(0, len(ids), batch)):
        if start <= pause_at < start + batch:
            paused += pause()
        sums += [checksum(s) for s in samples]
        nbytes += sum(map(len, samples))
        time.sleep(compute_seconds)
    return ids, sums, nbytes, paused


def _read_direct(
    ds: Any, sampler: Any, batch: int, compute_seconds: float, direct: Direct
) -> tuple[list[int], list[int], int, float, dict[str, int], dict[str, int]]:
    """One epoch read straight from the files, as a plain DataLoader would:
    ``direct.workers`` batches in flight, each worker reading its whole batch,
    through this rank's share of the PFS and an optional page-cache stand-in.
    Returns (ids, checksums, bytes, data wait, samples and bytes per tier)."""
    from concurrent.futures import ThreadPoolExecutor

    from dataquay.client.pfs import PfsReader
    from dataquay.client.wire.records import checksum
    from dataquay.server.ratelimit import TokenBucket

    reader = PfsReader(ds.manifest, ds.name)
    bucket = TokenBucket(direct.bytes_per_second) if direct.bytes_per_second else None
    cache = PageCache(direct.page_cache_bytes)
    ids = sampler.indices().tolist()
    counts = {"direct": [0, 0], "page-cache": [0, 0]}
    counting = threading.Lock()

    def read(chunk: list[int]) -> list[bytes]:
        out, misses = cache.get(chunk)
        if misses:
            nbytes = int(ds.manifest.sample_length[misses].sum())
            if bucket is not None:
                bucket.acquire(nbytes)
            for i, data in zip(misses, reader.read(misses)):
                out[i] = data
            cache.put({i: out[i] for i in misses})
        missed = set(misses)
        hits = [i for i in chunk if i not in missed]
        with counting:
            for tier, part in (("direct", misses), ("page-cache", hits)):
                counts[tier][0] += len(part)
                counts[tier][1] += int(ds.manifest.sample_length[part].sum()) if part else 0
        return [out[i] for i in chunk]

    sums: list[int] = []
    nbytes = 0
    wait = 0.0
    chunks = [ids[start : start + batch] for start in range(0, len(ids), batch)]
    with ThreadPoolExecutor(max(1, direct.workers)) as pool:
        pending = [pool.submit(read, chunk) for chunk in chunks[: direct.workers]]
        for index in range(len(chunks)):
            started = time.perf_counter()
            samples = pending[index].result()
            wait += time.perf_counter() - started
            if index + direct.workers < len(chunks):
                pending.append(pool.submit(read, chunks[index + direct.workers]))
            sums += [checksum(s) for s in samples]
            nbytes += sum(map(len, samples))
            time.sleep(compute_seconds)
    return (ids, sums, nbytes, wait, {t: c[0] for t, c in counts.items()}, {t: c[1] for t, c in counts.items()})


class PageCache:
    """Least recently used whole samples up to a byte budget: the OS page cache
    of a machine whose memory is smaller than the dataset, made explicit."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, ids: list[int]) -> tuple[dict[int, bytes], list[int]]:
        """The held samples of ``ids`` (now the most recently used), and the ids it lacks."""
        found: dict[int, bytes] = {}
        with self._lock:
            for i in ids:
                data = self._held.get(i)
                if data is not None:
                    self._held.move_to_end(i)
                    found[i] = data
        return found, [i for i in ids if i not in found]

    def put(self, samples: dict[int, bytes]) -> None:
        if not self.budget:
            return
        with self._lock:
            for i, data in samples.items():
                if i in self._held or len(data) > self.budget:
                    continue
                while self._bytes + len(data) > self.budget:
                    _, dropped = self._held.popitem(last=False)
                    self._bytes -= len(dropped)
                self._held[i] = data
                self._bytes += len(data)


@dataclass(frozen=True)
class Direct:
    """How a rank reads an epoch without dataquay (see :meth:`RankGroup.epoch`)."""

    #: This rank's share of the PFS bandwidth, bytes/s; 0 = uncapped.
    bytes_per_second: float = 0.0
    #: Batches read at once, like DataLoader workers.
    workers: int = 1
    #: Budget of the page-cache stand-in; 0 = none (every read hits the PFS).
    page_cache_bytes: int = 0


# ------------------------------------------------------------ the launcher


class RankGroup:
    """Rank processes of one job, driven epoch by epoch.

    Args:
        envs: one environment per rank, in rank order (on top of this
            process's): its node's variables and RANK, WORLD_SIZE, ...
        dataset: the dataset every rank reads.
        log_dir: where each rank's stderr goes (``rank-<r>.log``).
        batch: ids per read.
        compute_seconds: simulated GPU time per batch.
        timeout: seconds any one step may take before the group gives up.
        connect_timeouts: per rank, how long its client waits for its daemon
            to answer at start (``connect``'s timeout, its default each if not given):
            a rank whose daemon is known to be down need not wait it out.
        prefixes: per rank, what its command line runs under (``ip netns
            exec NAME`` for a rank whose node is in a network namespace).
    """

    def __init__(
        self,
        envs: Sequence[Mapping[str, str]],
        dataset: str,
        log_dir: Path,
        *,
        batch: int = 64,
        compute_seconds: float = 0.0,
        timeout: float = 120.0,
        prefixes: Sequence[Sequence[str]] | None = None,
        connect_timeouts: Sequence[float] | None = None,
    ) -> None:
        self._envs = [dict(e) for e in envs]
        self._connect_timeouts = [CONNECT_TIMEOUT] * len(envs) if connect_timeouts is None else list(connect_timeouts)
        self._prefixes = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in envs]
        self._args = [sys.executable, "-m", "dataquay.server.tools.trainers", dataset, str(batch), str(compute_seconds)]
        self._log_dir = log_dir
        self._timeout = timeout
        self._procs: list[subprocess.Popen[bytes]] = []
        self._buffers: list[bytes] = []
        #: Node each rank's daemon names, once the ranks joined.
        self.nodes: list[str] = []

    def start(self) -> RankGroup:
        """Starts every rank and waits until all joined the job."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for rank, env in enumerate(self._envs):
                with open(self._log_path(rank), "ab") as log:
                    self._procs.append(
                        subprocess.Popen(
                            [*self._prefixes[rank], *self._args, str(self._connect_timeouts[rank])],
                            env={**os.environ, **env},
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=log,
                        )
                    )
                self._buffers.append(b"")
            self.nodes = [event["node"] for event in self._gather("joined")]
        except BaseException:
            self.close()
            raise
        return self

    def epoch(
        self, epoch: int, *, mid: Callable[[], None] | None = None, direct: Direct | None = None, read_ahead: int = 0
    ) -> list[RankEpoch]:
        """Runs one epoch on every rank at once; returns what each read.

        Args:
            epoch: the epoch to read.
            mid: called once every rank has read half its ids and waits
                before they go on: a test breaks something mid-epoch here.
            direct: read the epoch's ids straight from the PFS instead, as a
                trainer without dataquay would (tiers ``direct`` and
                ``page-cache``).
            read_ahead: batches the client reads ahead of the rank (``ds.batches``).
        """
        command = {
            "epoch": epoch,
            "pause_mid": mid is not None,
            "read_ahead": read_ahead,
            "direct": dataclasses.asdict(direct) if direct is not None else None,
        }
        self._send(command)
        if mid is not None:
            self._gather("mid")
            mid()
            self._send({})
        return [
            RankEpoch(
                rank,
                self.nodes[rank],
                e["epoch"],
                e["ids"],
                e["checksums"],
                e["samples"],
                e["bytes"],
                e["wall"],
                e["wait"],
            )
            for rank, e in enumerate(self._gather("epoch"))
        ]

    def close(self) -> None:
        """Ends every rank: EOF on its stdin, then SIGKILL after a grace period."""
        for proc in self._procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> RankGroup:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---------------------------------------------------------- internals

    def _log_path(self, rank: int) -> Path:
        return self._log_dir / f"rank-{rank}.log"

    def _send(self, command: Mapping[str, Any]) -> None:
        line = (json.dumps(command) + "\n").encode()
        for rank, proc in enumerate(self._procs):
            assert proc.stdin is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except BrokenPipeError:
                raise self._failed(rank, "exited") from None

    def _gather(self, event: str) -> list[dict[str, Any]]:
        """The next protocol line of every rank, which must be ``event``."""
        deadline = time.monotonic() + self._timeout
        answers = []
        for rank in range(len(self._procs)):
            answer = self._next(rank, deadline)
            if answer.get("event") != event:
                raise self._failed(rank, f"said {answer.get('event')!r} where {event!r} was due")
            answers.append(answer)
        return answers

    def _next(self, rank: int, deadline: float) -> dict[str, Any]:
        proc = self._procs[rank]
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            line, sep, rest = self._buffers[rank].partition(b"\n")
            if sep:
                self._buffers[rank] = rest
                text = line.decode(errors="replace")
                if text.startswith(_PREFIX):
                    answer: dict[str, Any] = json.loads(text[len(_PREFIX) :])
                    return answer
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise self._failed(rank, f"did not answer within {self._timeout:.0f} s")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                proc.wait()
                raise self._failed(rank, f"exited with code {proc.returncode}")
            self._buffers[rank] += chunk

    def _failed(self, rank: int, what: str) -> RankError:
        try:
            tail = " | ".join(self._log_path(rank).read_text(errors="replace").strip().splitlines()[-5:])
        except OSError:
            tail = "(no log)"
        return RankError(f"rank {rank} {what}; its log {self._log_path(rank)}: {tail or '(empty)'}")


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
