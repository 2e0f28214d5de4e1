"""Healing: this node's cache follows the nodes its jobs lost and got back.

In modes whose owners never move, the share of a node lost for longer than
``--heal-after`` is held by the others (:mod:`.cluster.healing`). The
healer watches the directory's node list and, when the set of lost nodes of
a job changes, brings this node's cache to the holders of the new set:

- samples it is to hold that another node held under the old set are
  fetched from that node first, and only the share of a node that is lost
  now from the PFS (nothing else holds it);
- samples it held under the old set and no longer holds are deleted once
  their new holder has had time to fetch them (twice ``--heal-after``, plus
  the time that node's share takes at ``--heal-bandwidth``).

A daemon that starts into a job whose ranks are already reading (a node that
comes back, or a new node under a name the job lists) treats itself as
having been lost: it fetches its share from the nodes that held it
meanwhile, never from the PFS; what they no longer hold its ranks read as
any miss.

In modes whose owners move, the job record says from which epoch a lost
node is absent (:mod:`dataquay.server.planning.absences`), and the exchange
moves samples between the holders of each epoch. What no exchange brings is
what the absent node held the epoch before its absence: once the job
reaches that epoch, each node fetches its part of it, from the node that
held a sample before the absent one (a spare copy) when it is up, else
from the PFS. A node back takes its share through the exchange.

Fetches go a chunk at a time under the ``--heal-bandwidth`` cap, so
that the ranks' reads keep the network and the PFS. Nothing here changes
which samples the ranks read: only which node a miss is asked of.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from dataquay.client.placement import MODES
from dataquay.client.wire.records import CHECKSUM_BYTES, encode_value
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import DataquayError
from dataquay.server.node.cache.store import Store
from dataquay.server.node.cache.write_queue import PendingWrite
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.healing import lost_nodes_until
from dataquay.server.node.cluster.placements import Placements
from dataquay.server.node.datasets import Datasets
from dataquay.server.node.peers.reads import Peers
from dataquay.server.node.reads.pfs import PfsPool
from dataquay.server.node.reads.service import window_bounds
from dataquay.server.ratelimit import TokenBucket
from dataquay.server.registry import Registered

log = logging.getLogger("dataquay.healing")

#: How often the node list is looked at for a change (seconds).
CHECK_SECONDS = 0.5
#: Payload bytes and ids fetched at once: small enough that the cap is
#: kept over short windows and one chunk never holds much memory.
CHUNK_BYTES = 4 << 20
CHUNK_IDS = 1024
#: Epochs back the healer of a job whose owners move looks for the node that
#: held a sample before an absent node did (a spare copy to fetch it from).
SPARE_EPOCHS = 4
#: Grace periods a sample stays after its node is back, before it is deleted
#: here: the node fetches its share as soon as it registers, and the others
#: notice it a heartbeat later; the margin covers a loaded node.
DROP_AFTER = 2


@dataclass
class HealCounts:
    """What healing moved into and out of this node's cache."""

    peer_samples: int = 0
    peer_bytes: int = 0
    pfs_samples: int = 0
    pfs_bytes: int = 0
    dropped_samples: int = 0
    #: Samples this node is to fetch and has not yet (all jobs).
    pending_samples: int = 0
    #: Nodes of this node's jobs counted lost now.
    lost_nodes: int = 0

    def proto(self) -> pb.HealCounts:
        return pb.HealCounts(**asdict(self))


@dataclass
class _Drop:
    """Samples to delete once their new holder had time to fetch them."""

    due: float
    job: jpb.Job
    db: str
    ids: np.ndarray


@dataclass(frozen=True)
class _Lost:
    """A job's lost nodes, standing while its record and the listing they
    were counted from do, up to ``until`` (unix time)."""

    job: jpb.Job
    listed: Mapping[str, jpb.NodeStatus]
    until: float
    nodes: tuple[str, ...]


@dataclass
class _Seen:
    """The lost nodes a job's cache here was last brought to."""

    created: float
    lost: tuple[str, ...]
    #: The lost nodes a fetch that has not ended yet (or failed) brings it to.
    trying: tuple[str, ...] | None = None


