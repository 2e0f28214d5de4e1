"""Caching behind a trainer: the samples a client read from the PFS itself.

A miss costs a trainer least when it reads the file itself, as fast as any
direct read, and leaves the caching to its daemon, off its path. The client
names the ids it read in a notice (batched, from a background thread); the
daemon reads them back from the page cache, which on the trainer's node
still holds them, asking first (:mod:`dataquay.client.page_cache`: never a
second read of a sample from storage),
checks each file against the manifest as any PFS read does (size, mtime),
frames the payloads (checksum) and queues them for the cache writer. Where
the page cache does not hold a sample (a PFS that caches in a pool of its
own, memory pressure), the reply names it, and the client hands its bytes
over through its shared-memory segment. The daemon takes handed bytes only
from a segment of its own user, who could write the cache directly anyway,
and only of the length the manifest gives; on a daemon that keeps its users
apart, only from a caller of its own user or root as well (the segment's
owner is not always who wrote into it), :mod:`dataquay.server.node.users`.

Insert-once as every read: ids already cached or queued are skipped, and a
cached value that fails its checksum is rewritten (repaired). So are ids that
staging or a read is fetching from the PFS (:mod:`.claims`); one that staging
has reserved but not started is taken over, and staging skips it: a sample
is never fetched both ways. Bounded: a
notice carries at most :data:`MAX_NOTICE_IDS` ids and
:data:`MAX_NOTICE_BYTES` of payload (or one sample of up to the daemon's
largest, ``--max-sample-size``), all notices in progress hold at most
:data:`BEHIND_BYTES`, and the writes wait for room in the write queue, so
the client's notices wait (in its background thread) rather than the daemon
growing.

Idle priority: the reads back and the hand-over run in threads at
SCHED_IDLE (the trainer has its bytes already; caching them waits while the
node's cores are busy). Their commits go through the cache's one writer at
its usual priority: a commit starved at idle priority would hold LMDB's
write lock, and the exchange's and staging's writes would wait behind it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES, encode_value
from dataquay.protos import cache_pb2 as pb
from dataquay.server.errors import BatchTooLargeError, DatasetReplacedError, SampleIdError
from dataquay.server.limits import ByteBudget
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.handoff.segments import ShmSegments
from dataquay.server.node.reads.pfs import PfsPool

MiB = 1 << 20
#: Most ids one notice may name (read back or handed over).
MAX_NOTICE_IDS = 4096
#: Most payload bytes one notice may name.
MAX_NOTICE_BYTES = 64 * MiB
#: Payload bytes the notices in progress hold at once.
BEHIND_BYTES = 128 * MiB


@dataclass
class BehindCounts:
    """What caching behind the trainers did, since the daemon started."""

    page_cache_samples: int = 0
    page_cache_bytes: int = 0
    handed_samples: int = 0
    handed_bytes: int = 0
    not_in_page_cache: int = 0
    refused_samples: int = 0

    def proto(self) -> pb.CacheBehindCounts:
        return pb.CacheBehindCounts(**self.__dict__)


class CacheBehind:
    """Takes the notices of this node's clients; see the module notes."""

    def __init__(
        self, datasets: Datasets, store: Store, pfs: PfsPool, shm: ShmSegments, max_sample: int = 1 << 30
    ) -> None:
        self.datasets = datasets
        self.max_sample = max_sample
        self.store = store
        self.pfs = pfs
        self.shm = shm
        self.counts = BehindCounts()
        self._budget = ByteBudget(BEHIND_BYTES)

    async def take(self, request: pb.CacheBehindRequest, hand_over: bool = True) -> pb.CacheBehindReply:
        """Queues what the notice names for the cache; the reply names the ids
        the page cache did not hold (for the client to hand over). Without
        ``hand_over`` (a caller outside the daemon's trust domain) the bytes
        handed over are refused and only what the daemon reads itself is cached."""
        entry = await self.datasets.entry(request.dataset)
        if request.manifest_id and request.manifest_id != entry.record.manifest_id:
            raise DatasetReplacedError(f"dataset {request.dataset!r} was replaced since it was opened; open it again")
        ids = np.fromiter(request.ids, dtype=np.uint64, count=len(request.ids))
        handed = {s.id: s for s in request.handed}
        named = np.concatenate([ids, np.fromiter(handed, dtype=np.uint64, count=len(handed))])
        if len(named) > MAX_NOTICE_IDS:
            raise BatchTooLargeError(f"a notice of {len(named)} ids exceeds the limit of {MAX_NOTICE_IDS}")
        lengths = entry.manifest.sample_length
        n = entry.manifest.num_samples
        if len(named) and int(named.max()) >= n:
            raise SampleIdError(f"sample id {int(named.max())} out of range for dataset {request.dataset!r} (N={n})")
        named = named.astype(np.int64)
        nbytes = int(lengths[named].sum()) if len(named) else 0
        if nbytes > MAX_NOTICE_BYTES and len(named) > 1:
            raise BatchTooLargeError(f"a notice of {nbytes} bytes exceeds the limit of {MAX_NOTICE_BYTES}")
        db = entry.record.cache_db
        await self.store.open_dataset(db)
        loop = asyncio.get_running_loop()
        wanted, repair = self._wanted(db, named)  # on the loop, as every read of the store: it resizes the map
        too_large = lengths[wanted] > self.max_sample
        if too_large.any():
            self.counts.refused_samples += int(too_large.sum())
            wanted = wanted[~too_large]
        await self._budget.take(nbytes)
        claims, me = self.pfs.claims, object()
        mine, _ = claims.claim(db, wanted.tolist(), me, started=True, steal=True)
        wanted = np.array(mine, dtype=np.int64)
        try:
            read_back = wanted[np.isin(wanted, ids.astype(np.int64))]
            writes: list[PendingWrite] = []
            not_cached: list[int] = []
            name = db.encode()
            if len(read_back):
                values, not_cached, refused = await self.pfs.read_cached(entry.record.name, entry.manifest, read_back)
                writes, payload_bytes = await loop.run_in_executor(self.pfs.behind, _writes, name, values, repair)
                self.counts.refused_samples += len(refused)
                self.counts.page_cache_samples += len(values)
                self.counts.page_cache_bytes += payload_bytes
                self.counts.not_in_page_cache += len(not_cached)
            take_over = [handed[i] for i in wanted.tolist() if i in handed]
            if take_over and not hand_over:
                self.counts.refused_samples += len(take_over)
                take_over = []
            if take_over:
                got = await loop.run_in_executor(self.pfs.behind, self._handed, request, take_over, lengths)
                handed_writes, payload_bytes = _writes(name, got, repair)
                self.counts.refused_samples += len(take_over) - len(got)
                self.counts.handed_samples += len(got)
                self.counts.handed_bytes += payload_bytes
                writes += handed_writes
            await self.store.put_many(writes)
        finally:
            claims.release(db, mine, me)
            self._budget.give(nbytes)
        return pb.CacheBehindReply(queued=len(writes), not_in_page_cache=not_cached)

    def _wanted(self, db: str, ids: np.ndarray) -> tuple[np.ndarray, set[int]]:
        """The distinct ``ids`` neither cached (intact) nor queued; and those cached corrupt."""
        distinct = np.unique(ids)
        cached, corrupt = self.store.get_many(db, distinct.tolist())
        queued = self.store.queued_values(db, distinct.tolist())
        keep = [hit is None and int(i) not in queued for i, hit in zip(distinct.tolist(), cached)]
        return distinct[np.array(keep, dtype=bool)], set(corrupt)

    def _handed(
        self, request: pb.CacheBehindRequest, samples: list[pb.Sample], lengths: np.ndarray
    ) -> dict[int, bytes]:
        """Cache values of the handed samples whose bytes the segment gives
        in the manifest's length; none from a segment of another user."""
        out: dict[int, bytes] = {}
        for sample in samples:
            length = int(lengths[sample.id])
            if sample.length != length:
                continue
            payload = self.shm.read_own(request.shm_name, request.shm_size, sample.shm_offset, length)
            if payload is not None:
                out[sample.id] = encode_value(payload)
        return out


def _writes(db: bytes, values: dict[int, bytes], repair: set[int]) -> tuple[list[PendingWrite], int]:
    """The cache writes of ``values`` (cache values by id), and their payload bytes."""
    writes = [PendingWrite(db, i, value, repair=i in repair) for i, value in values.items()]
    return writes, sum(map(len, values.values())) - CHECKSUM_BYTES * len(values)
