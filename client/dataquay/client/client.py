"""A trainer's connection to its node's daemon.

The client reads local hits straight from the daemon's LMDB (no RPC), sends
every miss of a batch to the daemon in one streamed Read, and keeps each open
dataset's manifest so that it can read misses from the PFS itself when the
daemon stops answering. A training loop never fails because its daemon died:
it logs one warning, reads from the PFS, and tries the daemon again every
:data:`RETRY_DAEMON_SECONDS`.

Trainers are synchronous, so this is the synchronous gRPC API. gRPC channels
must not cross a fork: each process creates its own channel on first use,
from a subchannel pool of its own so that a forked child can never pick up a
connection its parent opened. gRPC's C core also breaks a child forked while
another thread is inside a call, so a fork waits for this process's calls in
flight (at most :data:`FORK_WAIT_SECONDS`) and holds new ones back until it
is done. gRPC's own fork support (GRPC_ENABLE_FORK_SUPPORT) is not needed
and is best left off: with it, children forked while a call is in flight
hang, or (with the wait above) the fork stalls for the whole wait.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from dataquay.client.channels import channel_options, daemon_address, grpc_target
from dataquay.client.errors import (
    CorruptValueError,
    DaemonUnavailableError,
    DataquayError,
    JobMismatchError,
    PfsReadError,
    SampleIdError,
    UnknownDatasetError,
    UnknownJobError,
)
from dataquay.client.local import LocalCache
from dataquay.client.manifest import Manifest
from dataquay.client.records import checksum
from dataquay.client.security import Credentials
from dataquay.client.shm import Segment, SegmentPool
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb

if TYPE_CHECKING:
    from dataquay.client.dataset import Dataset
    from dataquay.client.pfs import PfsReader

log = logging.getLogger("dataquay.client")

#: While the daemon is unreachable, it is tried again this often, with a call
#: that must answer within PROBE_SECONDS: a daemon that hangs costs its
#: trainers that much per retry, not a read's whole deadline.
RETRY_DAEMON_SECONDS = 2.0
PROBE_SECONDS = 0.5
#: Epochs :meth:`Client.stats` remembers.
EPOCHS_KEPT = 100
#: How often a client reports its counters to its daemon (and at set_epoch and close).
STATS_REPORT_SECONDS = 10.0
#: Deadline of one Read; a daemon that takes longer is treated as gone.
READ_TIMEOUT_SECONDS = 120.0
#: How long a fork waits for this process's calls in flight.
FORK_WAIT_SECONDS = 10.0
#: Where samples came from, as :meth:`Client.stats` counts them.
TIERS = ("local", "daemon-local", "peer", "pfs", "fallback")

_TIER_NAMES = {pb.TIER_LOCAL: "daemon-local", pb.TIER_PEER: "peer", pb.TIER_PFS: "pfs"}
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_T = TypeVar("_T")

# Channels a forked child inherited: never used or closed there (closing could
# shut down a connection its parent still uses), kept so nothing finalises them.
_inherited: list[object] = []
_clients: weakref.WeakSet[Client] = weakref.WeakSet()
# LMDB allows one open of an environment per process, so clients share them.
_local_caches: weakref.WeakValueDictionary[str, LocalCache] = weakref.WeakValueDictionary()
_local_caches_lock = threading.Lock()


@dataclass(frozen=True)
class ClientStats:
    """What this process has read through its client, by tier.

    Tiers: ``local`` (own LMDB, no RPC), ``daemon-local`` (the daemon's cache),
    ``peer`` (another daemon), ``pfs`` (the daemon read the PFS), ``fallback``
    (this process read the PFS because the daemon was unreachable).
    """

    samples: dict[str, int]
    bytes: dict[str, int]
    #: Seconds spent inside get_batch, item access and views: the time a
    #: training loop waited for data.
    data_wait_seconds: float
    #: Local values that failed checksum verification (served via the daemon).
    corrupt_local: int
    #: The epochs read through :meth:`Dataset.batches`, oldest first (the last
    #: EPOCHS_KEPT): how long each took and how much of it was data wait.
    epochs: tuple[EpochWait, ...] = ()


@dataclass(frozen=True)
class EpochWait:
    """One pass of ``Dataset.batches`` over a sampler's epoch."""

    epoch: int
    batches: int
    wall_seconds: float
    data_wait_seconds: float

    @property
    def stall_percent(self) -> float:
        """Share of the epoch's wall time spent waiting for data."""
        return 100 * self.data_wait_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples = dict.fromkeys(TIERS, 0)
        self.bytes = dict.fromkeys(TIERS, 0)
        self.wait = 0.0

    def add(self, tier: str, samples: int, nbytes: int, wait: float = 0.0) -> None:
        with self._lock:
            self.samples[tier] += samples
            self.bytes[tier] += nbytes
            self.wait += wait

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], float]:
        with self._lock:
            return dict(self.samples), dict(self.bytes), self.wait


