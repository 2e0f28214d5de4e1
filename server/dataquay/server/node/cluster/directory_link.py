"""The daemon's link to the directory: registration, heartbeats and what it knows.

The daemon keeps its own copy of what it learned (live nodes and their
addresses, the jobs it serves, the manifests of datasets), so that running jobs
keep reading while the directory is down. Heartbeat replies carry version
numbers; nodes, jobs and datasets are fetched again only when theirs changed,
and nodes as the changes since the version of this node's copy (the whole
list only when the directory no longer has them, or restarted).
A directory that does not answer is retried with a growing back-off and logged
once per outage, not once per attempt.

The epochs this node's ranks enter are applied to its copy of the job at once
(what starts the next exchange) and told to the directory in the background
(:mod:`.epoch_reports`), so a job's epochs go on while the directory is down;
a copy the directory sends back keeps the higher epoch this node holds until
its report has gone.

Several directory replicas (``--directory a:7070,b:7070``, one cluster on a
shared store) are one directory: the link talks to one at a time and moves
to the next as soon as a call or a beat finds it unreachable, so that a
replica's death costs at most a heartbeat period. After a move it fetches
the whole node list once (replicas number node-set versions apart).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from dataquay.client.jobs import check_epoch_ahead
from dataquay.client.wire.channels import channel_options, closed_under_the_call
from dataquay.client.wire.security import Credentials
from dataquay.client.wire.status_codes import UNREACHABLE, error_from_rpc
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.beats import HeartbeatSender
from dataquay.server.errors import DataquayError, DirectoryUnavailableError, EpochTooFarError, NodeNameTakenError
from dataquay.server.node.cluster.epoch_reports import EpochReports

log = logging.getLogger("dataquay.membership")

T = TypeVar("T")

#: First and longest wait between attempts to reach the directory.
RETRY_SECONDS = (0.5, 30.0)
#: Deadline of one call to the directory.
CALL_TIMEOUT_SECONDS = 10.0
#: How long a heartbeat datagram waits for its answer before the beat is
#: repeated by RPC.
DATAGRAM_WAIT_SECONDS = 0.5
#: How long an epoch report waits for the directory's answer, when the
#: directory was answering, before it returns this node's copy of the job.
REPORT_WAIT_SECONDS = 1.0
#: How often a job's record may be asked for again out of turn (see
#: :meth:`DirectoryLink.refresh_job`): peers' offers cannot drive the calls.
REFRESH_SECONDS = 1.0


def _relayed(exc: grpc.aio.AioRpcError) -> DataquayError:
    """The directory's answer as the domain error it raised, which the servicer relays with its class."""
    details = exc.details() or exc.code().name
    if exc.code() in UNREACHABLE:
        return DirectoryUnavailableError(f"the directory does not answer: {details}")
    return error_from_rpc(exc) or DataquayError(details)


def merged_nodes(nodes: dict[str, jpb.NodeStatus], reply: dpb.ListNodesReply) -> dict[str, jpb.NodeStatus]:
    """The copy ``nodes`` with ``reply`` applied: a new dict (readers may hold
    the old one), the whole list when the reply is not a delta."""
    if not reply.delta:
        return {n.info.name: n for n in reply.nodes}
    merged = {**nodes, **{n.info.name: n for n in reply.nodes}}
    for name in reply.removed:
        merged.pop(name, None)
    return merged


def entered(job: jpb.Job, epoch: int) -> jpb.Job:
    """A copy of ``job`` whose ranks entered ``epoch`` (an earlier one changes nothing)."""
    moved = jpb.Job()
    moved.CopyFrom(job)
    moved.epoch, moved.started = max(epoch, job.epoch), True
    return moved


