"""A rank's opt-in wait, at its epoch boundary, for the exchange into that epoch.

Nothing waits on the exchange by default: a rank that enters epoch e before
its node took in all of e's samples reads the rest from their previous
owners. A job that trains little or not at all between batches (I/O-bound,
or a data-loading benchmark) reads its share faster than the exchange moves
it, and so reads much of every epoch from peers. Such a job may ask, in
``ReportEpoch``, for the call to be held until every sample its node takes
in for e is in this cache, as the partial-local shuffling scheme this
follows has its workers wait for their exchange to end: each epoch then
reads from its own node, at the cost of the time the exchange still needed.

The same arrivals, while they are still to come, keep their room: an
exchange into a later epoch (a node whose ranks got ahead sends it) takes
only the room beyond what this node's next epochs still expect
(:class:`Expected`). Otherwise it could fill the cache first, and the
earlier arrivals, which the ranks need sooner, would wait for room that only
those ranks' reads free.

A wait ends when the arrivals are in, or when its deadline passes (a sender
down, or an exchange that failed or was given up, delivers nothing more):
it never hangs, and the rank reads on as it would have. The time waited and
the waits that ran out are counted for the Stats and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from dataquay.client.placement import MODES
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.placements import Placements
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.exchange.broker import ExchangeBroker
from dataquay.server.planning.capacity import stored_bytes
from dataquay.server.registry import Registered

log = logging.getLogger("dataquay.exchange")

#: How often a wait looks at the cache again; arrivals commit in batches.
CHECK_SECONDS = 0.05
#: The longest wait a client may ask for.
MAX_WAIT_SECONDS = 600.0


class ArrivalWaits:
    """Holds a rank at its epoch boundary until its node's arrivals are in."""

    def __init__(
        self, store: Store, datasets: Datasets, placements: Placements, link: DirectoryLink, broker: ExchangeBroker
    ) -> None:
        self.store = store
        self.broker = broker
        self.datasets = datasets
        self.placements = placements
        self.link = link
        #: Seconds ranks were held, summed over every wait.
        self.waited_seconds = 0.0
        #: Waits whose deadline passed before every arrival was in.
        self.timed_out = 0

    async def wait(self, job_id: str, epoch: int, seconds: float) -> bool:
        """Waits at most ``seconds`` until this node holds every sample it owns in
        ``epoch`` of ``job_id`` and did not own in the epoch before; whether it does."""
        started = time.monotonic()
        with self.broker.ranks_wait(job_id, epoch):
            try:
                return await self._until_in(job_id, epoch, min(seconds, MAX_WAIT_SECONDS))
            finally:
                self.waited_seconds += time.monotonic() - started

    async def _until_in(self, job_id: str, epoch: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        missing, db = await self._arrivals(job_id, epoch)
        while len(missing):
            missing = missing[~self.store.cached_mask(db, missing)]
            if not len(missing):
                break
            if time.monotonic() >= deadline:
                self.timed_out += 1
                log.warning(
                    "a rank read on before the exchange into its epoch was in; it reads the rest from peers",
                    extra={"fields": {"job": job_id, "epoch": epoch, "missing": len(missing), "seconds": seconds}},
                )
                return False
            await asyncio.sleep(CHECK_SECONDS)
        return True

    async def _arrivals(self, job_id: str, epoch: int) -> tuple[np.ndarray, str]:
        """The ids the exchange brings this node for ``epoch``, and its cache's database."""
        job = await self.link.job(job_id)
        if not MODES[job.spec.mode].owners_move:
            return np.empty(0, np.int64), ""
        entry = await self.datasets.entry(job.spec.dataset)
        db = entry.record.cache_db
        await self.store.open_dataset(db)
        return await arrival_ids(self.placements, job_id, entry, epoch), db


async def arrival_ids(placements: Placements, job_id: str, entry: Registered, epoch: int) -> np.ndarray:
    """The ids the exchange brings this node for ``epoch`` of a job whose
    owners move: those it holds then and did not hold the epoch before."""
    if epoch < 1:
        return np.empty(0, np.int64)
    before = await placements.placement(job_id, entry, epoch - 1)
    after = await placements.placement(job_id, entry, epoch)
    me = after.node_index
    if me < 0:
        return np.empty(0, np.int64)
    return np.flatnonzero((after.holders == me) & (before.holders != me))


class Expected:
    """The arrivals this node still expects for the epochs its ranks have not
    entered yet, per job: the room an exchange into a later epoch leaves them.

    An epoch's arrivals stop counting once the ranks here enter it (what has
    not come by then is read from its previous owner), so a sender that never
    delivers holds back room for one epoch at most.
    """

    def __init__(self, store: Store, placements: Placements, broker: ExchangeBroker) -> None:
        self.store = store
        self.placements = placements
        self.broker = broker
        #: (job, epoch) -> (cache database, the sample lengths, the ids not cached yet).
        self._missing: dict[tuple[str, int], tuple[str, np.ndarray, np.ndarray]] = {}

    async def track(self, job_id: str, entry: Registered, epoch: int) -> None:
        """Starts counting the arrivals of every epoch of ``job_id`` before
        ``epoch`` that the ranks here have not entered."""
        entered = self._prune(job_id)
        for earlier in range(max(entered + 1, 1), epoch):
            if (job_id, earlier) not in self._missing:
                ids = await arrival_ids(self.placements, job_id, entry, earlier)
                self._missing[(job_id, earlier)] = (entry.record.cache_db, entry.manifest.sample_length, ids)

    def room_before(self, job_id: str, epoch: int) -> int:
        """Cache bytes the arrivals still to come for the epochs of ``job_id``
        before ``epoch`` (and after the one its ranks are in) will take."""
        entered = self._prune(job_id)
        total = 0
        for (job, earlier), (db, lengths, ids) in list(self._missing.items()):
            if job != job_id or not entered < earlier < epoch or not len(ids):
                continue
            ids = ids[~self.store.cached_mask(db, ids)]
            self._missing[(job, earlier)] = (db, lengths, ids)
            total += stored_bytes(lengths[ids])
        return total

    def _prune(self, job_id: str) -> int:
        """Forgets the epochs of ``job_id`` its ranks entered; returns the latest."""
        entered = self.broker.entered_epoch(job_id)
        for key in [k for k in self._missing if k[0] == job_id and k[1] <= entered]:
            del self._missing[key]
        return entered