class _CallGate:
    """Counts this process's calls in flight, so that a fork can wait for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls = 0
        self._forking = False

    def __enter__(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._calls += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    def hold(self) -> None:
        with self._cond:
            self._forking = True
            if not self._cond.wait_for(lambda: not self._calls, FORK_WAIT_SECONDS):
                log.warning("forking while %d dataquay calls are in flight", self._calls)

    def release(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()


def connect(address: str | None = None, *, timeout: float = 10.0, verify: bool = True) -> Client:
    """Connects to the dataquay daemon of this node.

    Args:
        address: a unix socket path, ``unix:PATH`` or ``HOST:PORT``; default
            DATAQUAY_ADDR, else the default socket.
        timeout: seconds to wait for the daemon to answer (it may still be
            starting), and the deadline of every metadata call.
        verify: check the checksum of every sample read (cheap next to a
            read; off only to measure).

    Raises:
        DaemonUnavailableError: no daemon answered within ``timeout``.
    """
    return Client(address or daemon_address(), timeout=timeout, verify=verify)


class Client:
    """A connection to one daemon, usable from any thread and across forks.

    Build it with :func:`connect`. It pickles (to spawned DataLoader
    workers, say) as its address and settings; the copy reconnects lazily.
    """

    def __init__(self, address: str, *, timeout: float = 10.0, verify: bool = True) -> None:
        self._setup(address, timeout, verify)
        try:
            self._info = self._call(
                "Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
            )
        except DataquayError:
            self.close()
            raise
        self._local_cache()

    def _setup(self, address: str, timeout: float, verify: bool) -> None:
        self.address = address
        self.timeout = timeout
        self.verify = verify
        self._target = grpc_target(address)
        self._closed = False
        self._down_until = 0.0
        self._down_reason: str | None = None
        self._local: LocalCache | None = None
        self._local_opened = False
        self._pfs: dict[tuple[str, str], PfsReader] = {}
        self._segments = SegmentPool()
        self._credentials = Credentials.from_env()
        self._reset_process_state()
        _clients.add(self)

    def _reset_process_state(self) -> None:
        self._pid: int | None = None
        self._channel: grpc.Channel | None = None
        self._stub: cache_pb2_grpc.CacheStub | None = None
        self._lock = threading.Lock()
        self._gate = _CallGate()
        self._counters = _Counters()
        self._epochs: collections.deque[EpochWait] = collections.deque(maxlen=EPOCHS_KEPT)
        self._thread = threading.local()
        self._client_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._reported_at = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "timeout": self.timeout,
            "verify": self.verify,
            "info": self._info.SerializeToString(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["address"], state["timeout"], state["verify"])
        self._info = pb.InfoReply.FromString(state["info"])

    # ---------------------------------------------------------------- public

    @property
    def info(self) -> pb.InfoReply:
        """The daemon's Info: node name, version, cache path, max batch, pid."""
        return self._info

    def dataset(self, name: str) -> Dataset:
        """Opens a registered dataset, fetching its manifest.

        Raises:
            UnknownDatasetError: the daemon knows no dataset ``name``.
            DaemonUnavailableError: the daemon cannot be reached (a dataset
                cannot be opened without it; reads of one already open can).
        """
        from dataquay.client.dataset import Dataset

        request = pb.GetDatasetRequest(name=name)
        info = self._call("GetDataset", lambda stub: stub.GetDataset(request, timeout=self.timeout))
        data = self._call(
            "GetManifest",
            lambda stub: b"".join(c.data for c in stub.GetManifest(request, timeout=READ_TIMEOUT_SECONDS)),
        )
        manifest = Manifest(data)
        if manifest.num_samples != info.num_samples or manifest.manifest_id != info.manifest_id:
            raise DataquayError(f"dataset {name!r} was replaced while it was being opened; open it again")
        return Dataset(self, info, manifest)

    def datasets(self) -> list[pb.DatasetInfo]:
        """Every dataset the daemon has registered."""
        reply = self._call(
            "ListDatasets", lambda stub: stub.ListDatasets(pb.ListDatasetsRequest(), timeout=self.timeout)
        )
        return list(reply.datasets)

    def join_job(self, spec: jpb.JobSpec, must_exist: bool = False) -> jpb.Job:
        """Creates the cluster job ``spec`` names, or joins it; the daemon asks the directory.

        Settings left unset in ``spec`` take the job's values (see
        :func:`dataquay.client.jobs.job_spec`). Returns the job with every
        setting filled in.

        Raises:
            JobMismatchError: a setting of ``spec`` differs from the job's;
                the message names it.
            UnknownJobError: ``must_exist`` and there is no such job.
            UnknownDatasetError: the job's dataset is not registered.
            DaemonUnavailableError: the daemon cannot be reached.
        """
        request = jpb.JoinJobRequest(spec=spec, must_exist=must_exist)
        errors = {
            grpc.StatusCode.NOT_FOUND: UnknownJobError if must_exist else UnknownDatasetError,
            grpc.StatusCode.FAILED_PRECONDITION: JobMismatchError,
        }
        return self._call("JoinJob", lambda stub: stub.JoinJob(request, timeout=self.timeout), errors)

    def report_epoch(self, job_id: str, epoch: int) -> None:
        """Tells the job, through the daemon, that this rank entered ``epoch``.

        Best effort: daemons use a job's epoch to prepare the next one early,
        but training must not stop because the directory is unreachable, so
        a failure is logged at debug level and otherwise ignored.
        """
        if time.monotonic() < self._down_until:
            return
        self.report_stats()
        request = jpb.ReportEpochRequest(job_id=job_id, epoch=epoch)
        try:
            self._call("ReportEpoch", lambda stub: stub.ReportEpoch(request, timeout=self.timeout))
        except DataquayError as exc:
            log.debug("epoch %d of job %r not reported: %s", epoch, job_id, exc)

    def report_stats(self) -> None:
        """Sends this process's counters to the daemon, so the node's metrics
        count the local hits and the data wait that never reached it.

        Best effort, like :meth:`report_epoch`; done every
        STATS_REPORT_SECONDS while reading, at every epoch and at close.
        """
        self._reported_at = time.monotonic()
        if self._closed or self._reported_at < self._down_until:
            return
        samples, nbytes, wait = self._counters.snapshot()
        request = pb.ClientStatsReport(
            client=self._client_id,
            reads=[pb.ClientReads(tier=t, samples=samples[t], bytes=nbytes[t]) for t in TIERS],
            data_wait_seconds=wait,
        )
        try:
            self._call("ReportClientStats", lambda stub: stub.ReportClientStats(request, timeout=self.timeout))
        except DataquayError as exc:
            log.debug("counters not reported: %s", exc)

    def _waited(self, seconds: float) -> None:
        """Counts time a reader of prefetched batches waited for one."""
        self._counters.add("local", 0, 0, seconds)

    def stats(self) -> ClientStats:
        """Counters of this process since it started using the client."""
        samples, nbytes, wait = self._counters.snapshot()
        local = self._local
        return ClientStats(samples, nbytes, wait, local.corrupt if local is not None else 0, tuple(self._epochs))

    def _epoch_read(self, record: EpochWait) -> None:
        self._epochs.append(record)

    def close(self) -> None:
        """Closes the channel; the client is unusable after.

        The local cache is shared by the clients of this process and closes
        when the last of them lets it go.
        """
        if not self._closed and self._channel is not None and self._pid == os.getpid():
            self.report_stats()
        with self._lock:
            self._closed = True
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel = self._stub = None
            self._local = None
        self._segments.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r}, node={self._info.node!r})"

    # -------------------------------------------------- used by Dataset

    def _local_cache(self) -> LocalCache | None:
        """The daemon's LMDB, opened on first use; None when it cannot be read here."""
        if not self._local_opened:
            with self._lock:
                if not self._local_opened and self._info.cache_path:
                    try:
                        self._local = _shared_local_cache(self._info.cache_path)
                    except DataquayError as exc:
                        log.warning("reading every sample through the daemon: %s", exc)
                self._local_opened = True
        return self._local

    def _read_remote(self, dataset: Dataset, ids: np.ndarray) -> list[bytes]:
        """Samples the local cache lacks, in order: from the daemon, or from the
        PFS while the daemon is unreachable."""
        out: list[bytes] = []
        step = self._info.max_batch or len(ids)
        for start in range(0, len(ids), step):
            if not self._daemon_back():
                out += self._read_pfs(dataset, ids[start:])
                break
            try:
                out += self._read_daemon(dataset, ids[start : start + step])
            except DaemonUnavailableError as exc:
                self._daemon_down(exc)
                out += self._read_pfs(dataset, ids[start:])
                break
        return out

    def _served(self, local_hits: int, local_bytes: int, started: float) -> None:
        """Counts a call's local hits and the time since ``started`` as data
        wait, unless a prefetch thread made the call (its reader's wait counts)."""
        prefetching = getattr(self._thread, "prefetching", False)
        self._counters.add("local", local_hits, local_bytes, 0.0 if prefetching else time.perf_counter() - started)
        if time.monotonic() - self._reported_at >= STATS_REPORT_SECONDS:
            self.report_stats()

    # ---------------------------------------------------------- internals

    def _read_daemon(self, dataset: Dataset, ids: np.ndarray) -> list[bytes]:
        """Samples from the daemon, payloads through shared memory where it can.

        A payload whose checksum fails is asked for once more inline before
        the read fails: a segment is never trusted over the bytes themselves.
        """
        with self._segments.segment() as seg:
            out, bad = self._read_daemon_once(dataset, ids, seg)
        if bad:
            again, still_bad = self._read_daemon_once(dataset, ids[bad], None)
            if still_bad:
                want = int(ids[bad][still_bad[0]])
                raise CorruptValueError(f"sample {want} of {dataset.name!r} arrived with a bad checksum")
            for position, value in zip(bad, again):
                out[position] = value
        return out

    def _read_daemon_once(
        self, dataset: Dataset, ids: np.ndarray, seg: Segment | None
    ) -> tuple[list[bytes], list[int]]:
        """(samples in order, positions whose checksum failed)."""
        request = pb.ReadRequest(
            dataset=dataset.name, ids=ids.tolist(), manifest_id=dataset.manifest.manifest_id, job=dataset.job or ""
        )
        if seg is not None:
            request.shm_name, request.shm_size = seg.name, seg.size

        def read(stub: cache_pb2_grpc.CacheStub) -> list[pb.Sample]:
            samples: list[pb.Sample] = []
            for chunk in stub.Read(request, timeout=READ_TIMEOUT_SECONDS):
                samples.extend(chunk.samples)
            return samples

        samples = self._call("Read", read)
        self._daemon_up()
        if len(samples) != len(ids):
            raise DataquayError(f"the daemon sent {len(samples)} samples of {dataset.name!r} for {len(ids)} ids")
        out: list[bytes] = []
        bad: list[int] = []
        tiers = dict.fromkeys(TIERS, 0)
        sizes = dict.fromkeys(TIERS, 0)
        used_segment = False
        for position, (want, sample) in enumerate(zip(ids.tolist(), samples)):
            if sample.id != want:
                raise DataquayError(f"the daemon sent sample {sample.id} of {dataset.name!r} where {want} was due")
            if sample.in_shm and seg is not None:
                data = seg.map[sample.shm_offset : sample.shm_offset + sample.length]
                used_segment = True
            else:
                data = sample.data
            if self.verify and checksum(data) != sample.checksum:
                bad.append(position)
            tier = _TIER_NAMES.get(sample.tier, "daemon-local")
            tiers[tier] += 1
            sizes[tier] += len(data)
            out.append(data)
        if seg is not None:
            if used_segment:
                seg.daemon_mapped()
            elif seg.linked:
                self._segments.discard(seg)
        for tier, count in tiers.items():
            if count:
                self._counters.add(tier, count, sizes[tier])
        return out, bad

    def _read_pfs(self, dataset: Dataset, ids: np.ndarray) -> list[bytes]:
        from dataquay.client.pfs import PfsReader

        key = (dataset.name, dataset.manifest.manifest_id)
        reader = self._pfs.get(key)
        if reader is None:
            reader = self._pfs[key] = PfsReader(dataset.manifest, dataset.name)
        out = reader.read(ids)
        self._counters.add("fallback", len(out), sum(map(len, out)))
        return out

    def _daemon_down(self, exc: DaemonUnavailableError) -> None:
        if self._down_reason is None:
            log.warning(
                "%s; reading misses from the PFS and trying the daemon again every %.0f s",
                exc, RETRY_DAEMON_SECONDS,
            )
        self._down_reason = str(exc)
        self._down_until = time.monotonic() + RETRY_DAEMON_SECONDS

    def _daemon_back(self) -> bool:
        """Whether reads may go to the daemon: it was not found unreachable,
        or it answers a quick call once its retry time has come."""
        if self._down_reason is None:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            info = self._call("Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=PROBE_SECONDS))
        except DataquayError:
            self._down_until = time.monotonic() + RETRY_DAEMON_SECONDS
            return False
        self._daemon_up(info)
        return True

    def _daemon_up(self, info: pb.InfoReply | None = None) -> None:
        """Marks the daemon reachable again; ``info`` is its answer to Info, if just asked."""
        if self._down_reason is not None:
            self._down_reason = None
            log.info("dataquay daemon at %s answers again; misses go through it", self.address)
            # A restarted daemon may run with other limits.
            self._info = info or self._call("Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=self.timeout))

    def _channel_stub(self) -> cache_pb2_grpc.CacheStub:
        pid = os.getpid()
        with self._lock:
            if self._closed:
                raise DataquayError(f"client of {self.address} is closed")
            if self._pid != pid:
                if self._channel is not None:
                    _inherited.append(self._channel)
                options = [
                    *channel_options(),
                    # Connections of this channel only: a forked child must
                    # never share a connection with its parent.
                    ("grpc.use_local_subchannel_pool", 1),
                ]
                self._channel = self._credentials.channel(self.address, options)
                self._stub = cache_pb2_grpc.CacheStub(self._channel)
                self._pid = pid
            assert self._stub is not None
            return self._stub

    def _call(
        self,
        what: str,
        call: Callable[[cache_pb2_grpc.CacheStub], _T],
        errors: Mapping[grpc.StatusCode, type[DataquayError]] | None = None,
    ) -> _T:
        """Runs one RPC (a stream consumed whole) and maps its status to our errors.

        ``errors`` maps the codes whose meaning depends on the call (NOT_FOUND
        of a job or of a dataset) to the error to raise.
        """
        stub = self._channel_stub()
        try:
            with self._gate:
                return call(stub)
        except grpc.RpcError as exc:
            raise self._error(what, exc, errors or {}) from None

    def _error(
        self, what: str, exc: grpc.RpcError, errors: Mapping[grpc.StatusCode, type[DataquayError]]
    ) -> DataquayError:
        code, details = exc.code(), exc.details()
        if code in errors:
            return errors[code](details)
        if code in _UNREACHABLE:
            return DaemonUnavailableError(
                f"dataquay daemon at {self.address} is unreachable ({code.name}: {details}); "
                "is `dataquay serve` running there, and does DATAQUAY_ADDR name its socket?"
            )
        if code == grpc.StatusCode.NOT_FOUND:
            return UnknownDatasetError(details)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return SampleIdError(details) if what == "Read" else DataquayError(details)
        if code == grpc.StatusCode.DATA_LOSS:
            return PfsReadError(details)
        return DataquayError(f"{what} failed: {code.name}: {details}")

    # --------------------------------------------------------------- fork

    def _before_fork(self) -> None:
        self._gate.hold()

    def _after_fork_in_parent(self) -> None:
        self._gate.release()

    def _after_fork_in_child(self) -> None:
        # Single-threaded here; locks may have been held by threads that do
        # not exist in this process. The inherited channel is set aside on
        # first use (pid check), which also covers forks that ran no hooks.
        channel, pid = self._channel, self._pid
        self._reset_process_state()
        self._channel, self._pid = channel, pid


def _shared_local_cache(path: str) -> LocalCache:
    key = os.path.realpath(path)
    with _local_caches_lock:
        cache = _local_caches.get(key)
        if cache is None:
            cache = _local_caches[key] = LocalCache(path)
        return cache


def _each_client(method: str) -> None:
    for client in list(_clients):
        getattr(client, method)()


def _after_fork_in_child() -> None:
    global _local_caches_lock
    _local_caches_lock = threading.Lock()
    _each_client("_after_fork_in_child")


os.register_at_fork(
    before=lambda: _each_client("_before_fork"),
    after_in_parent=lambda: _each_client("_after_fork_in_parent"),
    after_in_child=_after_fork_in_child,
)
