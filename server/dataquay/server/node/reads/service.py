"""Serving a batch of sample ids: own cache, then the owners' caches, then the PFS.

A read for a job (``job`` set) sends the misses to the daemons that own them
in that job, one batched stream per owner, all at once; in modes whose owners
never move, a sample its owner's cache had no room for is asked of the node
it spilled to instead (:mod:`dataquay.server.planning.spill`). In modes whose owners
move, what the owner does not hold is asked of the nodes that may still hold
it, a round each, all ids of a round at once: its owner in the epoch before
(the exchange has not delivered it yet), in the epoch after (its owner gave it
away and deleted it once read, and a trainer is late), and in the epochs
before that (a spare copy). In modes ``global`` and
``locality`` (when the job has a batch size) the samples this node's ranks
will need from other nodes in the next steps are fetched ahead of them
(:mod:`dataquay.server.node.reads.prefetch`). In every mode, what this node owns
and could not cache is read from the PFS ahead of its ranks
(:mod:`dataquay.server.node.reads.overflow`). What no daemon delivers in time comes from
the PFS. A read from a peer
(``peer`` set) is answered from this cache alone, its misses flagged, so that
two daemons never bounce a request between them; but for what this node's
staging is about to bring from the PFS, which is read (or waited for) at
once (:mod:`.peer_answers`). A job whose ranks read while
its staging runs then costs the PFS each sample once in every mode, not
only where ranks read their own node's samples.

A sample read from the PFS or from its previous owner is cached only by its
owner or the node it spilled to (every PFS read when the read is for no job):
they keep it, everyone else asks them. It is
handed to the store's writer without waiting, so the reply never waits for an
LMDB commit; a read meanwhile takes it from the writer's queue instead of
the PFS. A cached value whose checksum fails is served from the PFS and
rewritten (repaired) the same way. A sample is read from the PFS once on a
node however many want it at once (:mod:`.claims`): a read waits for one
that staging or another read started, and takes over one staging has not
started yet, so a job that reads while its staging runs costs the PFS each
sample once.

A reply is resolved a window at a time (:data:`WINDOW_BYTES` of payload
asked for), the next window while the current one is sent, so that one call
holds at most two windows however many ids it carries. Within a window a
repeated id is read once and its payload shared by every position that asks
for it. A caller's ``budget`` (one per remote host) caps the bytes all its
calls hold at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import numpy as np

from dataquay.client.jobs import check_epoch_ahead
from dataquay.client.placement import MAX_EPOCH
from dataquay.client.wire.records import CHECKSUM_BYTES, encode_value, stored_checksum
from dataquay.client.wire.tiers import CACHE, PEER, PFS, SERVED_TIERS
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import (
    BatchTooLargeError,
    DataquayError,
    DatasetReplacedError,
    DirectoryUnavailableError,
    SampleIdError,
    SampleTooLargeError,
    UnknownDatasetError,
)
from dataquay.server.limits import ByteBudget
from dataquay.server.manifest_build import too_large
from dataquay.server.node.cache.store import Hit, Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.cluster.placements import Placement, Placements
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.metrics import DaemonMetrics
from dataquay.server.node.peers.bulk.client import Landing
from dataquay.server.node.peers.reads import Peers
from dataquay.server.node.reads.overflow import OverflowPrefetcher
from dataquay.server.node.reads.peer_answers import PeerAnswers
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.node.reads.prefetch import PREFETCHED_MODES, TransferPrefetcher
from dataquay.server.node.reads.served import Found, Served, Window
from dataquay.server.registry import Registered
from dataquay.server.task_group import Spawn

log = logging.getLogger("dataquay.reads")

#: Epochs before the previous one whose owners are asked for a spare copy.
HOLDER_EPOCHS = 2
MiB = 1 << 20
#: Payload bytes of a reply resolved and held at once: a batch of 64 samples
#: of 1 MiB is one window. A sample larger than this is a window of its own.
WINDOW_BYTES = 64 * MiB
#: Payload bytes one call may hold at once: the window being sent and the
#: next, resolved meanwhile when both fit.
CALL_BYTES = 2 * WINDOW_BYTES


class ReadService:
    """Resolves read requests against the node's tiers.

    ``prefetch_memory`` bounds what is prefetched for the ranks (0: nothing is);
    prefetching needs ``placements`` and ``spawn``.
    """

    def __init__(
        self,
        datasets: Datasets,
        store: Store,
        pfs: PfsPool,
        metrics: DaemonMetrics,
        max_batch: int,
        peers: Peers | None = None,
        placements: Placements | None = None,
        spawn: Spawn | None = None,
        prefetch_memory: int = 0,
        max_sample: int = 1 << 30,
    ) -> None:
        self.datasets = datasets
        self.store = store
        self.pfs = pfs
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_sample = max_sample
        self.peers = peers
        self.placements = placements
        self.previous_owner_samples = 0
        # The memory this node's prefetches for its ranks may hold (--prefetch-memory),
        # shared by the transfers and the overflow's reads from the PFS.
        self.budget = ByteBudget(prefetch_memory)
        self.prefetcher: TransferPrefetcher | None = None
        self.overflow: OverflowPrefetcher | None = None
        if spawn is not None and placements is not None and prefetch_memory > 0:
            self.prefetcher = TransferPrefetcher(self._fetch_transfers, placements.placement, spawn, self.budget)
            self.overflow = OverflowPrefetcher(
                store, pfs, placements.placement, self._caches_pfs_reads, spawn, self.budget
            )
        self._spawn = spawn
        self.peer_answers = PeerAnswers(
            store, pfs.claims, metrics, lambda entry, ids: self._from_pfs(entry, None, ids, set())
        )
        #: Told the cache sub-database of every read (the cache manager's last use).
        self.used: Callable[[str], None] = lambda cache_db: None

    async def entry(self, dataset: str, ids: np.ndarray, manifest_id: str = "") -> Registered:
        """The dataset's entry; raises for an unknown or replaced dataset, a batch
        over the limit or an id out of range."""
        self._check_batch(ids)
        entry = self._checked(await self.datasets.entry(dataset), dataset, ids, manifest_id)
        self.used(entry.record.cache_db)
        return entry

    def registered_entry(self, dataset: str, ids: np.ndarray, manifest_id: str = "") -> Registered | None:
        """As :meth:`entry` for a dataset registered here, without waiting for
        anything, so that a bulk thread may call it; None for one that only
        the directory may know (:meth:`entry` fetches it)."""
        self._check_batch(ids)
        try:
            entry = self.datasets.registry.get(dataset)
        except UnknownDatasetError:
            return None
        entry = self._checked(entry, dataset, ids, manifest_id)
        self.used(entry.record.cache_db)
        return entry

    async def cache_db(self, dataset: str, manifest_id: str, ids: np.ndarray) -> str:
        """Checks a peer's bulk read as a gRPC Read is checked; the cache database to answer it from."""
        entry = await self.entry(dataset, ids, manifest_id)
        await self.store.open_dataset(entry.record.cache_db)
        return entry.record.cache_db

    def cache_db_now(self, dataset: str, manifest_id: str, ids: np.ndarray) -> str | None:
        """:meth:`cache_db` in a bulk thread, where it waits for nothing (the
        dataset registered here, its database open); None otherwise."""
        entry = self.registered_entry(dataset, ids, manifest_id)
        if entry is None or not self.store.dataset_open(entry.record.cache_db):
            return None
        return entry.record.cache_db

    def _check_batch(self, ids: np.ndarray) -> None:
        if len(ids) > self.max_batch:
            raise BatchTooLargeError(f"batch of {len(ids)} ids exceeds the limit of {self.max_batch} (--max-batch)")

    @staticmethod
    def _checked(entry: Registered, dataset: str, ids: np.ndarray, manifest_id: str) -> Registered:
        """``entry``, unless it was replaced since ``manifest_id`` or an id is out of its range."""
        if manifest_id and manifest_id != entry.record.manifest_id:
            raise DatasetReplacedError(f"dataset {dataset!r} was replaced since it was opened; open it again")
        n = entry.manifest.num_samples
        if len(ids) and (int(ids.max()) >= n or int(ids.min()) < 0):
            bad = int(ids[(ids >= n) | (ids < 0)][0])
            raise SampleIdError(f"sample id {bad} out of range for dataset {dataset!r} (N={n})")
        return entry

    async def read(
        self,
        dataset: str,
        ids: np.ndarray,
        manifest_id: str = "",
        job: str = "",
        peer: bool = False,
        budget: ByteBudget | None = None,
        landing: Landing | None = None,
        epoch: int | None = None,
    ) -> AsyncGenerator[Window, None]:
        """The samples of ``ids`` in request order, a window at a time, for
        ``job``'s ``epoch`` where it is within one of the job's (see :meth:`_placement`);
        ``landing`` places each payload from a peer's bulk path,
        which is received there before its window is complete.

        Raises before the first window for a bad request (SampleTooLargeError
        for a sample over ``max_sample`` bytes among others); PfsReadError,
        at the window that holds it, for an unreadable sample.
        """
        entry = await self.entry(dataset, ids, manifest_id)
        ids = ids.astype(np.int64, copy=False)
        lengths = entry.manifest.sample_length
        sizes = lengths[ids]
        if len(ids) and int(sizes.max()) > self.max_sample:
            bad = int(ids[np.argmax(sizes > self.max_sample)])
            size = too_large(int(lengths[bad]), self.max_sample, "this daemon's --max-sample-size")
            raise SampleTooLargeError(f"sample {bad} of {dataset!r} is {size}")
        await self.store.open_dataset(entry.record.cache_db)
        placement = await self._placement(job, entry, epoch) if job and not peer else None
        if placement is not None and self.prefetcher is not None and _prefetched(placement):
            self.prefetcher.ahead(entry, placement, ids)
        plans = [np.unique(ids[start:stop], return_inverse=True) for start, stop in window_bounds(sizes, WINDOW_BYTES)]
        held = [int(lengths[distinct].sum()) for distinct, _ in plans]

        def resolve(k: int) -> Awaitable[Window]:
            distinct, index = plans[k]
            return self._window(entry, distinct, index.ravel(), placement, peer, landing)

        async for window in _ahead_by_one(resolve, held, budget):
            yield window

    async def _window(
        self,
        entry: Registered,
        ids: np.ndarray,
        index: np.ndarray,
        placement: Placement | None,
        peer: bool,
        landing: Landing | None = None,
    ) -> Window:
        """The samples of the distinct ``ids`` of one window."""
        db = entry.record.cache_db
        into = landing.copy_in if landing is not None and not peer else None
        cached, corrupt = self.store.get_many(db, ids.tolist(), into)
        if peer:
            return await self.peer_answers.window(entry, ids, index, cached)
        fetched: dict[int, Found] = {}
        misses = ids[[i for i, hit in enumerate(cached) if hit is None]]
        if placement is not None and self.prefetcher is not None and _prefetched(placement):
            fetched = await self.prefetcher.take(placement.job.spec.job_id, placement.epoch, misses)
            misses = _not_in(misses, fetched)
        if placement is not None and self.overflow is not None:
            fetched.update(await self.overflow.take(entry, placement, ids, misses))
            misses = _not_in(misses, fetched)
        if placement is not None and len(misses):
            fetched.update(await self._from_owners(entry, placement, placement.sources, misses, landing))
            misses = _not_in(misses, fetched)
        if placement is not None and placement.owners_move and len(misses):
            fetched.update(await self._from_other_holders(entry, placement, misses))
            misses = _not_in(misses, fetched)
        if len(misses):
            for sample_id, value in self.store.queued_values(db, misses.tolist()).items():
                fetched[sample_id] = (CACHE, memoryview(value)[CHECKSUM_BYTES:], stored_checksum(value))
            misses = _not_in(misses, fetched)
        if len(misses):
            fetched.update(await self._from_pfs(entry, placement, misses, set(corrupt)))
        return Window(self._served(ids, index, cached, fetched), index)

    async def _from_pfs(
        self, entry: Registered, placement: Placement | None, misses: np.ndarray, repair: set[int]
    ) -> dict[int, Found]:
        """``misses`` from the PFS, each read once on this node
        (:mod:`.claims`): one that staging or another read is reading is
        waited for, one staging has not started is read here and staging
        skips it. What this node keeps for the job (every sample when the read
        is for no job) is queued for the cache, before the claim ends, so
        that whoever comes next finds it queued."""
        db = entry.record.cache_db
        # Committed since the window looked (the caller looked at the queue last):
        # the writer's thread commits a value before it leaves the queue.
        committed, _ = self.store.get_many(db, misses.tolist())
        out: dict[int, Found] = {i: (CACHE, *hit) for i, hit in zip(misses.tolist(), committed) if hit is not None}

        async def keep(values: dict[int, bytes]) -> None:
            self._offer(entry, placement, values, repair)

        values, got = await self.pfs.read_once(entry.record.name, db, entry.manifest, _not_in(misses, out), keep)
        values.update(got)
        out.update({i: (PFS, memoryview(v)[CHECKSUM_BYTES:], stored_checksum(v)) for i, v in values.items()})
        return out

    def _offer(
        self, entry: Registered, placement: Placement | None, values: dict[int, bytes], repair: set[int]
    ) -> None:
        """Queues for the cache the ``values`` read from the PFS that this node
        keeps: in a job those it owns or holds, none in a cache short of its
        share where owners move (:meth:`Placements.caches_pfs_reads`); every
        one for no job."""
        ids = np.fromiter(values, dtype=np.int64, count=len(values))
        keep = (
            ids
            if placement is None
            else ids[(placement.owners[ids] == placement.node_index) | (placement.holders[ids] == placement.node_index)]
        )
        if placement is not None and not self._caches_pfs_reads(placement, entry):
            keep = keep[:0]
        name = entry.record.cache_db.encode()
        staging = self.pfs.claims.staging(entry.record.cache_db)  # it skips what was read here
        for sample_id in keep.tolist():
            self.store.offer(
                PendingWrite(
                    name,
                    sample_id,
                    values[sample_id],
                    sample_id in repair,
                    leaves_room=placement is not None and placement.owners_move,
                ),
                past_bound=staging,
            )

    def _caches_pfs_reads(self, placement: Placement, entry: Registered) -> bool:
        """Whether this node's reads from the PFS for ``placement`` may go into
        its cache (:meth:`Placements.caches_pfs_reads`)."""
        return self.placements is None or self.placements.caches_pfs_reads(placement, entry, self.store.capacity)

    def prefetch(self, job: jpb.Job, transfers: bool = True) -> None:
        """Starts prefetching for this node's ranks the overflow of ``job``
        and, with ``transfers``, the first steps' transfers of its epoch: its
        staging here ended (other nodes may still be staging: no transfers),
        or its ranks joined it or began an epoch (their first read would start
        it, a batch later)."""
        if self.overflow is not None and self._spawn is not None:
            self._spawn(self._start_prefetching(job, transfers), f"prefetch-start-{job.spec.job_id}")

    async def _start_prefetching(self, job: jpb.Job, transfers: bool) -> None:
        assert self.overflow is not None
        try:
            entry = await self.datasets.entry(job.spec.dataset)
            placement = await self._placement(job.spec.job_id, entry)
        except DataquayError:
            return  # the first read starts it, or says what is wrong
        if placement is not None:
            self.overflow.start(entry, placement)
            if transfers and self.prefetcher is not None and _prefetched(placement):
                self.prefetcher.begin(entry, placement)

    async def read_coming(self, dataset: str, manifest_id: str, ids: np.ndarray) -> dict[int, Found]:
        """For the bulk listener: :meth:`PeerAnswers.coming` of ``dataset``."""
        return await self.peer_answers.coming(await self.entry(dataset, ids, manifest_id), ids)

    async def _placement(self, job: str, entry: Registered, epoch: int | None = None) -> Placement | None:
        """The job's placement in ``epoch``, or in the job's current epoch when
        ``epoch`` is None or not within one of it (a rank reads ahead into the
        next epoch, or finishes the last one; any other epoch is not worth its
        computation); None (serve from here and the PFS) when the directory
        is down and this node has never seen the job.

        Raises:
            EpochTooFarError: ``epoch`` is too far ahead to name at all
                (:func:`~dataquay.client.jobs.check_epoch_ahead`).
        """
        if self.placements is None:
            return None
        try:
            current = await self.placements.placement(job, entry)
            if epoch is not None:
                check_epoch_ahead(job, current.job.spec.mode, epoch, current.epoch)
            if epoch is None or epoch == current.epoch or abs(epoch - current.epoch) > 1 or epoch > MAX_EPOCH:
                return current
            return await self.placements.placement(job, entry, epoch)
        except DirectoryUnavailableError:
            log.warning(
                "job unknown here and the directory is down; reading misses from the PFS",
                extra={"fields": {"job": job}},
            )
            return None

    async def _fetch_transfers(self, entry: Registered, placement: Placement, ids: np.ndarray) -> dict[int, Found]:
        return await self._from_owners(entry, placement, placement.sources, ids)

    async def _from_other_holders(
        self, entry: Registered, placement: Placement, misses: np.ndarray
    ) -> dict[int, Found]:
        """What the holders of ``misses`` in nearby epochs hold (see the module
        notes); those this node holds now are cached, which completes their transfer."""
        assert self.placements is not None
        job_id, epoch = placement.job.spec.job_id, placement.epoch
        asked = [placement.sources[misses]]
        fetched: dict[int, Found] = {}
        for other in (epoch - 1, epoch + 1, *range(epoch - 2, epoch - 2 - HOLDER_EPOCHS, -1)):
            left = ~np.isin(misses, np.fromiter(fetched, np.int64, len(fetched)))
            if other < 0 or other > MAX_EPOCH or not left.any():
                continue
            epoch_sources = (await self.placements.placement(job_id, entry, other)).sources
            holders = epoch_sources[misses]
            ask = left & (holders != placement.node_index)
            for before in asked:
                ask &= holders != before
            if ask.any():
                fetched.update(await self._from_owners(entry, placement, epoch_sources, misses[ask]))
            asked.append(holders)
        self.previous_owner_samples += len(fetched)
        name = entry.record.cache_db.encode()
        for sample_id, (_tier, data, digest) in fetched.items():
            if placement.holders[sample_id] == placement.node_index:
                self.store.offer(PendingWrite(name, sample_id, encode_value(data, digest), leaves_room=True))
        return fetched

    async def _from_owners(
        self,
        entry: Registered,
        placement: Placement,
        epoch_owners: np.ndarray,
        misses: np.ndarray,
        landing: Landing | None = None,
    ) -> dict[int, Found]:
        """What the owners of ``misses`` (in ``epoch_owners``) hold, fetched from all of them at once."""
        assert self.peers is not None and self.placements is not None
        owner_of = epoch_owners[misses]
        calls = []
        for index in np.unique(owner_of).tolist():
            node = placement.nodes[index]
            if index == placement.node_index or self.placements.link.is_down(node):
                continue
            address = await self.placements.link.address_of(node)
            ids = misses[owner_of == index]
            calls.append(
                self.peers.fetch(
                    node,
                    address,
                    entry.record.name,
                    entry.record.manifest_id,
                    ids,
                    entry.manifest.sample_length,
                    self.placements.link.registered_at(node),
                    self.placements.link.bulk_address_of(node),
                    landing,
                )
            )
        out: dict[int, Found] = {}
        for got in await asyncio.gather(*calls):
            for sample_id, (data, digest) in got.items():
                out[sample_id] = (PEER, data, digest)
        return out

    def _served(
        self, ids: np.ndarray, index: np.ndarray, cached: list[Hit | None], fetched: dict[int, Found]
    ) -> list[Served]:
        """The distinct ``ids`` as served, counted in the metrics once per position."""
        out = [
            Served(sample_id, CACHE, *hit) if hit is not None else Served(sample_id, *fetched[sample_id])
            for sample_id, hit in zip(ids.tolist(), cached)
        ]
        counts = {tier: [0, 0] for tier in SERVED_TIERS.values()}
        for served, times in zip(out, np.bincount(index, minlength=len(out)).tolist()):
            count = counts[served.tier]
            count[0] += times
            count[1] += times * len(served.data)
        for tier, (samples, nbytes) in counts.items():
            self.metrics.count_read(tier, samples, nbytes)
        return out


