"""The gRPC face of the daemon: parse, call a plain handler, map errors to codes
(through :mod:`dataquay.server.servicer_errors`)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from dataquay.client.tiers import CLIENT_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import DataquayError, InvalidRequestError, StandaloneError
from dataquay.server.limits import ByteBudget
from dataquay.server.node.cache.manager import Admitted, CacheManager, Evicted, Holding
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.placements import Placements
from dataquay.server.node.exchange import ExchangeRun, Exchanges
from dataquay.server.node.exchange.coded import CodedProgress
from dataquay.server.node.handoff.forward import ShmForward
from dataquay.server.node.metrics import LiveState
from dataquay.server.node.reads.replies import reply_chunks
from dataquay.server.node.stager import StagingProgress
from dataquay.server.node.users.callers import Caller
from dataquay.server.proto_maps import FORMAT_FROM_PROTO, TIER_TO_PROTO, dataset_info
from dataquay.server.servicer_errors import status_on_error

if TYPE_CHECKING:
    from dataquay.server.node.daemon import Daemon

class CacheServicer(cache_pb2_grpc.CacheServicer):
    """dataquay.v1.Cache over one :class:`Daemon`."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._latency = daemon.metrics.request_seconds

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        d = self.daemon
        return pb.InfoReply(
            node=d.config.node_name,
            version=d.version,
            cache_path=str(d.store.path),
            max_batch=d.config.max_batch,
            cache_capacity=d.store.capacity,
            tcp_address=d.tcp_address,
            pid=d.pid,
            directory=d.config.directory,
            metrics_address=d.metrics_address,
            bulk_address=d.bulk_address,
            pfs_bandwidth=d.config.pfs_bandwidth,
        )

    async def Read(self, request: pb.ReadRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ReadChunk]:
        started = time.perf_counter()
        # uint64 as on the wire: ids past int64 are refused as out of range, not overflowed.
        ids = np.fromiter(request.ids, dtype=np.uint64, count=len(request.ids))
        forward = ShmForward(self.daemon.shm, request.shm_name, request.shm_size) if request.shm_name else None
        async with status_on_error(context):
            caller = self.daemon.access.caller(context)
            await self.daemon.access.check_read(caller, request.dataset)
            if forward is not None and not self.daemon.access.trusted(caller):
                self.daemon.access.check_segment(caller, self.daemon.shm.owner(request.shm_name))
            windows = self.daemon.reads.read(
                request.dataset, ids, request.manifest_id, request.job, request.peer, self._budget(context),
                forward,
                epoch=request.epoch if request.HasField("epoch") else None,
            )
            async with aclosing(windows):
                async for window in windows:
                    offsets: list[int | None] = [None] * len(window.served)
                    if forward is not None:
                        offsets = forward.window(window.served)
                    for chunk in reply_chunks(window, offsets, forward.checked if forward is not None else ()):
                        yield chunk
                    del window  # not held while the next one is resolved
        if forward is not None:
            self.daemon.forwarded_samples += forward.forwarded
            self.daemon.in_place_samples += len(forward.checked)
        self._latency.labels("Read").observe(time.perf_counter() - started)

    def _budget(self, context: grpc.aio.ServicerContext) -> ByteBudget | None:
        """The byte budget the caller's host shares; None for this node's own
        trainers (the unix socket), whose calls are bounded one by one."""
        peer = context.peer() or ""
        if peer.startswith("unix:"):
            return None
        return self.daemon.served_budgets.get(peer.rpartition(":")[0])

    async def AddDataset(self, request: pb.AddDatasetRequest, context: grpc.aio.ServicerContext) -> pb.DatasetInfo:
        async with status_on_error(context):
            caller = self.daemon.access.caller(context)
            entry = await self.daemon.datasets.add(
                request, FORMAT_FROM_PROTO.get(request.format), lambda root: self.daemon.access.check_root(caller, root)
            )
            return self.dataset_info(entry.record.name)

    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDatasetsReply:
        registry = self.daemon.registry
        listed = await self.daemon.datasets.listed()
        if listed is None:
            return pb.ListDatasetsReply(datasets=[self.dataset_info(n) for n in registry.names()])
        held = {n: registry.get(n).record.manifest_id for n in registry.names()}
        return pb.ListDatasetsReply(
            datasets=[self.dataset_info(i.name) if held.get(i.name) == i.manifest_id else i for i in listed]
        )

    async def GetDataset(self, request: pb.GetDatasetRequest, context: grpc.aio.ServicerContext) -> pb.DatasetInfo:
        async with status_on_error(context):
            return self.dataset_info((await self.daemon.datasets.entry(request.name)).record.name)

    async def GetManifest(
        self, request: pb.GetDatasetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ManifestChunk]:
        async with status_on_error(context):
            await self.daemon.access.check_read(self.daemon.access.caller(context), request.name)
            data = (await self.daemon.datasets.entry(request.name)).manifest.data
        step = 4 << 20
        for start in range(0, len(data), step):
            yield pb.ManifestChunk(data=bytes(data[start : start + step]))

    async def DropDataset(
        self, request: pb.DropDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.DropDatasetReply:
        async with status_on_error(context):
            await self.daemon.access.check_drop(self.daemon.access.caller(context), request.name)
            freed = await self.daemon.datasets.drop(request.name)
        return pb.DropDatasetReply(freed_samples=freed)

    async def Stage(
        self, request: pb.StageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StageProgress]:
        d = self.daemon
        async with status_on_error(context):
            caller = d.access.caller(context)
            await d.access.check_read(caller, request.dataset)
            entry = await d.datasets.entry(request.dataset)
            seed, ids, leave_room, for_others = request.seed, None, False, 0
            if request.job:
                await self._link().list_nodes()  # the capacities every node computes the holders with
                placement = await self._placements().placement(request.job, entry, epoch=0)
                seed, ids, leave_room = placement.job.spec.seed, placement.held(), placement.owners_move
                for_others = placement.held_for_others
            admission = None
            if not d.stager.running(request.dataset):
                staged = ids if ids is not None else np.arange(entry.manifest.num_samples, dtype=np.int64)
                admission = await d.cache.admit(entry, staged, *charged(caller), leave_room)
            progress = d.stager.start(request.dataset, seed, ids, leave_room, for_others, admission)
        while True:
            await d.stager.wait(request.dataset, timeout=0.5)
            reply = self._progress(progress)
            yield reply
            # What was sent decides: the run may have ended while it went (a
            # shutdown), and its last word must still reach the caller.
            if reply.finished:
                if request.job and not progress.error:
                    d.reads.read_ahead(placement.job, transfers=False)  # what did not fit, before the ranks come
                return

    def _progress(self, progress: StagingProgress) -> pb.StageProgress:
        return pb.StageProgress(
            dataset=progress.dataset,
            total_samples=progress.total_samples,
            done_samples=progress.done_samples,
            skipped_samples=progress.skipped_samples,
            total_bytes=progress.total_bytes,
            done_bytes=progress.done_bytes,
            read_bytes=progress.read_bytes,
            elapsed_seconds=progress.elapsed,
            finished=progress.finished,
            cache_full=progress.cache_full,
            error=progress.error,
            failed_samples=progress.failed_samples,
            first_failure=progress.first_failure,
            node=self.daemon.config.node_name,
            held_for_others=progress.held_for_others,
            **admission_fields(progress.admission),
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        d = self.daemon
        state = d.live_state()
        return pb.StatsReply(
            node=d.config.node_name,
            reads=[
                pb.TierCount(tier=TIER_TO_PROTO[tier], samples=samples, bytes=nbytes)
                for tier, (samples, nbytes) in d.metrics.tier_totals().items()
            ],
            cache_used_bytes=state.cache_used_bytes,
            cache_capacity_bytes=state.cache_capacity_bytes,
            cache_entries=state.cache_entries,
            pfs_bytes=state.pfs_bytes,
            pfs_errors=state.pfs_errors,
            corrupt_repaired=state.corrupt_repaired,
            cache_full=state.cache_full,
            cache_disk_full=state.cache_disk_full,
            inserts_dropped=state.inserts_dropped,
            read_ahead=read_ahead(state),
            staging=[self._progress(p) for p in d.stager.runs.values()],
            peers=[
                pb.PeerHealth(node=p.node, suspect=p.suspect, failures=p.failures, samples=p.samples, bytes=p.bytes)
                for p in d.peers.health()
            ],
            exchanges=exchanges_progress(d.exchanges) if d.exchanges else [],
            mcast_datagrams_dropped=state.mcast_dropped,
            exchange_received_samples=d.receiver.received_samples if d.receiver else 0,
            exchange_received_bytes=d.receiver.received_bytes if d.receiver else 0,
            values_refused=state.values_refused,
            previous_owner_samples=d.reads.previous_owner_samples,
            prefetched_samples=d.reads.prefetcher.served if d.reads.prefetcher else 0,
            client_reads=[pb.ClientReads(tier=tier, samples=samples, bytes=nbytes)
                          for tier, (samples, nbytes) in sorted(d.client_stats.reads.items())],
            client_data_wait_seconds=d.client_stats.data_wait_seconds,
            clients=d.client_stats.clients,
            prep_groups=state.prep_groups,
            bulk=pb.BulkCounts(
                served_samples=d.bulk.served_samples if d.bulk else 0,
                served_bytes=d.bulk.served_bytes if d.bulk else 0,
                fetched_samples=d.peers.bulk_samples,
                fetched_bytes=d.peers.bulk_bytes,
                refused_connections=d.bulk.refused if d.bulk else 0,
                fallbacks=d.peers.bulk_fallbacks,
                forwarded_samples=d.forwarded_samples,
                in_place_samples=d.in_place_samples,
                segment_reads=d.segment_reads,
                exchange_samples=d.bulk.exchange_samples if d.bulk else 0,
            ),
            cache_behind=state.cache_behind.proto(),
            cache_holdings=[cache_holding(row) for row in d.cache.holdings()],
            cache_charges=cache_charges(d.cache),
        )

    async def JoinJob(self, request: jpb.JoinJobRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        async with status_on_error(context):
            job = await self._link().join_job(request)
        self.daemon.reads.read_ahead(job)
        return job

    async def ReportEpoch(self, request: jpb.ReportEpochRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        async with status_on_error(context):
            relayed = jpb.ReportEpochRequest(
                job_id=request.job_id, epoch=request.epoch, node=self.daemon.config.node_name
            )
            job = await self._link().report_epoch(relayed)
        if self.daemon.exchanges is not None:
            self.daemon.exchanges.epoch_started(request.job_id, request.epoch)
        self.daemon.reads.read_ahead(job)
        return job

    async def ReportClientStats(
        self, request: pb.ClientStatsReport, context: grpc.aio.ServicerContext
    ) -> pb.ClientStatsReply:
        async with status_on_error(context):
            _check_stats_report(request)
        reads = {r.tier: (r.samples, r.bytes) for r in request.reads}
        self.daemon.client_stats.report(request.client, reads, max(0.0, request.data_wait_seconds))
        if self.daemon.exchanges is not None:
            for read in request.positions:
                self.daemon.exchanges.rank_read(read.job, read.epoch, read.rank, read.position)
        return pb.ClientStatsReply()

    async def PrepSync(self, request: pb.PrepSyncRequest, context: grpc.aio.ServicerContext) -> pb.PrepSyncReply:
        async with status_on_error(context):
            _node_local(context, "prep groups are node-local: call through the daemon's unix socket")
            owner = self.daemon.access.prep_owner(self.daemon.access.caller(context))
            return await self.daemon.prep_groups.sync(request, owner)

    async def CacheBehind(
        self, request: pb.CacheBehindRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheBehindReply:
        async with status_on_error(context):
            _node_local(context, "caching behind a trainer is node-local: call through the daemon's unix socket")
            caller = self.daemon.access.caller(context)
            await self.daemon.access.check_read(caller, request.dataset)
            hand_over = not request.handed or self.daemon.access.may_hand_over(caller)
            return await self.daemon.behind.take(request, hand_over=hand_over)

    async def ManageCache(
        self, request: pb.ManageCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ManageCacheReply:
        d = self.daemon
        async with status_on_error(context):
            evicted: tuple[Evicted, ...] = ()
            if request.action != "ls":
                _node_local(context, "the cache is managed on its node: call through the daemon's unix socket")
                d.access.check_operator(d.access.caller(context), f"cache {request.action}")
            if request.action == "evict":
                evicted = await d.cache.evict(request.name, request.dry_run, request.force)
            elif request.action in ("pin", "unpin"):
                d.cache.pin(request.name, request.action == "pin")
            elif request.action != "ls":
                raise InvalidRequestError(f"unknown cache action {request.action!r}; use ls, evict, pin or unpin")
            return pb.ManageCacheReply(
                holdings=[cache_holding(row) for row in d.cache.holdings()],
                evictions=[cache_eviction(e) for e in evicted],
                charges=cache_charges(d.cache),
                capacity_bytes=d.store.capacity,
                used_bytes=d.store.space.live_bytes,
                evict_min_age_seconds=d.cache.min_age,
            )

    async def Exchange(
        self, request_iterator: AsyncIterator[pb.ExchangeMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExchangeReply]:
        async with status_on_error(context):
            if self.daemon.receiver is None:
                raise StandaloneError("this daemon runs without a directory (--directory); exchanges need one")
            async for reply in self.daemon.receiver.receive(request_iterator):
                yield reply

    async def CodedPass(self, request: pb.CodedPassRequest, context: grpc.aio.ServicerContext) -> pb.CodedPassReply:
        async with status_on_error(context):
            if self.daemon.exchanges is None:
                raise StandaloneError("this daemon runs without a directory (--directory); exchanges need one")
            return pb.CodedPassReply(pass_id=await self.daemon.exchanges.pass_id(request.job, request.epoch))

    def _link(self) -> DirectoryLink:
        if self.daemon.link is None:
            raise StandaloneError("this daemon runs without a directory (--directory); jobs need one")
        return self.daemon.link

    def _placements(self) -> Placements:
        if self.daemon.placements is None:
            raise StandaloneError("this daemon runs without a directory (--directory); jobs need one")
        return self.daemon.placements

    def dataset_info(self, name: str) -> pb.DatasetInfo:
        entry = self.daemon.registry.get(name)
        entries, cached_bytes = self.daemon.store.dataset_usage(entry.record.cache_db)
        return dataset_info(entry, entries, cached_bytes)


def charged(caller: Caller) -> tuple[int, frozenset[int]]:
    """Whom a caller's staging is charged to: the user the kernel named, else
    (TCP, or a daemon of one user) the daemon's own user and groups."""
    if caller.uid is not None:
        return caller.uid, caller.gids
    return os.getuid(), frozenset({os.getgid(), *os.getgroups()})


def admission_fields(admission: Admitted | None) -> dict[str, Any]:
    """StageProgress's admission fields."""
    if admission is None:
        return {}
    return {
        "admission_need_bytes": admission.need,
        "admission_fit_bytes": admission.fits,
        "evictions": [cache_eviction(e) for e in admission.evicted],
    }


def cache_eviction(evicted: Evicted) -> pb.CacheEviction:
    return pb.CacheEviction(
        cache_db=evicted.holding.cache_db, datasets=evicted.holding.datasets, bytes=evicted.nbytes,
        whole=evicted.whole,
    )


def cache_holding(row: Holding) -> pb.CacheHolding:
    return pb.CacheHolding(
        cache_db=row.cache_db, datasets=row.datasets, bytes=row.nbytes, samples=row.samples,
        last_use_unix=row.last_use, uid=row.uid, pinned_by=row.pinned_by,
    )


def cache_charges(cache: CacheManager) -> list[pb.CacheCharge]:
    return [pb.CacheCharge(kind=u.kind, id=u.ident, bytes=u.nbytes, quota_bytes=u.quota, quota=u.quota_text)
            for u in cache.users()]


def read_ahead(state: LiveState) -> pb.ReadAhead:
    limit, used, peak = state.prefetch_memory
    counts = state.overflow
    return pb.ReadAhead(
        memory_bytes=limit,
        held_bytes=used,
        peak_bytes=peak,
        overflow_read_samples=counts.read_samples,
        overflow_read_bytes=counts.read_bytes,
        overflow_served_samples=counts.served_samples,
        overflow_served_bytes=counts.served_bytes,
        overflow_wasted_samples=counts.wasted_samples,
        overflow_wasted_bytes=counts.wasted_bytes,
        overflow_failed_samples=counts.failed_samples,
    )


def exchanges_progress(exchanges: Exchanges) -> list[pb.ExchangeProgress]:
    """The latest exchange of each job, a run or a failure before its run began."""
    runs = [exchange_progress(run) for run in exchanges.progress()]
    failed = [pb.ExchangeProgress(job=job, epoch=epoch, finished=True, failed=True, error=f"failed: {reason}")
              for job, epoch, reason in exchanges.failed_early()]
    return sorted([*runs, *failed], key=lambda x: x.job)


def exchange_progress(run: ExchangeRun) -> pb.ExchangeProgress:
    done = run.progress()
    coded = run.coded or CodedProgress()
    return pb.ExchangeProgress(
        job=run.job,
        epoch=run.epoch,
        total_samples=done.total_samples,
        total_bytes=done.total_bytes,
        delivered_samples=done.delivered_samples,
        delivered_bytes=done.delivered_bytes,
        sent_bytes=done.sent_bytes,
        unavailable_samples=done.unavailable_samples,
        refused_samples=done.refused_samples,
        elapsed_seconds=run.elapsed,
        first_delivery_seconds=run.first_delivery,
        finished=run.finished,
        failed=run.failed,
        error=run.error,
        coded_packets_sent=coded.packets_sent,
        coded_bytes_sent=coded.bytes_sent,
        coded_samples_decoded=coded.samples_decoded,
        coded_note=coded.note,
    )


def _check_stats_report(request: pb.ClientStatsReport) -> None:
    """Raises InvalidRequestError for a report the client stats cannot take."""
    if not request.client:
        raise InvalidRequestError("a client stats report must name its client")
    if not math.isfinite(request.data_wait_seconds):
        raise InvalidRequestError(f"data_wait_seconds {request.data_wait_seconds} is not a finite number of seconds")
    unknown = sorted({r.tier for r in request.reads} - set(CLIENT_TIERS))
    if unknown:
        raise InvalidRequestError(f"unknown client tier {unknown[0]!r}; tiers are {', '.join(CLIENT_TIERS)}")


def _node_local(context: grpc.aio.ServicerContext, refusal: str) -> None:
    """Raises DataquayError (FAILED_PRECONDITION) for a call that did not come over the unix socket."""
    if not (context.peer() or "").startswith("unix:"):
        raise DataquayError(refusal)
