"""The gRPC face of the daemon: parse, call a plain handler, map errors to codes
(through :mod:`dataquay.server.servicer_errors`)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from dataquay.client.wire.tiers import CLIENT_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import DataquayError, InvalidRequestError, StandaloneError
from dataquay.server.node.cache.manager import Admitted, CacheManager, Evicted, Holding, UserUse
from dataquay.server.node.handoff.forward import ShmForward
from dataquay.server.node.peers.reads import listed_peers
from dataquay.server.node.reads.replies import reply_chunks
from dataquay.server.node.stager import staging_order
from dataquay.server.node.users.callers import Caller
from dataquay.server.proto_maps import FORMAT_FROM_PROTO, TIER_TO_PROTO, dataset_info
from dataquay.server.servicer_errors import status_on_error

if TYPE_CHECKING:
    from prometheus_client import Histogram

    from dataquay.server.limits import ByteBudget, ByteBudgets
    from dataquay.server.node.cache.store import Store
    from dataquay.server.node.client_stats import ClientStatsBook
    from dataquay.server.node.cluster.directory_link import DirectoryLink
    from dataquay.server.node.cluster.placements import Placements
    from dataquay.server.node.counters import FaceCounters
    from dataquay.server.node.datasets import Datasets
    from dataquay.server.node.exchange import ExchangeReceiver, Exchanges
    from dataquay.server.node.handoff.segments import ShmSegments
    from dataquay.server.node.prep.groups import PrepGroups
    from dataquay.server.node.reads.behind import CacheBehind
    from dataquay.server.node.reads.service import ReadService
    from dataquay.server.node.snapshot import LiveState
    from dataquay.server.node.stager import Stager, StagingProgress
    from dataquay.server.node.users.access import UserAccess
    from dataquay.server.registry import Registry

#: Peers a Stats reply names (every troubled one besides): see :func:`listed_peers`.
LISTED_PEERS = 32


class CacheServicer(cache_pb2_grpc.CacheServicer):
    """dataquay.v1.Cache over the parts of one daemon, each handed in by the
    daemon that built them (the cluster's are None on a daemon without a directory).

    Args:
        node_name: this node.
        info: what Info answers (addresses are known once the daemon listens).
        state: the daemon's snapshot, which Stats answers from.
        latency: the histogram of request times, by method.
        counters: what the faces count, bumped as Reads hand payloads into segments.
        served_budgets: what the Reads of each remote host hold at once.
    """

    def __init__(
        self,
        *,
        node_name: str,
        info: Callable[[], pb.InfoReply],
        state: Callable[[], LiveState],
        latency: Histogram,
        counters: FaceCounters,
        access: UserAccess,
        shm: ShmSegments,
        reads: ReadService,
        served_budgets: ByteBudgets,
        registry: Registry,
        store: Store,
        datasets: Datasets,
        stager: Stager,
        client_stats: ClientStatsBook,
        prep_groups: PrepGroups,
        behind: CacheBehind,
        link: DirectoryLink | None,
        placements: Placements | None,
        exchanges: Exchanges | None,
        receiver: ExchangeReceiver | None,
        cache: CacheManager,
    ) -> None:
        self.node_name = node_name
        self._info = info
        self._state = state
        self._latency = latency
        self.counters = counters
        self.access = access
        self.shm = shm
        self.reads = reads
        self.served_budgets = served_budgets
        self.registry = registry
        self.store = store
        self.datasets = datasets
        self.stager = stager
        self.client_stats = client_stats
        self.prep_groups = prep_groups
        self.behind = behind
        self.link = link
        self.placements = placements
        self.exchanges = exchanges
        self.receiver = receiver
        self.cache = cache

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        return self._info()

    async def Read(self, request: pb.ReadRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ReadChunk]:
        started = time.perf_counter()
        # uint64 as on the wire: ids past int64 are refused as out of range, not overflowed.
        ids = np.fromiter(request.ids, dtype=np.uint64, count=len(request.ids))
        forward = ShmForward(self.shm, request.shm_name, request.shm_size) if request.shm_name else None
        async with status_on_error(context):
            caller = self.access.caller(context)
            await self.access.check_read(caller, request.dataset)
            if forward is not None and not self.access.trusted(caller):
                self.access.check_segment(caller, self.shm.owner(request.shm_name))
            windows = self.reads.read(
                request.dataset,
                ids,
                request.manifest_id,
                request.job,
                request.peer,
                self._budget(context),
                forward,
                epoch=request.epoch if request.HasField("epoch") else None,
            )
            async with aclosing(windows):
                async for window in windows:
                    offsets: list[int | None] = [None] * len(window.served)
                    if forward is not None:
                        offsets = forward.window(window.served)
                    for chunk in reply_chunks(window, offsets, forward.trusted(window.served) if forward else ()):
                        yield chunk
                    del window  # not held while the next one is resolved
        if forward is not None:
            self.counters.forwarded(forward.forwarded, len(forward.checked))
        self._latency.labels("Read").observe(time.perf_counter() - started)

    def _budget(self, context: grpc.aio.ServicerContext) -> ByteBudget | None:
        """The byte budget the caller's host shares; None for this node's own
        trainers (the unix socket), whose calls are bounded one by one."""
        peer = context.peer() or ""
        if peer.startswith("unix:"):
            return None
        return self.served_budgets.get(peer.rpartition(":")[0])

    async def AddDataset(self, request: pb.AddDatasetRequest, context: grpc.aio.ServicerContext) -> pb.DatasetInfo:
        async with status_on_error(context):
            caller = self.access.caller(context)
            entry = await self.datasets.add(
                request, FORMAT_FROM_PROTO.get(request.format), lambda root: self.access.check_root(caller, root)
            )
            return self.dataset_info(entry.record.name)

    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDatasetsReply:
        registry = self.registry
        listed = await self.datasets.listed()
        if listed is None:
            return pb.ListDatasetsReply(datasets=[self.dataset_info(n) for n in registry.names()])
        held = {n: registry.get(n).record.manifest_id for n in registry.names()}
        return pb.ListDatasetsReply(
            datasets=[self.dataset_info(i.name) if held.get(i.name) == i.manifest_id else i for i in listed]
        )

    async def GetDataset(self, request: pb.GetDatasetRequest, context: grpc.aio.ServicerContext) -> pb.DatasetInfo:
        async with status_on_error(context):
            return self.dataset_info((await self.datasets.entry(request.name)).record.name)

    async def GetManifest(
        self, request: pb.GetDatasetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ManifestChunk]:
        async with status_on_error(context):
            await self.access.check_read(self.access.caller(context), request.name)
            data = (await self.datasets.entry(request.name)).manifest.data
        step = 4 << 20
        for start in range(0, len(data), step):
            yield pb.ManifestChunk(data=bytes(data[start : start + step]))

    async def DropDataset(
        self, request: pb.DropDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.DropDatasetReply:
        async with status_on_error(context):
            await self.access.check_drop(self.access.caller(context), request.name)
            freed = await self.datasets.drop(request.name)
        return pb.DropDatasetReply(freed_samples=freed)

    async def Stage(
        self, request: pb.StageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StageProgress]:
        async with status_on_error(context):
            caller = self.access.caller(context)
            await self.access.check_read(caller, request.dataset)
            entry = await self.datasets.entry(request.dataset)
            seed, ids, leave_room, for_others = request.seed, None, False, 0
            if request.job:
                await self._link().list_nodes()  # the capacities every node computes the holders with
                placement = await self._placements().placement(request.job, entry, epoch=0)
                seed, ids, leave_room = placement.job.spec.seed, placement.held(), placement.owners_move
                for_others = placement.held_for_others
            admission = None
            position = np.empty(0, dtype=np.int64)  # a run going keeps its own order
            if not self.stager.running(request.dataset):
                staged = ids if ids is not None else np.arange(entry.manifest.num_samples, dtype=np.int64)
                admission = await self.cache.admit(entry, staged, *charged(caller), leave_room)
                position = await staging_order(entry, placement if request.job else None, seed)
            progress = self.stager.start(request.dataset, position, ids, leave_room, for_others, admission)
        while True:
            await self.stager.wait(request.dataset, timeout=0.5)
            reply = self._progress(progress)
            yield reply
            # What was sent decides: the run may have ended while it went (a
            # shutdown), and its last word must still reach the caller.
            if reply.finished:
                if request.job and not progress.error:
                    self.reads.prefetch(placement.job, transfers=False)  # what did not fit, before the ranks come
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
            node=self.node_name,
            held_for_others=progress.held_for_others,
            cached_bytes=progress.cached_bytes,
            **admission_fields(progress.admission),
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        state = self._state()
        return pb.StatsReply(
            node=self.node_name,
            reads=[
                pb.TierCount(tier=TIER_TO_PROTO[tier], samples=samples, bytes=nbytes)
                for tier, (samples, nbytes) in state.served.items()
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
            prefetch=prefetch(state),
            staging=[self._progress(p) for p in state.staging.values()],
            peers=[
                pb.PeerHealth(node=p.node, suspect=p.suspect, failures=p.failures, samples=p.samples, bytes=p.bytes)
                for p in listed_peers(state.peers, LISTED_PEERS)
            ],
            exchanges=[
                x.proto() for x in sorted((*state.exchanges.values(), *state.exchanges_failed), key=lambda x: x.job)
            ],
            mcast_datagrams_dropped=state.mcast_dropped,
            exchange_multicast_note=state.multicast_note,
            exchange_received_samples=state.exchange_received[0],
            exchange_received_bytes=state.exchange_received[1],
            values_refused=state.values_refused,
            previous_owner_samples=state.previous_owner_samples,
            prefetched_samples=state.prefetched_samples,
            client_reads=[
                pb.ClientReads(tier=tier, samples=samples, bytes=nbytes)
                for tier, (samples, nbytes) in sorted(state.client_reads.items())
            ],
            client_data_wait_seconds=state.client_data_wait_seconds,
            clients=state.clients,
            prep_groups=state.prep_groups,
            bulk=state.bulk.proto(),
            cache_behind=state.cache_behind.proto(),
            cache_holdings=[cache_holding(row) for row in state.cache_holdings],
            cache_charges=[cache_charge(use) for use in state.cache_charges],
            healing=state.healing.proto(),
        )

    async def JoinJob(self, request: jpb.JoinJobRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        async with status_on_error(context):
            job = await self._link().join_job(request)
        self.reads.prefetch(job)
        return job

    async def ReportEpoch(self, request: jpb.ReportEpochRequest, context: grpc.aio.ServicerContext) -> jpb.Job:
        if self.exchanges is not None and request.HasField("rank"):
            # The rank reads this epoch from now on, before its first position report.
            self.exchanges.rank_read(request.job_id, request.epoch, request.rank, 0)
        # The exchange starts from this node's copy of the job: the directory
        # may be down, and is told when it answers.
        async with status_on_error(context):
            if self.exchanges is not None and request.wait_exchange_seconds > 0:
                # Before the exchange into the next epoch starts: it would take
                # the room this one's arrivals need.
                await self.exchanges.arrivals.wait(request.job_id, request.epoch, request.wait_exchange_seconds)
            job = await self._link().enter_epoch(request.job_id, request.epoch)
            if self.exchanges is not None:
                self.exchanges.epoch_started(request.job_id, request.epoch)
            self.reads.prefetch(job)
            return await self._link().told(job, request.epoch)

    async def ReportClientStats(
        self, request: pb.ClientStatsReport, context: grpc.aio.ServicerContext
    ) -> pb.ClientStatsReply:
        async with status_on_error(context):
            _check_stats_report(request)
            pid = self.access.caller(context).pid
        reads = {r.tier: (r.samples, r.bytes) for r in request.reads}
        self.client_stats.report(
            request.client, reads, max(0.0, request.data_wait_seconds), closing=request.closing, pid=pid
        )
        self._ranks_read(request.read_positions)
        return pb.ClientStatsReply()

    def _ranks_read(self, positions: Iterable[pb.RankPosition]) -> None:
        """Hands the ranks' read positions to the exchange, whose deletions wait for them."""
        if self.exchanges is not None:
            for read in positions:
                self.exchanges.rank_read(read.job, read.epoch, read.rank, read.position)

    async def PrepSync(self, request: pb.PrepSyncRequest, context: grpc.aio.ServicerContext) -> pb.PrepSyncReply:
        async with status_on_error(context):
            _node_local(context, "prep groups are node-local: call through the daemon's unix socket")
            owner = self.access.prep_owner(self.access.caller(context))
            return await self.prep_groups.sync(request, owner)

    async def CacheBehind(
        self, request: pb.CacheBehindRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheBehindReply:
        async with status_on_error(context):
            _node_local(context, "caching behind a trainer is node-local: call through the daemon's unix socket")
            caller = self.access.caller(context)
            await self.access.check_read(caller, request.dataset)
            hand_over = not request.handed or self.access.may_hand_over(caller)
            return await self.behind.take(request, hand_over=hand_over)

    async def ManageCache(
        self, request: pb.ManageCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ManageCacheReply:
        async with status_on_error(context):
            evicted: tuple[Evicted, ...] = ()
            if request.action != "ls":
                _node_local(context, "the cache is managed on its node: call through the daemon's unix socket")
                self.access.check_operator(self.access.caller(context), f"cache {request.action}")
            if request.action == "evict":
                evicted = await self.cache.evict(request.name, request.dry_run, request.force)
            elif request.action in ("pin", "unpin"):
                self.cache.pin(request.name, request.action == "pin")
            elif request.action != "ls":
                raise InvalidRequestError(f"unknown cache action {request.action!r}; use ls, evict, pin or unpin")
            return pb.ManageCacheReply(
                holdings=[cache_holding(row) for row in self.cache.holdings()],
                evictions=[cache_eviction(e) for e in evicted],
                charges=[cache_charge(use) for use in self.cache.users()],
                capacity_bytes=self.store.capacity,
                used_bytes=self.store.space.live_bytes,
                evict_min_age_seconds=self.cache.min_age,
            )

    async def Exchange(
        self, request_iterator: AsyncIterator[pb.ExchangeMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExchangeReply]:
        async with status_on_error(context):
            if self.receiver is None:
                raise StandaloneError("this daemon runs without a directory (--directory); exchanges need one")
            async for reply in self.receiver.receive(request_iterator):
                yield reply

    async def CodedPass(self, request: pb.CodedPassRequest, context: grpc.aio.ServicerContext) -> pb.CodedPassReply:
        async with status_on_error(context):
            if self.exchanges is None:
                raise StandaloneError("this daemon runs without a directory (--directory); exchanges need one")
            return pb.CodedPassReply(pass_id=await self.exchanges.pass_id(request.job, request.epoch))

    def _link(self) -> DirectoryLink:
        if self.link is None:
            raise StandaloneError("this daemon runs without a directory (--directory); jobs need one")
        return self.link

    def _placements(self) -> Placements:
        if self.placements is None:
            raise StandaloneError("this daemon runs without a directory (--directory); jobs need one")
        return self.placements

    def dataset_info(self, name: str) -> pb.DatasetInfo:
        entry = self.registry.get(name)
        entries, cached_bytes = self.store.dataset_usage(entry.record.cache_db)
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
        cache_db=evicted.holding.cache_db, datasets=evicted.holding.datasets, bytes=evicted.nbytes, whole=evicted.whole
    )


def cache_holding(row: Holding) -> pb.CacheHolding:
    return pb.CacheHolding(
        cache_db=row.cache_db,
        datasets=row.datasets,
        bytes=row.nbytes,
        samples=row.samples,
        last_use_unix=row.last_use,
        uid=row.uid,
        pinned_by=row.pinned_by,
    )


def cache_charge(use: UserUse) -> pb.CacheCharge:
    return pb.CacheCharge(kind=use.kind, id=use.ident, bytes=use.nbytes, quota_bytes=use.quota, quota=use.quota_text)


def prefetch(state: LiveState) -> pb.Prefetch:
    limit, used, peak = state.prefetch_memory
    counts = state.overflow
    return pb.Prefetch(
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
