"""The directory server: the state machine of :mod:`.state` plus its I/O.

Lifecycle as the daemon's: ``start()`` is idempotent and closes what it
opened if a step fails; ``async with DirectoryServer(...)`` starts and closes;
shutdown is staged: health NOT_SERVING, the server stops accepting and drains
in-flight calls within a grace period while heartbeats and the lease check go
on (a node must not expire for the drain's sake), then background work is
cancelled, heartbeats and HTTP stop and the state is written a last time.

Persistence: a store (:mod:`.store`) holds nodes, jobs and versions: the
embedded one ``directory.json`` under the state dir, the etcd one records in
etcd shared by several directory processes (:mod:`.etcd_store`); the dataset
registry keeps its own files under the state dir. Every change of membership,
jobs or datasets is stored before the call that made it returns. Only the
process the store elects (always the only one, with the embedded store)
drops idle jobs.

Leases, job idle times and the node log's periods count on the monotonic
clock; Unix time is only what people read and what is written (see :mod:`.state`).

Heartbeats arrive as UDP datagrams on the gRPC port's number (see
:mod:`.beats`), or through the Heartbeat RPC.

Jobs idle for ``--job-ttl`` are dropped by a background task, as ``dataquay
job drop`` drops them; operators drop idle jobs sooner with ``dataquay job
prune``, whose drops the directory refuses for a job active since it was listed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.server.auth import ServerCredentials, new_server, server_tls
from dataquay.server.config import DirectoryConfig
from dataquay.server.directory.beats import count_refusal, open_heartbeats
from dataquay.server.directory.etcd_store import EtcdStore
from dataquay.server.directory.listing import NodeListing
from dataquay.server.directory.metrics import directory_metrics
from dataquay.server.directory.records import Change, DatasetFacts, Job, JoinRequest, NodeInfo, Registration, Versions
from dataquay.server.directory.sd_http import HttpEndpoints
from dataquay.server.directory.servicer import DirectoryServicer
from dataquay.server.directory.state import DirectoryState
from dataquay.server.directory.store import DirectoryStore, EmbeddedStore
from dataquay.server.dirs import ensure_private_dir
from dataquay.server.errors import DirectoryUnavailableError, NodeNameTakenError, StartupError
from dataquay.server.lifecycle import ServerLifecycle, write_ready_file
from dataquay.server.listen import bind_tcp
from dataquay.server.manifest_build import allowed_root, build_manifest, check_sample_sizes
from dataquay.server.manifest_versions import built_like
from dataquay.server.registry import Registered, Registry
from dataquay.server.task_group import TaskGroup

log = logging.getLogger("dataquay.directory")

SERVICE_NAME = "dataquay.v1.Directory"
#: The longest time between two looks for jobs idle past the TTL.
JOB_EXPIRY_CHECK_SECONDS = 60.0
#: Ports from the OS tried for one whose UDP twin is free too.
PORT_TRIES = 8
#: Hex digits of a node's identity that logs show: enough to tell two apart.
IDENTITY_SHOWN = 12


class DirectoryServer(ServerLifecycle):
    """The cluster's directory; see the module docstring for its lifecycle."""

    log = log

    def __init__(self, config: DirectoryConfig) -> None:
        super().__init__()
        self.config = config
        self.pid = os.getpid()
        self.state = DirectoryState(config.lease_seconds, config.heartbeat_seconds)
        self.registry = Registry(config.state_dir)
        self.store: DirectoryStore = _store(config, self)
        self.listing = NodeListing(config.heartbeat_seconds)
        self.health = HealthServicer()
        self.credentials = ServerCredentials.from_files(
            config.token_file, config.node_token_file, config.tls_ca, config.tls_cert, config.tls_key
        )
        self.tasks = TaskGroup()
        #: Heartbeats refused, by reason (see :mod:`.beats`).
        self.beats_refused: Counter[str] = Counter()
        self.metrics = directory_metrics(
            lambda: self.state,
            lambda: len(self.registry.names()),
            lambda: self.beats_refused,
            lambda: self.listing.sent,
        )
        self.http = HttpEndpoints(lambda: self.state.nodes(), self.metrics, lambda: self._serving)
        self.tcp_address = ""
        self.http_port = 0
        self._server: grpc.aio.Server | None = None
        self._beats: asyncio.DatagramTransport | None = None
        self._versions: tuple[Versions, dpb.Versions] = (Versions(), dpb.Versions())
        self._started = False
        self._serving = False
        self._builds = asyncio.Semaphore(1)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        try:
            await self._load()
            self.http_port = await self.http.start(self.config.http_host, self.config.http_port)
            await self._start_server()
        except BaseException:
            await self.close()
            raise
        self.tasks.spawn(self._check_leases(), "lease-expiry")
        self.store.start(self.tasks)
        if self.config.job_ttl > 0:
            self.tasks.spawn(self._expire_jobs(), "job-expiry")
        self._serving = True
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        write_ready_file(
            self.config.ready_file, {"pid": self.pid, "tcp": self.tcp_address, "http_port": self.http_port}
        )
        up, down = self.state.node_counts()
        log.info(
            "serving",
            extra={
                "fields": {
                    "tcp": self.tcp_address,
                    "http_port": self.http_port,
                    "state_dir": str(self.config.state_dir),
                    "nodes_up": up,
                    "nodes_down": down,
                    "jobs": len(self.state.jobs()),
                    "datasets": len(self.registry.names()),
                    "job_ttl_seconds": self.config.job_ttl,
                }
            },
        )

    async def _load(self) -> None:
        ensure_private_dir(Path(self.config.state_dir), "state dir")
        self.registry.load()
        self.registry.warn_outside(self.config.dataset_roots)
        self.state = await self.store.open()

    async def _start_server(self) -> None:
        """Binds the gRPC listener and the heartbeats' UDP socket on the same port.

        A port from the OS is free for TCP but may be taken for UDP by another
        process; then another port is tried rather than failing the start."""
        port_from_os = self.config.listen.rpartition(":")[2] == "0"
        host = self.config.listen.rpartition(":")[0]
        for attempt in range(1, PORT_TRIES + 1):
            server = new_server(self.credentials, encoded_replies=frozenset({f"/{SERVICE_NAME}/ListNodes"}))
            directory_pb2_grpc.add_DirectoryServicer_to_server(DirectoryServicer(self), server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            self.tcp_address = bind_tcp(server, self.config.listen, server_tls(self.credentials.user))
            beats_address = f"{host}:{self.tcp_address.rpartition(':')[2]}"
            try:
                self._beats = await open_heartbeats(
                    beats_address,
                    self.datagram_reply,
                    self.credentials.node.token,
                    2 * self.config.lease_seconds,
                    self.beats_refused,
                )
            except OSError as exc:
                await server.stop(None)
                if port_from_os and attempt < PORT_TRIES:
                    continue
                raise StartupError(f"cannot receive heartbeats on UDP {self.tcp_address}: {exc.strerror}") from exc
            self._server = server
            await server.start()
            return

    async def close(self, grace: float = 10.0) -> None:
        """Staged shutdown; safe to call twice and after a failed start."""
        if not self._started:
            return
        self._started = False
        self._serving = False
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        await self.tasks.close()
        if self._beats is not None:
            self._beats.close()
        await self.http.close()
        await self.store.close()

    async def _check_leases(self) -> None:
        """Marks silent nodes down and writes what heartbeats changed."""
        interval = min(1.0, self.config.lease_seconds / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            stalled, last = now - last - interval, now
            if stalled > self.config.lease_seconds / 2:
                self.state.hold_leases(stalled)
                log.warning(
                    "the directory did not run for a while; leases run on from now",
                    extra={"fields": {"seconds": round(stalled, 1)}},
                )
            for name in self.state.expire(now):
                log.info("node down", extra={"fields": {"node": name, "lease_seconds": self.config.lease_seconds}})
            self.store.changed()

    async def _expire_jobs(self) -> None:
        """Drops the jobs idle for --job-ttl, as `job drop` would, and logs each;
        the first look is at start, for jobs that went idle while it was stopped."""
        ttl = self.config.job_ttl
        while True:
            expired = self.state.expire_jobs(ttl, time.monotonic()) if self.store.leader else []
            # Logged as soon as it is so (a listing shows it from here), not
            # after the write: a stop during a slow write must not lose the line.
            for job, idle in expired:
                log.info(
                    "job expired",
                    extra={"fields": {"job": job.spec.job_id, "idle_seconds": round(idle), "job_ttl_seconds": ttl}},
                )
            if expired:
                await self.store.persist()
            await asyncio.sleep(min(JOB_EXPIRY_CHECK_SECONDS, ttl / 4))

    # ------------------------------------------------------------- handlers

    async def register_node(self, info: NodeInfo, identity: str) -> int:
        """Registers the node (see :meth:`DirectoryState.register`); returns
        the session its heartbeats must carry."""
        try:
            registration = self.state.register(info, time.monotonic(), identity, time.time())
        except NodeNameTakenError:
            held = self.state.node(info.name)
            log.warning(
                "refused a live node's name to another identity",
                extra={
                    "fields": {
                        "node": info.name,
                        "tcp": info.tcp_address,
                        "identity": identity[:IDENTITY_SHOWN],
                        "holder_tcp": held.info.tcp_address if held else "",
                        "holder_identity": held.identity[:IDENTITY_SHOWN] if held else "",
                    }
                },
            )
            raise
        _log_registration(info, identity, registration)
        await self.store.persist()
        return registration.session

    def heartbeat_reply(self, request: dpb.HeartbeatRequest) -> dpb.HeartbeatReply:
        """Renews the node's lease; the answer to a beat by RPC. A beat not
        from the name's holder is counted and told the node is unknown, so
        that a daemon whose name was registered again since registers again
        (and learns why if it is refused)."""
        reply = self.datagram_reply(request, None)
        if isinstance(reply, str):
            count_refusal(self.beats_refused, reply, f"rpc {request.name}")
            return dpb.HeartbeatReply(known=False, versions=self.versions_proto())
        return reply

    def datagram_reply(self, request: dpb.HeartbeatRequest, sequence: int | None) -> dpb.HeartbeatReply | str:
        """Renews the node's lease; the answer to a beat, or why it renewed
        nothing (:attr:`~.records.Beat.refused`)."""
        beat = self.state.heartbeat(
            request.name,
            request.cache_used_bytes,
            request.cache_entries,
            time.monotonic(),
            sequence,
            time.time(),
            request.session,
        )
        if beat.refused:
            return beat.refused
        if beat.known:
            self.store.renewed(request.name)
        if beat.came_up:
            log.info("node up", extra={"fields": {"node": request.name}})
            self.store.changed()
        return dpb.HeartbeatReply(known=beat.known, versions=self.versions_proto())

    def versions_proto(self) -> dpb.Versions:
        """The versions as a message, node changes published if due, rebuilt
        only when they changed (heartbeats are hot)."""
        versions = self.state.publish_nodes(time.monotonic())
        if versions is not self._versions[0]:
            self._versions = (
                versions,
                dpb.Versions(nodes=versions.nodes, datasets=versions.datasets, jobs=versions.jobs),
            )
        return self._versions[1]

    def list_nodes(self, since_version: int) -> bytes:
        """The node list, or the changes since ``since_version``, as an encoded
        ListNodesReply (see :mod:`.listing`)."""
        return self.listing.reply(self.state, since_version, self.versions_proto(), time.monotonic())

    async def add_dataset(self, name: str, root: str, fmt: str | None, replace: bool, tar_grouped: bool) -> Registered:
        """Builds the manifest of ``root`` off the loop and registers it as
        ``name``, if ``root`` lies under the directory's --dataset-roots."""
        root = allowed_root(root, self.config.dataset_roots, "--dataset-roots / DATAQUAY_DIRECTORY_DATASET_ROOTS")
        self.registry.check_free(name, replace)
        earlier = self.registry.get(name).manifest if name in self.registry.names() else None
        async with self._builds:
            writer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: built_like(earlier, build_manifest(root, fmt, tar_grouped=tar_grouped))
            )
            check_sample_sizes(writer, name, self.config.max_sample_size, "the directory's --max-sample-size")
            entry, previous = self.registry.add(name, writer, replace)
            self.state.datasets_changed()
            try:
                await self.store.dataset_added(entry)
            except DirectoryUnavailableError:
                # The store keeps the registration it had: so does this registry.
                if previous is None:
                    self.registry.drop(name)
                else:
                    self.registry.add(name, bytes(previous.manifest.data), replace=True)
                raise
        log.info(
            "dataset registered",
            extra={
                "fields": {
                    "dataset": name,
                    "samples": entry.manifest.num_samples,
                    "format": entry.record.format,
                    "manifest_id": entry.record.manifest_id,
                }
            },
        )
        return entry

    async def drop_dataset(self, name: str) -> None:
        """Drops the dataset from the registry, then from the store (put back
        if the store fails). The version daemons follow moves with the
        registry, never ahead of it: a beat that carries the new version while
        the store writes would otherwise send a daemon to a listing that still
        holds the dataset, and it would keep its copy for good."""
        entry = self.registry.get(name)
        self.registry.drop(name)
        self.state.datasets_changed()
        try:
            await self.store.dataset_dropped(name)
        except DirectoryUnavailableError:
            self.registry.add(name, bytes(entry.manifest.data), replace=False)
            self.state.datasets_changed()
            raise
        log.info("dataset dropped", extra={"fields": {"dataset": name}})

    async def join_job(self, request: JoinRequest) -> Job:
        job, created = self.state.join(request, self._dataset_facts, time.monotonic(), time.time())
        if created:
            spec = job.spec
            log.info(
                "job created",
                extra={
                    "fields": {
                        "job": spec.job_id,
                        "dataset": spec.dataset,
                        "mode": spec.mode,
                        "q": spec.q,
                        "seed": spec.seed,
                        "nodes": len(spec.nodes),
                    }
                },
            )
        await self.store.persist()
        # A shared store may hold another replica's record, created at the same moment.
        return self.state.get_job(job.spec.job_id)

    def _dataset_facts(self, name: str) -> DatasetFacts:
        entry = self.registry.get(name)
        return DatasetFacts(entry.record.manifest_id, entry.manifest.num_samples)

    async def drop_job(self, job_id: str, min_idle: float = 0.0) -> None:
        """Drops the job; with ``min_idle`` above 0, only if it has been idle
        that long (JobActiveError otherwise)."""
        now = time.monotonic()
        if min_idle:
            job = self.state.drop_idle_job(job_id, min_idle, now)
        else:
            job = self.state.drop_job(job_id)
        await self.store.persist()
        idle = round(time.time() - job.last_active)  # as `job ls` shows it
        log.info("job dropped", extra={"fields": {"job": job_id, "idle_seconds": idle}})

    async def report_epoch(self, job_id: str, epoch: int, node: str, lost: Sequence[str] = ()) -> Job:
        before = self.state.get_job(job_id)
        job = self.state.report_epoch(job_id, epoch, time.monotonic(), time.time(), lost)
        if job.epoch > before.epoch or job.absences != before.absences:
            await self.store.persist()
        if job.epoch > before.epoch:
            log.info("job epoch", extra={"fields": {"job": job_id, "epoch": job.epoch, "node": node}})
        if job.absences != before.absences:
            log.info(
                "the nodes absent from a job's holders changed",
                extra={"fields": {"job": job_id, "absences": [asdict(a) for a in job.absences], "reported_by": node}},
            )
        return job


def _log_registration(info: NodeInfo, identity: str, registration: Registration) -> None:
    """Logs what a registration changed: a node that joined or came back, a
    name that passed to a new identity, a node that moved."""
    fields = {"node": info.name, "tcp": info.tcp_address, "metrics": info.metrics_address}
    if registration.change is Change.JOINED:
        log.info("node registered", extra={"fields": fields})
    elif registration.change is Change.UP:
        log.info("node up", extra={"fields": fields})
    previous, previous_identity = registration.previous, registration.previous_identity
    if previous is not None and previous_identity and previous_identity != identity:
        log.warning(
            "a node name passed to another identity after its holder's lease ended",
            extra={
                "fields": {
                    **fields,
                    "identity": identity[:IDENTITY_SHOWN],
                    "previous_tcp": previous.tcp_address,
                    "previous_identity": previous_identity[:IDENTITY_SHOWN],
                }
            },
        )
    elif registration.change is Change.RENEWED and previous and previous.tcp_address != info.tcp_address:
        log.info(
            "node registered again from another address",
            extra={"fields": {**fields, "previous_tcp": previous.tcp_address}},
        )


def _store(config: DirectoryConfig, server: DirectoryServer) -> DirectoryStore:
    """The store ``--store`` names, following ``server``'s state and registry."""
    if config.store == "embedded":
        return EmbeddedStore(config, lambda: server.state)
    return EtcdStore(config, lambda: server.state, server.registry)


async def serve_directory(config: DirectoryConfig) -> None:
    """Runs the directory until SIGTERM or SIGINT."""
    async with DirectoryServer(config) as server:
        await server.serve_until_stopped()