class DirectoryLink:
    """Registers this node, renews its lease and keeps the cluster view fresh.

    Args:
        address: the directory's HOST:PORT, or several replicas' separated by commas.
        node_info: this node's registration, read when (re)registering.
        usage: (cache bytes used, entries) for heartbeats.
        datasets_changed: awaited when the directory's dataset registry
            changed (a dataset added, replaced or dropped).
        credentials: the node token and TLS material for the directory.
        refused: called when the directory refuses this node's name to a
            daemon that never held it in this run (a live node of another
            identity holds it); the link then stops.

    A name refused after this daemon held it (another node took it while
    this one was cut off past its lease) is logged and asked for again at
    the back-off: the other's lease may end.
    """

    def __init__(
        self,
        address: str,
        node_info: Callable[[], jpb.NodeInfo],
        usage: Callable[[], tuple[int, int]],
        datasets_changed: Callable[[], Awaitable[None]],
        credentials: Credentials = Credentials(),
        refused: Callable[[NodeNameTakenError], None] = lambda exc: None,
    ) -> None:
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        self.address = self.addresses[0]
        self.credentials = credentials
        self._node_info = node_info
        self._usage = usage
        self._datasets_changed = datasets_changed
        self._channel = credentials.aio_channel(self.address, channel_options())
        self.stub = directory_pb2_grpc.DirectoryStub(self._channel)
        #: Replicas tried since one last answered: a whole round of them backs off.
        self._tried = 0
        self.nodes: dict[str, jpb.NodeStatus] = {}
        self.jobs: dict[str, jpb.Job] = {}
        self.reachable = False
        self.registered = asyncio.Event()
        self._versions = dpb.Versions()
        #: The node-set version of :attr:`nodes` (0: none yet).
        self._nodes_version = 0
        self._heartbeat_seconds = 2.0
        self._lease_seconds = 2 * RETRY_SECONDS[1]
        self._looked_up: dict[str, float] = {}
        self._beats_by_rpc = False
        self._refused = refused
        #: The node's identity key (:mod:`dataquay.server.node.cluster.identity`), set
        #: once the cache dir is open, before the first registration.
        self.identity_key = b""
        #: What heartbeats carry: the session the last registration handed out.
        self._session = 0
        #: Set once the first registration was answered, or failed.
        self.first_attempt = asyncio.Event()
        self._held_name = False
        #: Epochs entered here that the directory has not answered yet.
        self.reports = EpochReports()
        #: Set by every answer of the directory; what queued reports wait for.
        self._answering = asyncio.Event()
        #: When the directory last answered a heartbeat (monotonic; 0: never).
        self._answered_at = 0.0
        #: The nodes of a job this node counts lost, told with its epoch reports
        #: (:mod:`dataquay.server.planning.absences`); none unless the healer says.
        self.lost: Callable[[jpb.Job], tuple[str, ...]] = lambda job: ()
        #: Set when this node's ranks enter an epoch (the healer clears it).
        self.epoch_entered = asyncio.Event()
        self._refreshed: dict[str, float] = {}
        self._refreshing: dict[str, asyncio.Future[jpb.Job]] = {}

    # ------------------------------------------------------------ background

    async def run(self) -> None:
        """Registers, then heartbeats until cancelled, riding out directory outages."""
        delay = RETRY_SECONDS[0]
        while True:
            try:
                if not self.registered.is_set():
                    await self._register()
                delay = RETRY_SECONDS[0]
                await self._beat()
            except NodeNameTakenError as exc:
                if not self._held_name:
                    self._refused(exc)
                    return
                if delay == RETRY_SECONDS[0]:
                    log.error(
                        "the directory gave this node's name to another node; asking for it again",
                        extra={"fields": {"directory": self.address, "error": str(exc)}},
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_SECONDS[1])
            except asyncio.CancelledError:
                if not closed_under_the_call():
                    raise
                # A call elsewhere moved to the next replica: beat there.
            except (grpc.aio.AioRpcError, OSError, DataquayError) as exc:
                # A DataquayError comes from _call, which went round the replicas already.
                if not isinstance(exc, DataquayError) and await self._fail_over(self.stub):
                    continue
                if self.reachable or delay == RETRY_SECONDS[0]:
                    reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    log.warning(
                        "directory unreachable; serving with what this node knows",
                        extra={"fields": {"directory": self.address, "error": reason}},
                    )
                self.reachable = False
                await asyncio.sleep(delay)
                # Within half a lease, so that a restarted directory hears
                # from this node before it would mark it down.
                delay = min(delay * 2, RETRY_SECONDS[1], self._lease_seconds / 2)
            except Exception:  # a bug here must not silence the node for good
                log.exception("directory link failed; retrying")
                self.registered.clear()
                await asyncio.sleep(RETRY_SECONDS[1])

    async def _beat(self) -> None:
        """Heartbeats until the directory forgets this node.

        Beats go as datagrams (see :mod:`dataquay.server.directory.beats`);
        one that goes unanswered is repeated through the Heartbeat RPC, whose
        failure (the directory down) ends the loop with an RpcError.
        """
        sender = await HeartbeatSender.connect(self.address, self.credentials.token)
        try:
            while True:
                started = time.monotonic()
                request = self._heartbeat()
                reply = await sender.beat(request, timeout=DATAGRAM_WAIT_SECONDS)
                by_rpc = reply is None
                if reply is None:
                    reply = await self.stub.Heartbeat(request, timeout=self._beat_timeout())
                    if not self._beats_by_rpc:
                        log.warning(
                            "heartbeat datagrams go unanswered (UDP blocked?); renewing the lease by RPC",
                            extra={"fields": {"directory": self.address}},
                        )
                self._beats_by_rpc = by_rpc
                if not reply.known:
                    log.info("the directory lost this node; registering again")
                    self.registered.clear()
                    return
                self._reached()
                await self._sync(reply.versions)
                await asyncio.sleep(max(0.0, self._heartbeat_seconds - (time.monotonic() - started)))
        finally:
            sender.close()

    def _beat_timeout(self) -> float:
        """A beat by RPC waits, with the datagram's wait, a heartbeat period where another replica could answer it."""
        if len(self.addresses) == 1:
            return CALL_TIMEOUT_SECONDS
        return max(DATAGRAM_WAIT_SECONDS, self._heartbeat_seconds - DATAGRAM_WAIT_SECONDS)

    async def _fail_over(self, failed: directory_pb2_grpc.DirectoryStub) -> bool:
        """Moves to the next replica after ``failed`` (the stub a call found
        unreachable) unless another call moved already; False once every
        replica was tried since one last answered (then the caller backs off)."""
        if len(self.addresses) == 1:
            return False
        if failed is self.stub:
            self._tried += 1
            if self._tried >= len(self.addresses):
                self._tried = 0
                return False
            old = self._channel
            self.address = self.addresses[(self.addresses.index(self.address) + 1) % len(self.addresses)]
            self._channel = self.credentials.aio_channel(self.address, channel_options())
            self.stub = directory_pb2_grpc.DirectoryStub(self._channel)
            self._nodes_version = 0
            # Said once an outage: while no replica answers, each round of them is tried quietly.
            (log.warning if self.reachable else log.debug)(
                "directory replica unreachable; moving to the next", extra={"fields": {"directory": self.address}}
            )
            await old.close()
        return True

    async def _register(self) -> None:
        request = dpb.RegisterNodeRequest(node=self._node_info(), identity_key=self.identity_key)
        try:
            reply = await self._call(lambda stub: stub.RegisterNode(request, timeout=CALL_TIMEOUT_SECONDS))
        finally:
            self.first_attempt.set()
        self._session = reply.session
        self._held_name = True
        self._heartbeat_seconds = reply.heartbeat_seconds or self._heartbeat_seconds
        self._lease_seconds = reply.lease_seconds or self._lease_seconds
        self._reached()
        await self._sync(reply.versions, force=True)
        self.registered.set()
        log.info("registered with the directory", extra={"fields": {"directory": self.address}})

    def _heartbeat(self) -> dpb.HeartbeatRequest:
        used, entries = self._usage()
        return dpb.HeartbeatRequest(
            name=self._node_info().name, cache_used_bytes=used, cache_entries=entries, session=self._session
        )

    def _reached(self) -> None:
        self._answering.set()
        self._answered_at = time.monotonic()
        self._tried = 0
        if not self.reachable:
            if self.registered.is_set():
                log.info("directory reachable again", extra={"fields": {"directory": self.address}})
            self.reachable = True

    async def _sync(self, versions: dpb.Versions, force: bool = False) -> None:
        if force or versions.nodes != self._nodes_version:
            await self._list_nodes()
        if force or versions.jobs != self._versions.jobs:
            jobs = await self.stub.ListJobs(jpb.ListJobsRequest(), timeout=CALL_TIMEOUT_SECONDS)
            self.jobs = {j.spec.job_id: self._held_epoch(j) for j in jobs.jobs}
        if force or versions.datasets != self._versions.datasets:
            await self._datasets_changed()
        self._versions = versions

    # --------------------------------------------------------------- lookups

    async def address_of(self, node: str) -> str:
        """The node's TCP address, or "" when the directory does not list it.

        A node that registered since the last listing is looked up at once
        (at most once a second per name), not at the next heartbeat, in the
        whole list: the directory publishes a registration as a change only
        up to a heartbeat period later.
        """
        now = time.monotonic()
        if node not in self.nodes and now - self._looked_up.get(node, 0.0) >= 1.0:
            self._looked_up[node] = now
            try:
                await self._list_nodes(whole=True)
            except grpc.aio.AioRpcError:
                pass
        status = self.nodes.get(node)
        return status.info.tcp_address if status is not None else ""

    def bulk_address_of(self, node: str) -> str:
        """The node's bulk data path address as last listed; "" for none (its bulk path off)."""
        status = self.nodes.get(node)
        return status.info.bulk_address if status is not None else ""

    def registered_at(self, node: str) -> float:
        """When the node's daemon last registered, as the directory listed it (0 if unlisted)."""
        status = self.nodes.get(node)
        return status.registered_unix if status is not None else 0.0

    def is_down(self, node: str) -> bool:
        """Whether the directory last listed the node as down (lease expired)."""
        status = self.nodes.get(node)
        return status is not None and status.state == jpb.NODE_DOWN

    async def list_nodes(self) -> None:
        """Lists the nodes now, whole, rather than at the next heartbeat that says
        they changed: before a decision every node of a job must take alike
        (what to stage), on what the directory knows, published or not. Keeps
        what it knew when the directory does not answer."""
        try:
            await self._list_nodes(whole=True)
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            if not closed_under_the_call():
                raise

    async def _list_nodes(self, whole: bool = False) -> None:
        """Brings :attr:`nodes` up to date: by the changes since its version, or ``whole``."""
        since = 0 if whole else self._nodes_version
        reply = await self.stub.ListNodes(dpb.ListNodesRequest(since_version=since), timeout=CALL_TIMEOUT_SECONDS)
        self.nodes = merged_nodes(self.nodes, reply)
        self._nodes_version = reply.versions.nodes

    async def job(self, job_id: str) -> jpb.Job:
        """The job's record: the copy this node keeps, else the directory's."""
        kept = self.jobs.get(job_id)
        if kept is not None:
            return kept
        job = await self._call(lambda stub: stub.GetJob(jpb.GetJobRequest(job_id=job_id), timeout=CALL_TIMEOUT_SECONDS))
        self.jobs[job_id] = job
        return job

    async def refresh_job(self, job_id: str) -> jpb.Job:
        """The directory's record of the job, asked again unless it was less
        than REFRESH_SECONDS ago: a peer whose offer this node's copy refuses
        may have a later one (the job's absent nodes change between heartbeats).

        Raises:
            UnknownJobError: the directory does not know the job.
            DirectoryUnavailableError: the directory does not answer.
        """
        asking = self._refreshing.get(job_id)
        if asking is None:
            if time.monotonic() - self._refreshed.get(job_id, -REFRESH_SECONDS) < REFRESH_SECONDS:
                return await self.job(job_id)
            self._refreshed[job_id] = time.monotonic()
            asking = self._refreshing[job_id] = asyncio.ensure_future(self._get_job(job_id))
            asking.add_done_callback(lambda _: self._refreshing.pop(job_id, None))
        # Callers that ask meanwhile wait for the same answer.
        return await asyncio.shield(asking)

    async def _get_job(self, job_id: str) -> jpb.Job:
        request = jpb.GetJobRequest(job_id=job_id)
        job = self._held_epoch(await self._call(lambda stub: stub.GetJob(request, timeout=CALL_TIMEOUT_SECONDS)))
        self.jobs[job_id] = job
        return job

    async def join_job(self, request: jpb.JoinJobRequest) -> jpb.Job:
        job = self._held_epoch(await self._call(lambda stub: stub.JoinJob(request, timeout=CALL_TIMEOUT_SECONDS)))
        self.jobs[job.spec.job_id] = job
        return job

    async def enter_epoch(self, job_id: str, epoch: int) -> jpb.Job:
        """This node's ranks entered ``epoch``: this node's copy of the job
        moves there now and the directory is told when it answers (:meth:`send_reports`).

        The bound on epochs ahead is checked on this node's copy, which may
        lag the job (other nodes' reports reach it only in the directory's
        answers): an epoch it refuses is asked of the directory, which decides.

        Raises:
            UnknownJobError: neither this node nor the directory knows the job.
            DirectoryUnavailableError: this node has no copy and the directory does not answer.
            EpochTooFarError: see :func:`~dataquay.client.jobs.check_epoch_ahead`.
        """
        job = await self.job(job_id)
        try:
            check_epoch_ahead(job_id, job.spec.mode, epoch, job.epoch)
        except EpochTooFarError:
            if not self.reachable:
                raise
            request = self._report_request(job_id, epoch)
            job = await self._call(lambda stub: stub.ReportEpoch(request, timeout=CALL_TIMEOUT_SECONDS))
        job = self.jobs[job_id] = entered(job, epoch)
        self.reports.add(job_id, epoch)
        self.epoch_entered.set()
        return job

    async def told(self, job: jpb.Job, epoch: int) -> jpb.Job:
        """The directory's answer to this node's report of ``epoch`` of ``job``,
        when the directory answers within REPORT_WAIT_SECONDS; ``job`` (this
        node's copy) when it does not, or missed its last heartbeats.

        Raises:
            DataquayError: the directory refused the report (the job dropped there).
        """
        # A directory that missed its last heartbeats is not waited for: it
        # may be stopped, and calls to it then last their whole deadline.
        if time.monotonic() - self._answered_at > 2 * self._heartbeat_seconds + DATAGRAM_WAIT_SECONDS:
            return job
        job_id = job.spec.job_id
        answer = self.reports.wait_for(job_id, epoch)
        try:
            told = await asyncio.wait_for(asyncio.shield(answer), REPORT_WAIT_SECONDS)
        except TimeoutError:
            return job
        finally:
            self.reports.stop_waiting(job_id, answer)
        if isinstance(told, DataquayError):
            raise told
        return told

    async def send_reports(self) -> None:
        """Tells the directory the epochs this node's ranks entered, until
        cancelled; while it does not answer, the reports wait for the next
        answer the heartbeats get."""
        while True:
            await self.reports.queued.wait()
            if not self.reachable:
                self._answering.clear()
                await self._answering.wait()
            for job_id, epoch in self.reports.pending():
                if not await self._report(job_id, epoch):
                    self._answering.clear()
                    await self._answering.wait()
                    break

    async def _report(self, job_id: str, epoch: int) -> bool:
        """Sends one report; False when the directory does not answer (it stays queued)."""
        request = self._report_request(job_id, epoch)
        try:
            job = await self._call(lambda stub: stub.ReportEpoch(request, timeout=CALL_TIMEOUT_SECONDS))
        except DirectoryUnavailableError:
            return False
        except DataquayError as exc:
            log.warning(
                "the directory refused an epoch this node's ranks entered",
                extra={"fields": {"job": job_id, "epoch": epoch, "error": str(exc)}},
            )
            self.reports.answered(job_id, epoch, exc)
            return True
        job = self._held_epoch(job)
        if job_id in self.jobs:
            self.jobs[job_id] = job
        self.reports.answered(job_id, epoch, job)
        return True

    def _report_request(self, job_id: str, epoch: int) -> jpb.ReportEpochRequest:
        held = self.jobs.get(job_id)
        return jpb.ReportEpochRequest(
            job_id=job_id,
            epoch=epoch,
            node=self._node_info().name,
            lost_nodes=self.lost(held) if held is not None else (),
        )

    def _held_epoch(self, job: jpb.Job) -> jpb.Job:
        """The directory's copy of a job, at the epoch this node holds when
        that is later (a report not yet told): a job's epoch never goes back
        here. A job created again under its id is taken as it comes."""
        held = self.jobs.get(job.spec.job_id)
        if held is None or held.created_unix != job.created_unix or not held.started:
            return job
        if held.epoch <= job.epoch and job.started:
            return job
        return entered(job, held.epoch)

    async def dataset(self, name: str) -> tuple[pb.DatasetInfo, bytes]:
        """The dataset's record and manifest bytes, from the directory."""
        request = pb.GetDatasetRequest(name=name)
        info = await self._call(lambda stub: stub.GetDataset(request, timeout=CALL_TIMEOUT_SECONDS))

        async def manifest(stub: directory_pb2_grpc.DirectoryStub) -> bytes:
            chunks = stub.GetManifest(request, timeout=10 * CALL_TIMEOUT_SECONDS)
            return b"".join([chunk.data async for chunk in chunks])

        return info, await self._call(manifest)

    async def datasets(self) -> list[pb.DatasetInfo]:
        reply = await self._call(lambda stub: stub.ListDatasets(pb.ListDatasetsRequest(), timeout=CALL_TIMEOUT_SECONDS))
        return list(reply.datasets)

    async def add_dataset(self, request: pb.AddDatasetRequest) -> pb.DatasetInfo:
        # Building a manifest walks the whole root on the PFS: no short deadline.
        return await self._call(lambda stub: stub.AddDataset(request))

    async def drop_dataset(self, name: str) -> None:
        await self._call(lambda stub: stub.DropDataset(pb.DropDatasetRequest(name=name), timeout=CALL_TIMEOUT_SECONDS))

    async def _call(self, call: Callable[[directory_pb2_grpc.DirectoryStub], Awaitable[T]]) -> T:
        """``call(stub)`` on the current replica, then on the next ones while they are unreachable."""
        while True:
            stub = self.stub
            try:
                return await call(stub)
            except asyncio.CancelledError:
                if not closed_under_the_call():
                    raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in UNREACHABLE or not await self._fail_over(stub):
                    raise _relayed(exc) from None

    async def close(self) -> None:
        await self._channel.close()
