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
        if epoch < 1 or not MODES[job.spec.mode].owners_move:
            return np.empty(0, np.int64), ""
        entry = await self.datasets.entry(job.spec.dataset)
        before = await self.placements.placement(job_id, entry, epoch - 1)
        after = await self.placements.placement(job_id, entry, epoch)
        me = after.node_index
        if me < 0:
            return np.empty(0, np.int64), ""
        db = entry.record.cache_db
        await self.store.open_dataset(db)
        return np.flatnonzero((after.owners == me) & (before.owners != me)), db
