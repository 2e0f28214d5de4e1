"""The node daemon: owns the cache, the PFS readers, staging and the gRPC server.

Lifecycle (after uvicorn and dask's Server): ``start()`` is idempotent and, if
any step fails, closes what it opened and raises with the cause chained;
``async with Daemon(...)`` starts and closes. Shutdown is staged: health goes
NOT_SERVING and staging stops (it resumes when asked again); the server stops
accepting and lets in-flight calls finish within a grace period, with every
background task still running for them (reads wait on prefetches and dataset
fetches, incoming exchanges on the cache writer); then the background work is
cancelled, the writes still queued are committed, the writer is stopped and
the environment synced and closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
from pathlib import Path

import grpc
import numpy.ma  # noqa: F401  np.unique imports it at first use (tens of ms): at start, not mid-exchange
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from dataquay.client.wire.memfd import fd_socket_path
from dataquay.client.wire.records import CHECKSUM_BYTES
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server import __version__
from dataquay.server.auth import ServerCredentials, new_server, server_tls
from dataquay.server.config import MULTICAST_POOL, DaemonConfig
from dataquay.server.dirs import share_with_group
from dataquay.server.errors import DataquayError, NodeNameTakenError, StartupError
from dataquay.server.http_server import HttpServer, metrics_handler
from dataquay.server.lifecycle import ServerLifecycle, write_ready_file
from dataquay.server.limits import SERVED_BYTES_PER_PEER, ByteBudgets
from dataquay.server.listen import (
    SocketIdentity,
    advertised_host,
    bind_tcp,
    claim_socket_path,
    group_entry_problem,
    remove_own_socket,
    socket_identity,
)
from dataquay.server.node.cache.file import DATA_FILE, LMDB_LOCK_FILE
from dataquay.server.node.cache.manager import STAGING, CacheManager
from dataquay.server.node.cache.store import Store
from dataquay.server.node.client_stats import ClientStatsBook
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.identity import node_identity
from dataquay.server.node.cluster.placements import Placements
from dataquay.server.node.counters import FaceCounters
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.exchange import ExchangeBroker, ExchangeReceiver, Exchanges
from dataquay.server.node.exchange.mcast import multicast_channel
from dataquay.server.node.handoff.batch_reads import SegmentReads
from dataquay.server.node.handoff.fd_socket import SegmentSocket
from dataquay.server.node.handoff.segments import ShmSegments
from dataquay.server.node.healer import Healer
from dataquay.server.node.metrics import DaemonMetrics
from dataquay.server.node.peers.bulk.client import BulkClient
from dataquay.server.node.peers.bulk.server import BulkServer
from dataquay.server.node.peers.bulk.tls import BulkTls
from dataquay.server.node.peers.reads import Peers
from dataquay.server.node.prep.groups import PrepGroups
from dataquay.server.node.reads.behind import CacheBehind
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.node.reads.service import ReadService
from dataquay.server.node.servicer import CacheServicer
from dataquay.server.node.snapshot import NodeState
from dataquay.server.node.stager import Stager
from dataquay.server.node.users.access import CallerCheck, UserAccess
from dataquay.server.quotas import parse_quotas
from dataquay.server.registry import Registry, cache_db_name
from dataquay.server.task_group import TaskGroup

log = logging.getLogger("dataquay.daemon")

SERVICE_NAME = "dataquay.v1.Cache"
#: How long a start waits for the directory to answer the first registration.
FIRST_REGISTRATION_WAIT_SECONDS = 3.0


class Daemon(ServerLifecycle):
    """One node's daemon; see the module docstring for its lifecycle."""

    log = log

    def __init__(self, config: DaemonConfig) -> None:
        super().__init__()
        self.config = config
        self.version = __version__
        self.pid = os.getpid()
        self.store = Store(config.cache_dir, config.cache_size)
        self.registry = Registry(config.state_dir)
        self.pfs = PfsPool(config.pfs_threads, config.pfs_bandwidth, config.pfs_read_timeout)
        self.metrics = DaemonMetrics()
        self.credentials = ServerCredentials.from_files(
            config.token_file, config.node_token_file, config.tls_ca, config.tls_cert, config.tls_key
        )
        self.link = (
            DirectoryLink(
                config.directory,
                self.node_info,
                self._usage,
                self._datasets_changed,
                self.credentials.node,
                refused=self._name_refused,
            )
            if config.directory
            else None
        )
        self.tasks = TaskGroup()
        # The writer and the syncer outlive the other background tasks: what
        # those queued is committed before the writer stops.
        self.store_tasks = TaskGroup()
        self.datasets = Datasets(
            self.registry, self.store, self.tasks, self.link, config.dataset_roots, config.max_sample_size
        )
        tls = BulkTls.from_files(config.tls_ca, config.tls_cert, config.tls_key)
        node = self.credentials.node
        self.peers = Peers(config.peer_timeout, node, BulkClient(node.token, tls.client))
        self.placements: Placements | None = None
        self.healer: Healer | None = None
        if self.link is not None:
            self.placements = Placements(self.link, config.node_name, config.state_dir)
            self.healer = Healer(
                config.node_name,
                self.link,
                self.placements,
                self.datasets,
                self.store,
                self.pfs,
                self.peers,
                config.heal_after,
                config.heal_bandwidth,
            )
            self.placements.lost = self.link.lost = self.healer.lost
        self.reads = ReadService(
            self.datasets,
            self.store,
            self.pfs,
            self.metrics,
            config.max_batch,
            self.peers,
            self.placements,
            self.tasks.spawn,
            config.prefetch_memory,
            config.max_sample_size,
        )
        self.stager = Stager(self.registry, self.store, self.pfs)
        self.cache = CacheManager(
            self.store,
            self.registry,
            config.state_dir,
            config.evict_min_age,
            parse_quotas(config.cache_quotas),
            self._job_pins,
            self._staging_left,
            functools.partial(self.placements.kept_for, registry=self.registry) if self.placements else None,
        )
        self.reads.used = self.cache.used
        self.exchanges: Exchanges | None = None
        self.receiver: ExchangeReceiver | None = None
        if self.link is not None and self.placements is not None:
            broker = ExchangeBroker()
            self.receiver = ExchangeReceiver(self.store, self.datasets, self.placements, broker, self.cache)
            self.exchanges = Exchanges(
                config.node_name,
                self.store,
                self.datasets,
                self.placements,
                self.link,
                self.peers,
                self.receiver,
                broker,
                self.tasks.spawn,
                config.exchange_bandwidth,
                config.spare_copies_fill,
                multicast_channel(config.exchange_multicast, config.exchange_multicast_interface, MULTICAST_POOL),
                self.credentials.node.token,
            )
        self.bulk: BulkServer | None = None
        if config.bulk_listen != "off":
            self.bulk = BulkServer(
                self.credentials.node.token,
                tls.server,
                self.reads.cache_db,
                self.store,
                self.metrics.count_peer_served,
                self.receiver.receive if self.receiver is not None else None,
                config.max_sample_size + CHECKSUM_BYTES,
                resolve_now=self.reads.cache_db_now,
                coming=(self.reads.peer_answers.may_bring, self.reads.read_coming),
            )
        self.bulk_address = ""
        self.counters = FaceCounters()
        self.shm = ShmSegments()
        self.segment_socket: SegmentSocket | None = None
        self.behind = CacheBehind(self.datasets, self.store, self.pfs, self.shm, config.max_sample_size)
        self.access = UserAccess(
            config.users == "apart",
            self.datasets,
            config.shared_datasets,
            self.metrics.count_user_refusal,
            self.credentials.node.token,
        )
        self.prep_groups = PrepGroups(self.pid, config.prep_groups_per_user)
        #: What the Reads of each remote host hold at once (see ReadService.read).
        self.served_budgets = ByteBudgets(SERVED_BYTES_PER_PEER)
        self.client_stats = ClientStatsBook()
        self.state = NodeState(
            store=self.store,
            pfs=self.pfs,
            stager=self.stager,
            peers=self.peers,
            reads=self.reads,
            served=self.metrics.tier_totals,
            client_stats=self.client_stats,
            prep_groups=self.prep_groups,
            behind=self.behind,
            counters=self.counters,
            exchanges=self.exchanges,
            receiver=self.receiver,
            bulk=self.bulk,
            cache=self.cache,
            healer=self.healer,
        )
        self.metrics.export_state(self.state.snapshot)
        self.health = HealthServicer()
        self.tcp_address = ""
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_http = HttpServer({"/metrics": metrics_handler(self.metrics.registry)}, "metrics")
        self._started = False
        #: Why the daemon stopped on its own (the directory refused its name); raised by :func:`serve`.
        self.fatal: DataquayError | None = None
        #: The socket this daemon bound, the only one its close may remove.
        self._socket_identity: SocketIdentity | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        try:
            self.store.open()
            if self.link is not None:
                self.link.identity_key = node_identity(self.store.path)
            self.registry.load()
            self.registry.warn_outside(self.config.dataset_roots)
            self.cache.load()
            for name in self.registry.names():
                await self.store.open_dataset(self.registry.get(name).record.cache_db)
            self.metrics_port = await self._metrics_http.start(self.config.metrics_host, self.config.metrics_port)
            await self._start_server()
            self._start_bulk()
        except BaseException:
            await self.close()
            raise
        self.store_tasks.spawn(self.store.run_writer(), "cache-writer")
        self.store_tasks.spawn(self.store.run_syncer(), "cache-syncer")
        self.tasks.spawn(self._reap_segments(), "shm-reaper")
        self.tasks.spawn(self.cache.run_saver(), "cache-uses-saver")
        self.tasks.spawn(self._reap_prep_groups(), "prep-group-reaper")
        if self.exchanges is not None:
            self.exchanges.check_multicast()
        if self.link is not None:
            self.tasks.spawn(self.link.run(), "directory-link")
            self.tasks.spawn(self.link.send_reports(), "epoch-reports")
            self.tasks.spawn(self._resume_exchanges(), "exchange-resume")
            if self.healer is not None:
                self.tasks.spawn(self.healer.run(), "healer")
            await self._first_registration()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        write_ready_file(
            self.config.ready_file,
            {
                "pid": self.pid,
                "node": self.config.node_name,
                "socket": str(self.config.socket),
                "tcp": self.tcp_address,
                "bulk": self.bulk_address,
                "metrics_port": self.metrics_port,
                "metrics_address": self.metrics_address,
                "cache_dir": str(self.store.path),
                "directory": self.config.directory,
            },
        )
        log.info(
            "serving",
            extra={
                "fields": {
                    "node": self.config.node_name,
                    "socket": str(self.config.socket),
                    "tcp": self.tcp_address,
                    "metrics_port": self.metrics_port,
                    "metrics_address": self.metrics_address,
                    "cache_dir": str(self.store.path),
                    "capacity_bytes": self.store.capacity,
                }
            },
        )

    async def _start_server(self) -> None:
        checks = (CallerCheck(self.access),) if self.access.apart else ()
        server = new_server(self.credentials, self.config.max_calls_per_peer, checks=checks)
        cache_pb2_grpc.add_CacheServicer_to_server(self._servicer(), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self._server = server
        sock = Path(self.config.socket)
        claim_socket_path(sock, self.config.socket_group)
        if self.config.socket_group and (problem := group_entry_problem(sock.parent, self.config.socket_group)):
            log.warning("the socket group cannot reach the socket", extra={"fields": {"reason": problem}})
        try:
            bound = server.add_insecure_port(f"unix:{sock}")
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on socket {sock}: {exc}") from exc
        if not bound:
            raise StartupError(f"cannot listen on socket {sock}")
        self._socket_identity = socket_identity(sock)
        self.tcp_address = bind_tcp(server, self.config.listen, server_tls(self.credentials.user))
        self._open_segment_socket(sock)  # before the first Read can name a segment
        await server.start()
        os.chmod(sock, 0o660)
        if self.config.socket_group:
            try:
                shutil.chown(sock, group=self.config.socket_group)
            except (LookupError, OSError) as exc:
                raise StartupError(f"cannot give socket {sock} to group {self.config.socket_group!r}: {exc}") from exc
        self._share_cache()

    def _share_cache(self) -> None:
        """Gives the cache to the socket's group when every caller is trusted as
        the daemon's own user: its trainers then read local hits from the map
        in their own processes, as the daemon's user does (an LMDB reader takes
        a slot in the lock file, which the group may therefore write). Callers
        told apart keep out of the map: it holds every user's samples."""
        apart = self.access.apart
        group = "" if apart else self.config.socket_group
        try:
            writable = () if apart else (LMDB_LOCK_FILE,)
            problem = share_with_group(self.store.path, (DATA_FILE, LMDB_LOCK_FILE), writable, group)
        except (LookupError, OSError) as exc:
            problem = f"cannot give the cache to group {group!r}: {exc}"
        if problem and group:
            log.warning(
                "the socket's group reads every sample through the daemon",
                extra={"fields": {"cache_dir": str(self.store.path), "reason": problem}},
            )

    def _open_segment_socket(self, sock: Path) -> None:
        """Takes sealed memfd segments next to ``sock`` where this kernel can
        seal them; clients use /dev/shm segments where it cannot or where the
        fd socket cannot be made (a path too long). A path taken by something
        else, or a group the socket cannot be given to, fails the start as
        for ``sock`` itself. A daemon that keeps its users apart opens it
        even where it maps no memfd: its callers' tickets come from there."""
        if self.shm.memfd_problem is not None and not self.access.apart:
            log.info(
                "clients hand over payloads through /dev/shm", extra={"fields": {"reason": self.shm.memfd_problem}}
            )
            return
        segment_socket = SegmentSocket(
            Path(fd_socket_path(str(sock))),
            self.shm,
            self.credentials.user.token,
            SegmentReads(self.shm, self.access, self.reads, self.counters, self.metrics.request_seconds),
            self.tasks.spawn,
            self.access.tickets,
        )
        try:
            segment_socket.open(self.config.socket_group)
        except OSError as exc:
            log.warning(
                "no fd socket; clients hand over payloads through /dev/shm",
                extra={"fields": {"path": str(segment_socket.path), "error": str(exc)}},
            )
            return
        self.segment_socket = segment_socket

    def _servicer(self) -> CacheServicer:
        return CacheServicer(
            node_name=self.config.node_name,
            info=self._info,
            state=self.state.snapshot,
            latency=self.metrics.request_seconds,
            counters=self.counters,
            access=self.access,
            shm=self.shm,
            reads=self.reads,
            served_budgets=self.served_budgets,
            registry=self.registry,
            store=self.store,
            datasets=self.datasets,
            stager=self.stager,
            client_stats=self.client_stats,
            prep_groups=self.prep_groups,
            behind=self.behind,
            link=self.link,
            placements=self.placements,
            exchanges=self.exchanges,
            receiver=self.receiver,
            cache=self.cache,
        )

    def _info(self) -> pb.InfoReply:
        """What Info answers: this daemon, its addresses and limits."""
        return pb.InfoReply(
            node=self.config.node_name,
            version=self.version,
            cache_path=str(self.store.path),
            max_batch=self.config.max_batch,
            cache_capacity=self.store.capacity,
            tcp_address=self.tcp_address,
            pid=self.pid,
            directory=self.config.directory,
            metrics_address=self.metrics_address,
            bulk_address=self.bulk_address,
            pfs_bandwidth=self.config.pfs_bandwidth,
        )

    def _start_bulk(self) -> None:
        if self.bulk is None:
            return
        listen = self.config.bulk_listen or f"{self.config.listen.rpartition(':')[0]}:0"
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise StartupError(f"bad --bulk-listen {listen}: expected HOST:PORT or 'off'")
        try:
            bound = self.bulk.bind(host.strip("[]") or "0.0.0.0", int(port))
        except OSError as exc:
            raise StartupError(f"cannot listen for bulk data on {listen}: {exc.strerror}") from exc
        self.bulk_address = f"{advertised_host(host)}:{bound}"
        self.tasks.spawn(self.bulk.serve(), "bulk-listener")

    def _job_pins(self) -> dict[str, list[str]]:
        """The live jobs on this node by the cache sub-database of the dataset
        version each reads (as the directory lists them), and the runs staging now."""
        pins: dict[str, list[str]] = {}
        for name, run in self.stager.runs.items():
            if not run.finished and name in self.registry.names():
                pins.setdefault(self.registry.get(name).record.cache_db, []).append(STAGING)
        for job in self.link.jobs.values() if self.link is not None else ():
            if job.spec.nodes and self.config.node_name not in job.spec.nodes:
                continue
            if job.spec.dataset not in self.registry.names():
                continue
            record = self.registry.get(job.spec.dataset).record
            db = (
                record.cache_db
                if record.manifest_id == job.manifest_id
                else cache_db_name(job.spec.dataset, job.manifest_id)
            )
            pins.setdefault(db, []).append(job.spec.job_id)
        return pins

    def _staging_left(self) -> dict[str, float]:
        """The fraction of what it reads that each staging run under way has
        still to cache (what it found cached counted out), by the cache
        sub-database it fills."""
        left = {}
        for name, p in self.stager.runs.items():
            to_read = p.total_bytes - p.skipped_bytes
            if not p.finished and to_read > 0 and name in self.registry.names():
                left[self.registry.get(name).record.cache_db] = max(0.0, 1 - (p.done_bytes - p.skipped_bytes) / to_read)
        return left

    async def close(self, grace: float = 10.0) -> None:
        """Staged shutdown; safe to call twice and after a failed start."""
        if not self._started:
            return
        self._started = False
        await self.health.enter_graceful_shutdown()
        await self.stager.close()
        if self.receiver is not None:
            self.receiver.close()
        if self._server is not None:
            await self._server.stop(grace)
        await self.tasks.close()
        if self.bulk is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.bulk.close)
        if self.store.is_open:
            self.cache.save()
            await self._commit_queued()
        await self.store_tasks.close()
        if self.store.is_open:
            # Its sync writes back the last seconds' commits: off the loop, which has more to close.
            await asyncio.get_running_loop().run_in_executor(None, self.store.close)
        await self.peers.close()
        if self.link is not None:
            await self.link.close()
        self.pfs.close()
        if self.segment_socket is not None:
            self.segment_socket.close()
        self.shm.close()
        self.prep_groups.close()
        await self._metrics_http.close()
        remove_own_socket(Path(self.config.socket), self._socket_identity)

    async def _resume_exchanges(self) -> None:
        """After a restart, redo this node's part of the current exchanges
        (of jobs whose trainers began an epoch: the first exchange waits for them)."""
        assert self.link is not None and self.exchanges is not None
        await self.link.registered.wait()
        name = self.config.node_name
        self.exchanges.resume(
            [
                (job_id, int(job.epoch))
                for job_id, job in self.link.jobs.items()
                if job.started and name in job.spec.nodes
            ]
        )

    async def _reap_segments(self, interval: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.shm.reap()

    async def _reap_prep_groups(self, interval: float = 1.0) -> None:
        """Drops prep group members that died or went silent while no other member calls."""
        while True:
            await asyncio.sleep(interval)
            self.prep_groups.reap()

    async def _commit_queued(self, timeout: float = 30.0) -> None:
        """Waits for the writer to commit what is queued; nothing queues more by now."""
        try:
            await asyncio.wait_for(self.store.flush(), timeout)
        except TimeoutError:
            log.warning("dropped queued cache writes at shutdown")

    # ------------------------------------------------------------- cluster

    async def _first_registration(self) -> None:
        """Waits a moment for the directory's answer to this node's first
        registration, so that a name it refuses ends the start with its
        reason, before the daemon reports itself ready; a directory that is
        slow or away is waited for in the background instead."""
        assert self.link is not None
        try:
            await asyncio.wait_for(self.link.first_attempt.wait(), FIRST_REGISTRATION_WAIT_SECONDS)
        except TimeoutError:
            return
        if self.fatal is not None:
            await self.close()
            raise self.fatal

    def _name_refused(self, exc: NodeNameTakenError) -> None:
        """The directory refused this node's name to this daemon: stop, and
        let :func:`serve` end with the directory's reason."""
        self.fatal = exc
        self.request_stop()

    @property
    def metrics_address(self) -> str:
        return f"{advertised_host(self.config.metrics_host)}:{self.metrics_port}"

    def node_info(self) -> jpb.NodeInfo:
        """This node as the directory lists it."""
        return jpb.NodeInfo(
            name=self.config.node_name,
            tcp_address=self.tcp_address,
            bulk_address=self.bulk_address,
            metrics_address=self.metrics_address,
            cache_capacity=self.store.capacity,
            pid=self.pid,
            version=self.version,
        )

    def _usage(self) -> tuple[int, int]:
        return self.store.usage() if self.store.is_open else (0, 0)

    async def _datasets_changed(self) -> None:
        await self.datasets.sync()


async def serve(config: DaemonConfig) -> None:
    """Runs a daemon until SIGTERM or SIGINT."""
    async with Daemon(config) as daemon:
        await daemon.serve_until_stopped()
    if daemon.fatal is not None:
        raise daemon.fatal
