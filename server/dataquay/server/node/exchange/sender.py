"""The sending side of the per-epoch exchange.

When this node's trainers enter epoch e of a job whose owners move (the first
``ReportEpoch`` from the node is enough), the daemon starts shipping, in the
background, the samples it gives away in epoch e+1 to their new owners: one
bidirectional stream per receiver (a few receivers at a time), a window of
chunks in flight, payloads with their checksums, the whole capped by
``--exchange-bandwidth``, each receiver's samples in the order this node's
ranks read them in epoch e, but what the receiver's ranks read in the first
third of epoch e+1 first, in their order, and the rest a third of an epoch
ahead of their reads (their read-ahead asks for them while this node still
reads epoch e; :mod:`.outbox`, :mod:`.streams`). A chunk holds at least one
sample; a sample larger than a message is a chunk of its own and goes as
pieces (:mod:`dataquay.client.wire.pieces`). The receiver reserves room before it
takes a chunk and acknowledges it once its cache has committed it.

A sample is deleted here only when its receiver acknowledged it and this
node's rank that reads it in epoch e has gone past it (its client reports read
positions; a rank entering e+1 has read all of e; once the node enters e+1,
a rank that reported no position in e counts as having read it all, one that
did is waited for until it has, or the node enters e+2), and only while the
cache is fuller than ``--spare-copies-fill``: below that, given-away samples
stay as spare copies, and a later epoch that hands one back moves nothing (the
receiver says it already holds it). Deleting as the ranks read is what lets a
node whose cache holds little more than its share take in the next epoch's
samples: what arrives balances what leaves. A receiver whose cache cannot
hold its share asks for samples only once this node's ranks have read them
(they are then deleted here as soon as delivered), so no sample takes room in
two short caches. Nothing waits on the exchange: a
trainer that reaches e+1 first reads what has not arrived from its previous
owner. An exchange still shipping when the node enters e+2 stops, and deletes
what it never delivered too (a cache short of its share cannot keep samples
no epoch will read here).

A killed daemon redoes its part after restart: the offer's first reply lists
what the receiver already holds, so nothing is sent twice and nothing is lost.

A run that fails (its job or dataset gone, or an error no part of it
handles) stops shipping, is logged once and shows as failed, with the
reason, in the Stats its node returns; its samples are read from their
previous owners, as for any exchange not done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.placement import MODES, node_reads, owner_read_positions, rank_length
from dataquay.client.wire.status_codes import UNREACHABLE
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import DataquayError, ExchangeRefusedError, JobMismatchError
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.placements import Placement, Placements
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.exchange.arrivals import ArrivalWaits
from dataquay.server.node.exchange.broker import ExchangeBroker
from dataquay.server.node.exchange.coded import SNAPSHOT_SECONDS, CodedProgress, PassTransport, coded_pass, linger
from dataquay.server.node.exchange.mcast import Channel, MulticastEndpoint, no_multicast
from dataquay.server.node.exchange.outbox import UNAVAILABLE, Outbox, OutboxProgress
from dataquay.server.node.exchange.pass_ids import PassIds
from dataquay.server.node.exchange.positions import WHOLE_EPOCH, ReadPositions
from dataquay.server.node.exchange.receiver import ExchangeReceiver
from dataquay.server.node.exchange.streams import ExchangeStreams, News
from dataquay.server.node.peers.reads import Peers
from dataquay.server.registry import Registered
from dataquay.server.task_group import Spawn

log = logging.getLogger("dataquay.exchange")

#: Receivers streamed to at once.
PARALLEL_RECEIVERS = 4
#: Longest wait for one answer of the node that leads a coded pass (the pass's id).
PASS_ID_CALL_SECONDS = 5.0
#: Share of an epoch a receiver's ranks may begin reading the next one
#: ahead of this node's ranks (the read-ahead of its batches, and a rank
#: faster than this node's slowest). What they read in that first share of
#: the next epoch goes first, in their order: in a cache with little more
#: room than its share the exchange moves at the pace of the ranks' reads,
#: and the first batches of the next epoch would otherwise wait for room
#: behind samples read later. The rest goes that share of an epoch ahead of
#: where they read it. Shipped before it is read here, a sample takes room
#: in both caches for a while, which this bounds to about a third of what
#: a node gives away.
LEAD = 1 / 3


@dataclass
class ExchangeRun:
    """This node's sending side of one job's exchange into ``epoch``."""

    job: str
    epoch: int
    outbox: Outbox
    #: This node's ranks, whose read positions in ``epoch - 1`` free what was given away.
    ranks: np.ndarray
    entry: Registered
    started: float = field(default_factory=time.monotonic)
    #: Seconds from the start to a receiver's first acknowledgement (0: none yet).
    first_delivery: float = 0.0
    ended: float = 0.0
    finished: bool = False
    #: The run stopped on a failure, which ``error`` names.
    failed: bool = False
    error: str = ""
    #: Shipping to every receiver; cancelled when the job moves past ``epoch``.
    shipping: asyncio.Future[list[None]] | None = None
    #: The coded pass, for a job whose exchange is coded.
    coded: CodedProgress | None = None

    def progress(self) -> OutboxProgress:
        return self.outbox.progress()

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def read_upto(self, positions: ReadPositions) -> np.ndarray:
        """How far each of this node's ranks has read the epoch this run ships out of."""
        return positions.read_upto(self.job, self.epoch - 1, self.ranks)