class Healer:
    """Brings this node's cache to its jobs' holders as nodes are lost and come back.

    Args:
        heal_after: seconds a node must be down before it counts lost (0: never; healing off).
        bandwidth: cap on the bytes per second healing fetches (0: uncapped).
    """

    def __init__(
        self,
        node_name: str,
        link: DirectoryLink,
        placements: Placements,
        datasets: Datasets,
        store: Store,
        pfs: PfsPool,
        peers: Peers,
        heal_after: float,
        bandwidth: int,
    ) -> None:
        self.node_name = node_name
        self.link = link
        self.placements = placements
        self.datasets = datasets
        self.store = store
        self.pfs = pfs
        self.peers = peers
        self.heal_after = heal_after
        self.bandwidth = bandwidth
        self.bucket = TokenBucket(bandwidth) if bandwidth > 0 else None
        self.counts = HealCounts()
        self._seen: dict[str, _Seen] = {}
        self._drops: list[_Drop] = []
        self._failed: dict[str, str] = {}
        #: Per job whose owners move: (job creation, the epochs whose newly absent nodes' share was fetched here).
        self._healed_from: dict[str, tuple[float, set[int]]] = {}
        #: Per job: its lost nodes, counted again only once they may have changed.
        self._lost: dict[str, _Lost] = {}

    def lost(self, job: jpb.Job) -> tuple[str, ...]:
        """The job's nodes whose share the others hold now (what reads ask by).

        Every read asks, and counting takes a pass over the job's nodes (a
        millisecond at 4,096 nodes): the count is kept until the job's record
        or the directory's listing is replaced (each is a new object when it
        changes) or the next down node's grace period ends."""
        if self.heal_after <= 0:
            return ()
        listed, now = self.link.nodes, time.time()
        kept = self._lost.get(job.spec.job_id)
        if kept is not None and kept.job is job and kept.listed is listed and now < kept.until:
            return kept.nodes
        nodes, until = lost_nodes_until(job, listed, self.heal_after, now)
        self._lost[job.spec.job_id] = _Lost(job, listed, until, nodes)
        return nodes

    async def run(self) -> None:
        """Watches the jobs until cancelled."""
        if self.heal_after <= 0:
            return
        await self.link.registered.wait()
        while True:
            try:
                await self._check()
            except Exception:  # a bug here must not stop healing for good
                log.exception("healing failed; retrying")
            # An epoch entered may start a job's absence: its share is fetched
            # while the exchange into that epoch runs, not a check later.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.link.epoch_entered.wait(), CHECK_SECONDS)
            self.link.epoch_entered.clear()

    async def _check(self) -> None:
        jobs = [job for job in self.link.jobs.values() if self.node_name in job.spec.nodes]
        self.counts.lost_nodes = len({name for job in jobs for name in self.lost(job)})
        for dropped in set(self._seen) - {job.spec.job_id for job in jobs}:
            del self._seen[dropped]
        for dropped in set(self._healed_from) - {job.spec.job_id for job in jobs}:
            del self._healed_from[dropped]
        for dropped in set(self._lost) - {job.spec.job_id for job in jobs}:
            del self._lost[dropped]
        for job in jobs:
            try:
                if MODES[job.spec.mode].owners_move:
                    await self._follow_absences(job)
                else:
                    await self._follow(job)
            except DataquayError as exc:
                # Tried again at every check; told once per cause.
                if self._failed.get(job.spec.job_id) != str(exc):
                    log.warning(
                        "healing of a job paused", extra={"fields": {"job": job.spec.job_id, "error": str(exc)}}
                    )
                self._failed[job.spec.job_id] = str(exc)
            else:
                self._failed.pop(job.spec.job_id, None)
        await self._drop_due()

    async def _follow(self, job: jpb.Job) -> None:
        """Brings the job's share here to its current lost nodes, if they changed."""
        job_id, lost = job.spec.job_id, self.lost(job)
        seen = self._seen.get(job_id)
        if seen is None or seen.created != job.created_unix:
            # A daemon that starts into a running job was, for the others,
            # lost (unless no other node was left to hold its share).
            before = tuple(sorted({*lost, self.node_name})) if job.started else lost
            if len(before) >= len(job.spec.nodes):
                before = lost
            seen = self._seen[job_id] = _Seen(job.created_unix, before)
        if seen.lost == lost:
            return
        entry = await self.datasets.entry(job.spec.dataset)
        if entry.record.manifest_id != job.manifest_id:
            return
        await self.store.open_dataset(entry.record.cache_db)
        base = await self.placements.holders(job, entry, ())
        old = await self.placements.holders(job, entry, seen.lost)
        new = await self.placements.holders(job, entry, lost)
        me = list(job.spec.nodes).index(self.node_name)
        if seen.trying != lost:
            seen.trying = lost
            log.info(
                "healing: the job's lost nodes changed",
                extra={"fields": {"job": job_id, "lost": list(lost), "before": list(seen.lost)}},
            )
            gone = np.flatnonzero((old == me) & (new != me))
            if len(gone):
                share = int(entry.manifest.sample_length[gone].sum())
                wait = DROP_AFTER * self.heal_after + (
                    share * len(job.spec.nodes) / self.bandwidth if self.bandwidth else 0.0
                )
                self._drops.append(_Drop(time.monotonic() + wait, job, entry.record.cache_db, gone))
        coming = np.flatnonzero((new == me) & (old != me))
        await self._fetch(job, entry, coming, old, base, lost)
        seen.lost, seen.trying = lost, None

    async def _follow_absences(self, job: jpb.Job) -> None:
        """Fetches, in a job whose owners move, the samples this node holds
        from an epoch whose holders leave a node out: those that node held
        the epoch before, which no exchange will bring. Each such epoch is
        healed once the job has reached the epoch before it (its exchange is
        then under way), from spare copies on the nodes that held them before
        the absent node, then from the PFS."""
        job_id = job.spec.job_id
        kept = self._healed_from.get(job_id)
        if kept is None or kept[0] != job.created_unix:
            kept = self._healed_from[job_id] = (job.created_unix, set())
        healed = kept[1]
        starts = {a.from_epoch for a in job.absences} - healed
        for start in sorted(starts):
            if start > job.epoch + 1:
                continue
            if start < job.epoch - 1:  # the job moved on: its exchanges carry what is held now
                healed.add(start)
                continue
            entry = await self.datasets.entry(job.spec.dataset)
            if entry.record.manifest_id != job.manifest_id:
                return
            await self.store.open_dataset(entry.record.cache_db)
            at = await self.placements.placement(job_id, entry, start)
            before = await self.placements.placement(job_id, entry, start - 1)
            left = tuple(name for name in at.lost if name not in before.lost)
            nodes = list(job.spec.nodes)
            left_index = [nodes.index(name) for name in left]
            coming = np.flatnonzero((at.holders == at.node_index) & np.isin(before.holders, left_index))
            if len(coming):
                log.info(
                    "healing: taking over the share of nodes absent from an epoch on",
                    extra={"fields": {"job": job_id, "epoch": start, "absent": left, "samples": len(coming)}},
                )
                spares = await self._spare_holders(job_id, entry, start, before.holders, left_index)
                await self._fetch(job, entry, coming, spares, before.holders, left)
            healed.add(start)

    async def _spare_holders(
        self, job_id: str, entry: Registered, start: int, before: np.ndarray, left: list[int]
    ) -> np.ndarray:
        """Per sample, the node that held it last before the ``left`` nodes
        did, up to SPARE_EPOCHS before ``start`` (``before``: the holders of
        the epoch before it): a node that gave a sample away may keep it as a
        spare copy. A ``left`` node where none is found."""
        spares = before.copy()
        for back in range(2, SPARE_EPOCHS + 1):
            still = np.isin(spares, left)
            if start - back < 0 or not still.any():
                break
            earlier = await self.placements.placement(job_id, entry, start - back)
            spares[still] = earlier.holders[still]
        return spares

    async def _fetch(
        self, job: jpb.Job, entry: Registered, ids: np.ndarray, old: np.ndarray, base: np.ndarray, lost: tuple[str, ...]
    ) -> None:
        """Fetches the ``ids`` not cached here: from their holder under the old
        set when it is up, then from the PFS those whose node is lost now,
        each read once on this node with the trainers' reads of it."""
        db = entry.record.cache_db
        ids = ids[~self.store.cached_mask(db, ids)] if len(ids) else ids
        nodes = list(job.spec.nodes)
        lost_index = [nodes.index(name) for name in lost]
        self.counts.pending_samples += len(ids)
        left = len(ids)
        lengths = entry.manifest.sample_length
        try:
            for chunk in _chunks(ids, lengths):
                wanted = chunk[~self.store.cached_mask(db, chunk)]  # the trainers' reads cache some meanwhile
                got = await self._from_peers(entry, nodes, old, wanted)
                missing = np.array([i for i in wanted.tolist() if i not in got], dtype=np.int64)
                from_pfs = missing[np.isin(base[missing], lost_index)]
                if len(from_pfs):
                    await self._pace(int(lengths[from_pfs].sum()))
                    values, theirs = await self.pfs.read_once(
                        entry.record.name, db, entry.manifest, from_pfs, functools.partial(self._keep, db)
                    )
                    await self._keep(db, theirs)
                    self.counts.pfs_samples += len(values)
                    self.counts.pfs_bytes += sum(len(v) - CHECKSUM_BYTES for v in values.values())
                self.counts.pending_samples -= len(chunk)
                left -= len(chunk)
                if self.store.full:
                    log.warning("healing stopped: the cache is full", extra={"fields": {"job": job.spec.job_id}})
                    return
        finally:
            self.counts.pending_samples -= left

    async def _from_peers(
        self, entry: Registered, nodes: list[str], old: np.ndarray, chunk: np.ndarray
    ) -> dict[int, bytes]:
        """What the old holders of ``chunk`` that are up hand over, kept here."""
        got: dict[int, bytes] = {}
        holder = old[chunk]
        for index in np.unique(holder).tolist():
            node = nodes[index]
            if node == self.node_name or index < 0 or self.link.is_down(node):
                continue
            ids = chunk[holder == index]
            address = await self.link.address_of(node)
            await self._pace(int(entry.manifest.sample_length[ids].sum()))
            fetched = await self.peers.fetch(
                node,
                address,
                entry.record.name,
                entry.record.manifest_id,
                ids,
                entry.manifest.sample_length,
                self.link.registered_at(node),
                self.link.bulk_address_of(node),
            )
            for sample_id, (data, digest) in fetched.items():
                got[sample_id] = encode_value(data, digest)
                self.counts.peer_samples += 1
                self.counts.peer_bytes += len(data)
        await self._keep(entry.record.cache_db, got)
        return got

    async def _keep(self, db: str, values: dict[int, bytes]) -> None:
        name = db.encode()
        await self.store.put_many([PendingWrite(name, sample_id, value) for sample_id, value in values.items()])

    async def _pace(self, nbytes: int) -> None:
        if self.bucket is not None:
            wait = self.bucket.reserve(nbytes)
            if wait > 0:
                await asyncio.sleep(wait)

    async def _drop_due(self) -> None:
        """Deletes the samples whose time came, but those this node holds again."""
        now = time.monotonic()
        due = [drop for drop in self._drops if drop.due <= now]
        self._drops = [drop for drop in self._drops if drop.due > now]
        for drop in due:
            try:
                entry = await self.datasets.entry(drop.job.spec.dataset)
                current = await self.placements.holders(drop.job, entry, self.lost(drop.job))
            except DataquayError:
                continue
            me = list(drop.job.spec.nodes).index(self.node_name)
            ids = drop.ids[current[drop.ids] != me]
            removed = await self.store.discard(drop.db, ids)
            self.counts.dropped_samples += removed
            log.info(
                "healing: dropped the samples their node took back",
                extra={"fields": {"job": drop.job.spec.job_id, "samples": removed}},
            )


def _chunks(ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """``ids`` cut into runs of at most CHUNK_BYTES (one sample at least) and CHUNK_IDS."""
    return [
        ids[at : min(at + CHUNK_IDS, stop)]
        for start, stop in window_bounds(lengths[ids], CHUNK_BYTES)
        for at in range(start, stop, CHUNK_IDS)
    ]
