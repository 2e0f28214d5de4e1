"""A trainer's connection to its node's daemon.

The client reads local hits straight from the daemon's LMDB (no RPC), sends
every miss of a batch to the daemon in one streamed Read, and keeps each open
dataset's manifest so that it can read misses from the PFS itself when the
daemon stops answering (:mod:`dataquay.client.remote`). Its parts keep
state per process (:mod:`dataquay.client.connection` its channel,
:mod:`dataquay.client.stats` its counters), so every fork runs each client's
hooks, in one order: the parent waits for its calls in flight, the child
starts its own channel and counters.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import grpc

from dataquay.client.connection import DaemonConnection
from dataquay.client.dataset import Dataset
from dataquay.client.errors import (
    DaemonUnavailableError,
    DataquayError,
    DirectoryUnavailableError,
    EpochTooFarError,
    JobMismatchError,
    UnknownDatasetError,
    UnknownJobError,
)
from dataquay.client.local import SharedLocalCache
from dataquay.client.manifest import Manifest
from dataquay.client.remote import RemoteReader
from dataquay.client.stats import ClientStats, ReadStats
from dataquay.client.wire.channels import batch_deadline, channel_options, daemon_address, directory_address
from dataquay.client.wire.probe import probe_daemon_socket
from dataquay.client.wire.status_codes import UNREACHABLE, error_from_rpc
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb

log = logging.getLogger("dataquay.client")
#: Seconds :func:`connect` waits for the daemon to answer by default (it may still be starting).
CONNECT_TIMEOUT = 10.0

_clients: weakref.WeakSet[Client] = weakref.WeakSet()

_T = TypeVar("_T")


def connect(address: str | None = None, *, timeout: float = CONNECT_TIMEOUT, verify: bool = True) -> Client:
    """Connects to the dataquay daemon of this node.

    Args:
        address: a unix socket path, ``unix:PATH`` or ``HOST:PORT``; default
            DATAQUAY_ADDR, else the default socket.
        timeout: seconds to wait for the daemon to answer (it may still be
            starting), and the deadline of every metadata call.
        verify: check the checksum of every sample read (cheap next to a
            read; off only to measure), but for peer payloads that the
            daemon checked where they lie in this process's sealed segment.

    When no daemon answers but DATAQUAY_DIRECTORY names the directory, the
    client starts with its daemon marked down: datasets and jobs come from
    the directory, misses from the PFS, until the daemon answers.

    Raises:
        DaemonUnavailableError: no daemon answered within ``timeout``, and
            no directory is known.
    """
    return Client(address or daemon_address(), timeout=timeout, verify=verify)


class Client:
    """A connection to one daemon, usable from any thread and across forks.

    Build it with :func:`connect`. It pickles (to spawned DataLoader
    workers, say) as its address and settings; the copy reconnects lazily.
    """

    def __init__(self, address: str, *, timeout: float = CONNECT_TIMEOUT, verify: bool = True) -> None:
        self._setup(address, timeout, verify)
        try:
            probe_daemon_socket(address, timeout)
            self._remote.info = self._connection.call(
                "Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
            )
        except DaemonUnavailableError as exc:
            if self._directory is None:
                self.close()
                raise
            self._remote.mark_down(exc)
        except DataquayError:
            self.close()
            raise
        self._local.get()

    def _setup(self, address: str, timeout: float, verify: bool) -> None:
        self.address = address
        self.timeout = timeout
        self.verify = verify
        self._connection = DaemonConnection(address)
        self._directory = directory_address()
        self._stats = ReadStats(at_exit=_report_every_client)
        remote = self._remote = RemoteReader(self._connection, self._stats, timeout=timeout, verify=verify)
        self._local = SharedLocalCache(lambda: remote.info.cache_path)
        _clients.add(self)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "timeout": self.timeout,
            "verify": self.verify,
            "info": self.info.SerializeToString(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["address"], state["timeout"], state["verify"])
        self._remote.info = pb.InfoReply.FromString(state["info"])

    # ---------------------------------------------------------------- public

    @property
    def info(self) -> pb.InfoReply:
        """The daemon's Info: node name, version, cache path, max batch, pid."""
        return self._remote.info

    @property
    def local_cache(self) -> SharedLocalCache:
        """The daemon's LMDB as this client reads it; its datasets read through it too."""
        return self._local

    @property
    def remote(self) -> RemoteReader:
        """What reads the misses of this client's datasets: the daemon, or the PFS while it is down."""
        return self._remote

    @property
    def read_stats(self) -> ReadStats:
        """The counters behind :meth:`stats`, which this client's datasets count into."""
        return self._stats

    def dataset(self, name: str) -> Dataset:
        """Opens a registered dataset, fetching its manifest.

        Raises:
            UnknownDatasetError: the daemon knows no dataset ``name``.
            DaemonUnavailableError: the daemon cannot be reached and no
                directory is known (reads of a dataset already open go on).
            DirectoryUnavailableError: neither the daemon nor the directory answers.
        """
        request = pb.GetDatasetRequest(name=name)
        info: pb.DatasetInfo = self._ask("GetDataset", lambda stub: stub.GetDataset(request, timeout=self.timeout))
        deadline = batch_deadline(self.timeout, info.manifest_bytes)
        data: bytes = self._ask(
            "GetManifest", lambda stub: b"".join(c.data for c in stub.GetManifest(request, timeout=deadline))
        )
        manifest = Manifest(data)
        if manifest.num_samples != info.num_samples or manifest.manifest_id != info.manifest_id:
            raise DataquayError(f"dataset {name!r} was replaced while it was being opened; open it again")
        return Dataset(self, info, manifest, local=self._local, remote=self._remote, stats=self._stats)

    def datasets(self) -> list[pb.DatasetInfo]:
        """Every dataset the daemon has registered."""
        reply = self._connection.call(
            "ListDatasets", lambda stub: stub.ListDatasets(pb.ListDatasetsRequest(), timeout=self.timeout)
        )
        return list(reply.datasets)

    def join_job(self, spec: jpb.JobSpec, must_exist: bool = False) -> jpb.Job:
        """Creates the cluster job ``spec`` names, or joins it; the daemon asks the
        directory (this client asks it itself while the daemon is down).

        Settings left unset in ``spec`` take the job's values (see
        :func:`dataquay.client.jobs.job_spec`). Returns the job with every
        setting filled in.

        Raises:
            JobMismatchError: a setting of ``spec`` differs from the job's;
                the message names it.
            UnknownJobError: ``must_exist`` and there is no such job.
            UnknownDatasetError: the job's dataset is not registered.
            DaemonUnavailableError: the daemon cannot be reached and no
                directory is known.
        """
        request = jpb.JoinJobRequest(spec=spec, must_exist=must_exist)
        errors = {
            grpc.StatusCode.NOT_FOUND: UnknownJobError if must_exist else UnknownDatasetError,
            grpc.StatusCode.FAILED_PRECONDITION: JobMismatchError,
        }
        job: jpb.Job = self._ask("JoinJob", lambda stub: stub.JoinJob(request, timeout=self.timeout), errors)
        return job

    def prep_sync(self, request: pb.PrepSyncRequest) -> pb.PrepSyncReply:
        """One call of a coordinated prep group's member (:mod:`dataquay.client.coordinated`).

        Raises:
            JobMismatchError: the group exists with other settings.
            InvalidRequestError: settings no group can have.
            DaemonUnavailableError: the daemon does not answer.
        """
        deadline = self.timeout + request.wait_seconds
        reply: pb.PrepSyncReply = self._connection.call(
            "PrepSync", lambda stub: stub.PrepSync(request, timeout=deadline)
        )
        return reply

    def _ask(
        self, what: str, call: Callable[[Any], _T], errors: Mapping[grpc.StatusCode, type[DataquayError]] | None = None
    ) -> _T:
        """Runs ``call`` on the daemon's stub, or on the directory's while the
        daemon is down and DATAQUAY_DIRECTORY names one: both serve datasets
        and joins alike, so a rank that starts while its daemon is down can
        still open its dataset and join its job. Several directory replicas
        (DATAQUAY_DIRECTORY=a:7070,b:7070) are asked in turn while they are unreachable."""
        if self._directory is None or not self._remote.daemon_down:
            try:
                return self._connection.call(what, call, errors)
            except DaemonUnavailableError as exc:
                if self._directory is None:
                    raise
                self._remote.mark_down(exc)
        replicas = [a.strip() for a in self._directory.split(",") if a.strip()]
        for replica in replicas:
            channel = self._connection.credentials.channel(replica, channel_options())
            try:
                return call(directory_pb2_grpc.DirectoryStub(channel))
            except grpc.RpcError as exc:
                if exc.code() not in UNREACHABLE or replica == replicas[-1]:
                    raise error_from_rpc(exc, errors) or DirectoryUnavailableError(
                        f"{what} failed: the daemon at {self.address} is down and the directory at "
                        f"{self._directory} does not answer ({exc.code().name}: {exc.details()})"
                    ) from None
            finally:
                channel.close()
        raise AssertionError("no directory replica was asked")

    def report_epoch(self, job_id: str, epoch: int, rank: int | None = None, wait_seconds: float = 0.0) -> None:
        """Tells the job, through the daemon, that this rank entered ``epoch``
        (and the daemon which ``rank`` it is, when given: what the node gives
        away then stays until that rank has read it).

        Best effort: daemons use a job's epoch to prepare the next one early,
        but training must not stop because the directory is unreachable, so
        a failure is logged at debug level and otherwise ignored; all but an
        epoch the job refuses as too far ahead, which is this rank's mistake.
        With ``wait_seconds`` the daemon holds the call, at most that long,
        until the exchange into ``epoch`` has brought its node every sample
        it takes in; the time held counts in ``stats().exchange_wait_seconds``.

        Raises:
            EpochTooFarError: see :func:`~dataquay.client.jobs.check_epoch_ahead`.
        """
        if self._remote.daemon_down:
            return
        self.report_stats()
        request = jpb.ReportEpochRequest(job_id=job_id, epoch=epoch, rank=rank, wait_exchange_seconds=wait_seconds)
        started = time.monotonic()
        try:
            self._connection.call(
                "ReportEpoch", lambda stub: stub.ReportEpoch(request, timeout=self.timeout + wait_seconds)
            )
        except EpochTooFarError:
            raise
        except DataquayError as exc:
            log.debug("epoch %d of job %r not reported: %s", epoch, job_id, exc)
        finally:
            if wait_seconds > 0:
                self._stats.exchange_waited(time.monotonic() - started)

    def report_position(self, job_id: str, epoch: int, rank: int, position: int, done: bool) -> None:
        """Notes how far rank ``rank`` read ``epoch``; sent with the next
        counters report, at once if none went out for a while or the rank
        read all of it (``done``). Best effort."""
        if self._stats.note_position(job_id, epoch, rank, position) or done:
            self.report_stats()

    def report_stats(self, closing: bool = False) -> None:
        """Sends this process's counters to the daemon, so the node's metrics
        count the local hits and the data wait that never reached it.

        Best effort, like :meth:`report_epoch`; done every
        STATS_REPORT_SECONDS while reading, at every epoch, at close and when
        the process ends (a DataLoader worker's last reads), those two
        ``closing``, so the node stops counting this client.
        """
        request = self._stats.report(closing)
        if self._connection.closed or self._remote.daemon_down:
            return
        try:
            self._connection.call(
                "ReportClientStats", lambda stub: stub.ReportClientStats(request, timeout=self.timeout)
            )
        except DataquayError as exc:
            log.debug("counters not reported: %s", exc)

    def _report_at_exit(self) -> None:
        self.report_stats(closing=True)

    def stats(self) -> ClientStats:
        """Counters of this process since it started using the client, with
        what the processes it forked (DataLoader workers) read through it."""
        return self._stats.snapshot(self._local.corrupt)

    def close(self) -> None:
        """Closes the channel; the client is unusable after.

        The local cache is shared by the clients of this process and closes
        when the last of them lets it go.
        """
        if self._connection.open_here:
            self._remote.flush()
            self.report_stats(closing=True)
        self._connection.close()
        self._local.release()
        self._remote.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r}, node={self.info.node!r})"

    # --------------------------------------------------------------- fork

    def _before_fork(self) -> None:
        self._connection.before_fork()

    def _after_fork_in_parent(self) -> None:
        self._connection.after_fork_in_parent()

    def _after_fork_in_child(self) -> None:
        self._connection.after_fork_in_child()
        self._stats.after_fork_in_child()
        self._local.after_fork_in_child()
        self._remote.after_fork_in_child()


def _report_every_client() -> None:
    """Reports what this process's open clients counted, as their last reports."""
    _each_client("_report_at_exit")


def _each_client(method: str) -> None:
    for client in list(_clients):
        getattr(client, method)()


os.register_at_fork(
    before=lambda: _each_client("_before_fork"),
    after_in_parent=lambda: _each_client("_after_fork_in_parent"),
    after_in_child=lambda: _each_client("_after_fork_in_child"),
)