def _prefetched(placement: Placement) -> bool:
    spec = placement.job.spec
    return spec.mode in PREFETCHED_MODES and spec.batch_size > 0 and spec.ranks_per_node > 0


def _not_in(ids: np.ndarray, fetched: dict[int, Found]) -> np.ndarray:
    """The ``ids`` not in ``fetched``, each looked up in it: for a batch of 64
    a tenth of what ``np.isin`` costs."""
    if not fetched:
        return ids
    return ids[np.fromiter((i not in fetched for i in ids.tolist()), dtype=bool, count=len(ids))]


async def _ahead_by_one(
    resolve: Callable[[int], Awaitable[Window]], sizes: list[int], budget: ByteBudget | None
) -> AsyncIterator[Window]:
    """Windows ``0..len(sizes)-1`` in order, each resolved while the one
    before is consumed when both fit in :data:`CALL_BYTES` (and ``budget``
    has the bytes at once; it is never waited on while a window is held).

    ``sizes[k]`` is the payload bytes window ``k`` holds; they are taken
    from ``budget`` before the window is resolved and given back once the
    consumer asks for the next.
    """
    taken = 0
    ahead: asyncio.Future[Window] | None = None
    try:
        for k, size in enumerate(sizes):
            if ahead is None:
                if budget is not None:
                    await budget.take(size)
                    taken += size
                window = await resolve(k)
            else:
                window = await ahead
                ahead = None
            following = k + 1
            if (
                following < len(sizes)
                and size + sizes[following] <= CALL_BYTES
                and (budget is None or budget.try_take(sizes[following]))
            ):
                if budget is not None:
                    taken += sizes[following]
                ahead = asyncio.ensure_future(resolve(following))
            yield window
            del window  # not held while the next one is resolved
            if budget is not None:
                budget.give(size)
                taken -= size
    finally:
        if ahead is not None:
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)
        if budget is not None and taken:
            budget.give(taken)


def window_bounds(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive runs of positions whose ``lengths`` add up
    to at most ``limit`` (a position larger than that is a run of its own)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < len(ends):
        base = int(ends[start - 1]) if start else 0
        stop = max(int(np.searchsorted(ends, base + limit, side="right")), start + 1)
        bounds.append((start, stop))
        start = stop
    return bounds