class Exchanges:
    """Starts, runs and reports this node's exchanges.

    Args:
        node_name: this node.
        receiver: this node's receiving side, which commits what a coded pass decodes.
        broker: what the sending and the receiving side tell each other.
        spawn: starts a background task owned by the daemon.
        bandwidth: cap on bytes sent per second, over all exchanges; 0 = none.
        spare_copies_fill: cache fill below which given-away samples are kept.
        multicast: where coded passes travel (None: jobs with a coded
            exchange exchange uncoded).
        token: the node token their datagrams' keys derive from.
    """

    def __init__(
        self,
        node_name: str,
        store: Store,
        datasets: Datasets,
        placements: Placements,
        link: DirectoryLink,
        peers: Peers,
        receiver: ExchangeReceiver,
        broker: ExchangeBroker,
        spawn: Spawn,
        bandwidth: int = 0,
        spare_copies_fill: float = 0.5,
        multicast: Channel | None = None,
        token: str = "",
    ) -> None:
        self.node_name = node_name
        self.store = store
        self.datasets = datasets
        self.placements = placements
        self.link = link
        self.peers = peers
        self.receiver = receiver
        self.broker = broker
        self.spawn = spawn
        self.bandwidth = bandwidth
        self.spare_copies_fill = spare_copies_fill
        self.multicast = multicast
        self.token = token
        #: Why jobs with a coded exchange exchange uncoded here (:meth:`check_multicast`); "" when they code.
        self.multicast_note = "" if multicast else "this daemon has no --exchange-multicast: exchanged uncoded"
        self.runs: dict[tuple[str, int], ExchangeRun] = {}
        #: Per job, the latest run that failed before it had a run record: (epoch, reason).
        self.failures: dict[str, tuple[int, str]] = {}
        self.pass_ids = PassIds()
        #: Ids of the coded passes under way here.
        self.live_passes: set[int] = set()
        #: Coded passes' datagrams and packets dropped, by reason (:data:`~.mcast.DROP_REASONS`).
        self.mcast_dropped: dict[str, int] = {}
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._epochs: dict[str, int] = {}
        self._epoch_moved = asyncio.Event()
        self.positions = ReadPositions()
        self.news = News()
        self.streams = ExchangeStreams(node_name, store, link, peers, self.positions, self.news, bandwidth)
        #: Samples deleted before they were shipped, to break a wait for room (see make_room).
        self.given_up_samples = 0
        #: Ranks that asked to wait for the exchange into their epoch (``ReportEpoch``).
        self.arrivals = ArrivalWaits(store, datasets, placements, link, broker)
        #: Given-away samples deleted here, and their count at the last call of make_room.
        self.dropped_samples = 0
        self._dropped_seen = -1
        broker.makes_room(self.make_room)

    @property
    def sent_samples(self) -> int:
        """Samples sent in exchanges and committed by their receivers."""
        return self.streams.sent_samples

    @property
    def sent_bytes(self) -> int:
        """Payload bytes sent in exchanges and committed by their receivers."""
        return self.streams.sent_bytes

    def epoch_started(self, job_id: str, epoch: int) -> None:
        """This node's trainers entered ``epoch``: prepare ``epoch + 1``.

        An exchange for an earlier epoch that is still shipping stops
        shipping: every sample it had left has been read, and so cached, by
        its owner during the epoch that needed it. It still deletes what it
        delivered.
        """
        if epoch <= self._epochs.get(job_id, -1):
            return
        self._epochs[job_id] = epoch
        self.broker.entered(job_id, epoch)
        self._epoch_moved.set()
        self.news.tell()
        for (job, target), run in self.runs.items():
            if job == job_id and target < epoch and run.shipping is not None:
                run.shipping.cancel()
        key = (job_id, epoch + 1)
        if key not in self._tasks:
            task = self.spawn(self._run(job_id, epoch + 1), f"exchange-{job_id}-{epoch + 1}")
            self._tasks[key] = task
            task.add_done_callback(lambda _task: self._tasks.pop(key, None))

    def rank_read(self, job_id: str, epoch: int, rank: int, position: int) -> None:
        """A client reports how far ``rank`` of a job has read ``epoch``; jobs
        this node does not know, and ranks outside the job, are ignored."""
        job = self.link.jobs.get(job_id)
        if job is None or rank >= len(job.spec.nodes) * job.spec.ranks_per_node:
            return
        if self.positions.report(job_id, epoch, rank, position):
            self.news.tell()

    def resume(self, jobs: list[tuple[str, int]]) -> None:
        """After a restart: redo the exchange of each (job, current epoch) this node is in."""
        for job_id, epoch in jobs:
            self.epoch_started(job_id, epoch)

    def progress(self) -> list[ExchangeRun]:
        """The latest run of each job."""
        latest: dict[str, ExchangeRun] = {}
        for run in self.runs.values():
            if run.job not in latest or run.epoch > latest[run.job].epoch:
                latest[run.job] = run
        return [latest[job] for job in sorted(latest)]

    def failed_early(self) -> list[tuple[str, int, str]]:
        """(job, epoch, reason) of each job whose latest exchange failed before its run began."""
        latest = {run.job: run.epoch for run in self.progress()}
        return [
            (job, epoch, reason)
            for job, (epoch, reason) in sorted(self.failures.items())
            if epoch > latest.get(job, -1)
        ]

    def check_multicast(self) -> None:
        """Finds out once, at start, whether the interface carries multicast; where it does not,
        says so and has coded jobs exchange uncoded at once rather than wait for snapshots."""
        if self.multicast is None:
            return
        reason = no_multicast(self.multicast)
        if reason:
            self.multicast_note = f"{reason}: exchanged uncoded"
            log.warning(
                "coded exchanges run uncoded: no multicast on this fabric",
                extra={"fields": {"multicast": f"{self.multicast.group}:{self.multicast.port}", "reason": reason}},
            )

    async def pass_id(self, job_id: str, epoch: int) -> int:
        """The id of ``job_id``'s coded pass into ``epoch``, for a node of the job (``CodedPass``).

        Raises:
            UnknownJobError: the job is unknown here and to the directory.
            ExchangeRefusedError: this node is not the job's first node, which leads its passes.
        """
        job = await self.link.job(job_id)
        if not job.spec.nodes or job.spec.nodes[0] != self.node_name:
            raise ExchangeRefusedError(
                f"node {self.node_name} does not lead job {job_id!r}'s coded passes: its first node does"
            )
        return self.pass_ids.issue(job_id, epoch)

    # ------------------------------------------------------------ one run

    async def _run(self, job_id: str, epoch: int) -> None:
        try:
            await self._exchange(job_id, epoch)
        except DataquayError as exc:
            log.warning(
                "exchange failed; its samples will be read from their previous owners",
                extra={"fields": {"job": job_id, "epoch": epoch, "error": str(exc)}},
            )
            self._failed(job_id, epoch, str(exc))
        except Exception as exc:  # a failure no part handled: reported, never a run that looks alive
            log.exception(
                "exchange failed; its samples will be read from their previous owners",
                extra={"fields": {"job": job_id, "epoch": epoch}},
            )
            self._failed(job_id, epoch, f"{type(exc).__name__}: {exc}")

    def _failed(self, job_id: str, epoch: int, reason: str) -> None:
        """Marks the run into ``epoch`` failed (or records the failure, when it had no run yet)."""
        run = self.runs.get((job_id, epoch))
        if run is None:
            self.failures[job_id] = (epoch, reason)
            return
        run.failed, run.error = True, f"failed: {reason}"
        run.finished, run.ended = True, run.ended or time.monotonic()

    async def _exchange(self, job_id: str, epoch: int) -> None:
        job = await self.link.job(job_id)
        if not MODES[job.spec.mode].owners_move:
            return
        entry = await self.datasets.entry(job.spec.dataset)
        if entry.record.manifest_id != job.manifest_id:
            raise JobMismatchError(
                f"job {job_id!r} runs on another version of dataset {job.spec.dataset!r} than this node holds"
            )
        before = await self.placements.placement(job_id, entry, epoch - 1)
        after = await self.placements.placement(job_id, entry, epoch)
        if after.node_index < 0:
            return
        me = after.node_index
        give = np.flatnonzero((before.holders == me) & (after.holders != me))
        ranks, readers, read_at = await self._reads(job, entry, before)
        due = await self._due(job, entry, after, give)
        # Sorting a million give-aways takes a third of a second: off the event loop.
        outbox = await asyncio.get_running_loop().run_in_executor(
            None,
            Outbox,
            give,
            after.holders[give],
            entry.manifest.sample_length[give],
            None if readers is None else readers[give],
            None if read_at is None else read_at[give],
            due,
        )
        run = ExchangeRun(job_id, epoch, outbox, ranks, entry)
        self.runs[(job_id, epoch)] = run
        self.positions.forget(set(self.link.jobs))
        # Keep the last two runs of each job the directory still lists: the
        # metrics' job label stays bounded.
        for old in [k for k in self.runs if (k[0] == job_id and k[1] < epoch - 1) or k[0] not in self.link.jobs]:
            del self.runs[old]
        log.info(
            "exchange started",
            extra={
                "fields": {"job": job_id, "epoch": epoch, "samples": len(give), "bytes": run.progress().total_bytes}
            },
        )
        coding = job.spec.exchange_coding or "none"
        # A coded pass needs every node's cache snapshot: not with a node absent.
        if coding != "none" and not (before.lost or after.lost):
            run.coded = CodedProgress()
            await self._coded(run.coded, entry, coding, after)
            log.info(
                "coded exchange pass over",
                extra={
                    "fields": {
                        "job": job_id,
                        "epoch": epoch,
                        "packets_sent": run.coded.packets_sent,
                        "bytes_sent": run.coded.bytes_sent,
                        "decoded": run.coded.samples_decoded,
                        "note": run.coded.note,
                    }
                },
            )
        limit = asyncio.Semaphore(PARALLEL_RECEIVERS)
        dropper = asyncio.get_running_loop().create_task(self._drop_as_read(entry, run))
        try:
            streams = [
                asyncio.ensure_future(self.streams.ship_to(run, entry, after, receiver, limit))
                for receiver in run.outbox.receivers_left()
            ]
            run.shipping = asyncio.gather(*streams)
            given_up = False
            try:
                await run.shipping
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                run.error, given_up = run.error or "given up: the job moved on", True
            except Exception:
                for stream in streams:  # a failed one leaves its siblings running otherwise
                    stream.cancel()
                raise
            run.finished, run.ended = True, time.monotonic()
            done = run.progress()
            log.info(
                "exchange finished",
                extra={
                    "fields": {
                        "job": job_id,
                        "epoch": epoch,
                        "delivered": done.delivered_samples,
                        "sent_bytes": done.sent_bytes,
                        "unavailable": done.unavailable_samples,
                        "refused": done.refused_samples,
                        "seconds": round(run.elapsed, 3),
                    }
                },
            )
            await self._until_epoch(job_id, epoch)
            await self._until_read(run)
            if not self._keeps_spare_copies():
                left = run.outbox.delivered_ids()
                if given_up:
                    # Their owners read them from here during the epoch that needed
                    # them; now they would only keep the new epoch's arrivals out.
                    left = np.concatenate([left, run.outbox.undelivered_ids()])
                await self._drop_given_away(entry, run, left)
        finally:
            dropper.cancel()
            await asyncio.gather(dropper, return_exceptions=True)

    async def _coded(self, progress: CodedProgress, entry: Registered, scheme: str, after: Placement) -> None:
        """The coded pass before the streams, under an id its job's first node gave it."""
        job_id = after.job.spec.job_id
        if self.multicast is None or self.multicast_note:
            progress.note = self.multicast_note
            return
        leader = after.nodes[0]
        try:
            pass_id = (
                self.pass_ids.issue(job_id, after.epoch)
                if leader == self.node_name
                else await self._ask_pass_id(leader, job_id, after.epoch)
            )
        except TimeoutError:
            progress.note = f"the job's first node {leader} gave no pass id within {SNAPSHOT_SECONDS:.0f} s"
            return
        except grpc.aio.AioRpcError as exc:
            progress.note = f"the job's first node {leader} gave no pass id: {exc.code().name}: {exc.details()}"
            return
        self.live_passes.add(pass_id)
        endpoint: MulticastEndpoint | None = None
        try:
            transport = PassTransport(
                self.multicast, self.token, pass_id, self.live_passes, self._count_drop, self.bandwidth
            )
            endpoint = await coded_pass(
                transport, self.store, self.receiver, self.broker, entry, job_id, scheme, after, progress
            )
        finally:
            if endpoint is None:
                self.live_passes.discard(pass_id)
        if endpoint is not None:
            self.spawn(self._linger(endpoint, pass_id, progress), f"coded-linger-{job_id}-{after.epoch}")

    async def _linger(self, endpoint: MulticastEndpoint, pass_id: int, progress: CodedProgress) -> None:
        """Answers the pass's late senders while the streams ship (:func:`.coded.linger`)."""
        try:
            await linger(endpoint, progress)
        finally:
            self.live_passes.discard(pass_id)

    async def _ask_pass_id(self, leader: str, job_id: str, epoch: int) -> int:
        """The pass's id from ``leader`` over TCP, asked again while it is unreachable.

        Raises:
            TimeoutError: no answer within SNAPSHOT_SECONDS.
            grpc.aio.AioRpcError: the leader refused.
        """
        delay = 0.1
        async with asyncio.timeout(SNAPSHOT_SECONDS):
            while True:
                address = await self.link.address_of(leader)
                if address:
                    request = pb.CodedPassRequest(job=job_id, epoch=epoch)
                    try:
                        reply = await self.peers.stub(leader, address).CodedPass(request, timeout=PASS_ID_CALL_SECONDS)
                        return int(reply.pass_id)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in UNREACHABLE:
                            raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _count_drop(self, reason: str) -> None:
        self.mcast_dropped[reason] = self.mcast_dropped.get(reason, 0) + 1

    async def _reads(
        self, job: jpb.Job, entry: Registered, current: Placement
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """This node's ranks, and which of them (an index into those) reads each
        sample in ``current``'s epoch and where (None when the job does not say
        its ranks per node)."""
        per_node = job.spec.ranks_per_node
        ranks = np.arange(current.node_index * per_node, (current.node_index + 1) * per_node)
        if per_node < 1:
            return ranks, None, None
        plan = job_plan(job, entry.manifest)
        reads = await asyncio.get_running_loop().run_in_executor(
            None, node_reads, plan, current.epoch, current.node_index, current.owners
        )
        return ranks, np.where(reads.rank >= 0, reads.rank - ranks[0], -1), reads.position

    async def _due(self, job: jpb.Job, entry: Registered, after: Placement, give: np.ndarray) -> np.ndarray | None:
        """Where in this node's read order each of ``give`` goes at the
        latest (:func:`due_positions`), so that it is there when its
        receiver's ranks' read-ahead asks for it, though they enter the epoch
        ahead of this node's slowest rank. None when the job does not say
        its ranks per node."""
        if job.spec.ranks_per_node < 1 or not len(give):
            return None
        plan = job_plan(job, entry.manifest)
        at = await asyncio.get_running_loop().run_in_executor(
            None, owner_read_positions, plan, after.epoch, after.owners, give
        )
        return due_positions(at, rank_length(plan))

    def _keeps_spare_copies(self) -> bool:
        """Whether given-away samples stay: the cache is emptier than ``--spare-copies-fill``."""
        return bool(self.store.capacity) and self.store.space.live_bytes < self.spare_copies_fill * self.store.capacity

    async def _drop_as_read(self, entry: Registered, run: ExchangeRun) -> None:
        """Deletes, while the ranks read epoch ``run.epoch - 1``, what is delivered and read."""
        while True:
            await self.news.wait()
            if self._keeps_spare_copies():
                continue
            ready = run.outbox.read_and_delivered(run.read_upto(self.positions))
            if len(ready):
                await self._drop_given_away(entry, run, ready)

    async def make_room(self, nbytes: int) -> int:
        """Deletes about ``nbytes`` of samples this node gives away that its
        ranks have read and no receiver has taken yet; their new owners read
        them from the PFS. What a full node gives up when every full node's
        exchange waits on another's (see :mod:`.receiver`), and only then:
        while this node deleted given-away samples since the last call, its
        ranks' reads free room (an exchange that runs at their pace). Returns how many."""
        if self.dropped_samples != self._dropped_seen:
            self._dropped_seen = self.dropped_samples
            return 0
        deleted = 0
        for run in [r for r in self.runs.values() if not r.finished]:
            ids = run.outbox.read_pending(run.read_upto(self.positions), nbytes)
            if not len(ids):
                continue
            run.outbox.unsettled(ids, UNAVAILABLE)
            await self._drop_given_away(run.entry, run, ids)
            deleted += len(ids)
            break
        if deleted:
            self.given_up_samples += deleted
            log.info(
                "deleted samples given away and not yet shipped: exchanges into this node waited for room",
                extra={"fields": {"samples": deleted, "bytes_wanted": nbytes}},
            )
        return deleted

    async def _until_read(self, run: ExchangeRun) -> None:
        """Waits until this node's ranks that report their reads have read all
        that ``run`` gives away, or the node enters the epoch after
        ``run.epoch``. Ranks run at their own pace: the first to enter
        ``run.epoch`` says nothing of how far the others read the epoch before."""
        while self._epochs.get(run.job, -1) <= run.epoch:
            reading = self.positions.still_reading(run.job, run.epoch - 1, run.ranks)
            read_upto = np.where(reading, run.read_upto(self.positions), WHOLE_EPOCH)
            if run.outbox.all_read(read_upto):
                return
            await self.news.wait()

    async def _until_epoch(self, job_id: str, epoch: int) -> None:
        while self._epochs.get(job_id, -1) < epoch:
            self._epoch_moved.clear()
            await self._epoch_moved.wait()

    async def _drop_given_away(self, entry: Registered, run: ExchangeRun, ids: np.ndarray) -> None:
        """Deletes ``ids``, delivered by ``run``; never a sample this node owns
        again in an epoch started or next, nor one it answered an offer for a
        later epoch that it holds (the offer's sender does not send it then)."""
        async with self.broker.holding:
            horizon = self._epochs.get(run.job, 0) + 1
            drop = ids[~np.isin(ids, self.broker.held_beyond(run.job, horizon))]
            for epoch in range(run.epoch, horizon + 1):
                placement = await self.placements.placement(run.job, entry, epoch)
                drop = drop[placement.holders[drop] != placement.node_index]
            removed = await self.store.discard(entry.record.cache_db, drop)
            run.outbox.dropped(drop)
        self.dropped_samples += removed
        log.debug(
            "dropped samples given away", extra={"fields": {"job": run.job, "epoch": run.epoch, "samples": removed}}
        )


def due_positions(at: np.ndarray, length: int) -> np.ndarray:
    """Where in this node's read order (``length`` ids per rank) an id its
    receiver's ranks read at position ``at`` of the next epoch goes at the
    latest: the first LEAD of their epoch at its own position, the rest
    LEAD of an epoch ahead of it (-1 stays -1: no rank there reads it)."""
    lead = int(length * LEAD)
    return np.where(at < 0, -1, np.where(at < lead, at, at + lead))
