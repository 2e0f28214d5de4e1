"""A peer's read, answered: from this cache, and from what this node's
staging is about to bring into it.

A peer asks a node only for what it holds, so that two daemons never bounce
a request between them. While a staging run goes, a sample it will cache is
read (or its read under way waited for) at once, and queued for the cache as
staging would have; staging then skips it. A peer's read in a job that
trains while staging moves the sample ahead in its owner's staging and costs
the PFS nothing more, where the peer reading the PFS itself would read it a
second time: three quarters of a rank's first epoch in mode ``global``.
Reads ahead of the ranks keep nothing in the cache and are not waited for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES, stored_checksum
from dataquay.client.wire.tiers import CACHE
from dataquay.server.errors import DataquayError
from dataquay.server.node.cache.store import Hit, Store
from dataquay.server.node.metrics import DaemonMetrics
from dataquay.server.node.reads.claims import PfsClaims
from dataquay.server.node.reads.served import MISSING, Found, Served, Window
from dataquay.server.registry import Registered

#: Reads ``ids`` of a dataset from the PFS, each once on this node, queuing
#: what it reads for the cache (ReadService's PFS read for no job).
ReadFromPfs = Callable[[Registered, np.ndarray], Awaitable[dict[int, Found]]]


class PeerAnswers:
    """Answers peers' reads on one node.

    Args:
        store: this node's cache.
        claims: who reads which sample from the PFS here.
        metrics: where the samples served to peers are counted.
        from_pfs: the read of samples staging has reserved or is reading.
    """

    def __init__(self, store: Store, claims: PfsClaims, metrics: DaemonMetrics, from_pfs: ReadFromPfs) -> None:
        self.store = store
        self.claims = claims
        self.metrics = metrics
        self.from_pfs = from_pfs

    async def window(self, entry: Registered, ids: np.ndarray, index: np.ndarray, cached: list[Hit | None]) -> Window:
        """The window of the distinct ``ids`` (``cached`` their lookups in
        this cache): what this node has or brings, the rest flagged missing."""
        misses = ids[[i for i, hit in enumerate(cached) if hit is None]]
        db = entry.record.cache_db
        coming = await self.coming(entry, misses) if len(misses) and self.may_bring(db, misses) else {}
        out = []
        for sample_id, hit in zip(ids.tolist(), cached):
            if hit is not None:
                out.append(Served(sample_id, CACHE, *hit))
            elif (found := coming.get(sample_id)) is not None:
                out.append(Served(sample_id, *found))
            else:
                out.append(Served(sample_id, MISSING, b"", 0))
        samples = nbytes = 0
        for served, times in zip(out, np.bincount(index, minlength=len(out)).tolist()):
            if served.tier != MISSING:
                samples += times
                nbytes += times * len(served.data)
        self.metrics.count_peer_served(samples, nbytes)
        return Window(out, index)

    def may_bring(self, db: str, ids: np.ndarray) -> bool:
        """Whether :meth:`coming` may find any of ``ids``: a staging run of
        ``db`` is on, or one is being staged or queued; thread-safe (the
        bulk listener asks in its connection's thread)."""
        queued = self.store.writer.queue.waiting
        name = db.encode()
        return (
            self.claims.staging(db)
            or bool(self.claims.coming_mask(db, ids).any())
            or any(queued(name, i) is not None for i in ids.tolist())
        )

    async def coming(self, entry: Registered, ids: np.ndarray) -> dict[int, Found]:
        """Those of ``ids``, found missing here a moment ago, that this node
        has or is about to have: to be read by its staging
        (:meth:`PfsClaims.coming_mask`), read now or waited for, each once;
        or queued for the cache or committed since. A PFS error leaves them
        missing: the asker reads them itself, and meets the error there."""
        db = entry.record.cache_db
        # In this order: a claim's value is queued before the claim ends, and
        # committed before it leaves the queue.
        coming = self.claims.coming_mask(db, ids)
        rest = ids[~coming].tolist()
        out: dict[int, Found] = {
            i: (CACHE, memoryview(v)[CHECKSUM_BYTES:], stored_checksum(v))
            for i, v in self.store.queued_values(db, rest).items()
        }
        committed, _ = self.store.get_many(db, rest)
        out.update({i: (CACHE, *hit) for i, hit in zip(rest, committed) if hit is not None})
        if coming.any():
            try:
                out.update(await self.from_pfs(entry, ids[coming]))
            except DataquayError:
                pass
        return out
