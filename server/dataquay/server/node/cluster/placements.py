"""Who owns which sample in a job, as this daemon computes it.

Ownership is never looked up: it follows from the job's settings (kept by the
directory, copied here) through the pure functions of
:mod:`dataquay.client.placement`. An epoch's owner array costs one
permutation of N ids, so it is computed once per (job, dataset version, epoch)
and kept. In modes whose owners move, epoch e derives from epoch e-1: those
arrays are also saved under the state dir, so that a restarted daemon steps on
from the last one instead of replaying every epoch since the first.

In modes whose owners never move, a node whose cache cannot hold its share
keeps what fits and the rest is held by nodes whose caches have room
(:mod:`dataquay.server.planning.spill`): the holders follow from the same settings
and from the capacities the directory lists for the job's nodes, so they are
computed again when a node comes back with another ``--cache-size``. In
those modes too, the share of a node lost for longer than ``--heal-after`` is
held by the others (:mod:`.healing`) until it is back. In modes whose owners
move, the share of a node the job record lists absent in an epoch
(:mod:`dataquay.server.planning.absences`) is held by the others in that
epoch, and the exchange moves samples between holders.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dataquay.client.jobs import job_plan
from dataquay.client.placement import MODES, JobPlan, owned_ids, owners
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.dirs import private_dir, private_opener
from dataquay.server.errors import DataquayError
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.node.cluster.healing import healed_holders
from dataquay.server.planning.absences import absent_at
from dataquay.server.planning.capacity import short_of_share
from dataquay.server.planning.spill import NO_HOLDER, spill_holders
from dataquay.server.registry import Registered, Registry

log = logging.getLogger("dataquay.jobs")

#: Owner arrays kept in memory; a daemon serves few jobs at a time.
KEPT_EPOCHS = 8
#: Jobs whose listed capacities are kept (see :meth:`Placements._capacities`).
KEPT_JOBS = 16
#: Owner arrays kept on disk per job (moving modes only).
SAVED_EPOCHS = 3


@dataclass(frozen=True)
class Placement:
    """One epoch of a job, seen from one node."""

    job: jpb.Job
    epoch: int
    owners: np.ndarray  # node index in job.spec.nodes, per sample id
    node_index: int  # this node's index in the job, -1 when it is not in it
    holders: np.ndarray  # node whose cache holds each sample (the owner unless spilled), NO_HOLDER for none
    capacities: tuple[int, ...] = ()  # the job's nodes' capacities the holders were computed with
    lost: tuple[str, ...] = ()  # the nodes whose share the others hold (see .healing)
    #: The node to ask for each sample: its holder, else its owner.
    sources: np.ndarray = field(init=False, repr=False)
    #: The job's nodes, by index (copied once: every read indexes them).
    nodes: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sources = (
            self.owners
            if self.holders is self.owners
            else np.where(self.holders == NO_HOLDER, self.owners, self.holders)
        )
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "nodes", tuple(self.job.spec.nodes))

    @property
    def owners_move(self) -> bool:
        """Whether samples change owner between epochs (an exchange ships them)."""
        return MODES[self.job.spec.mode].owners_move

    def owned(self) -> np.ndarray:
        """The ids this node owns, sorted."""
        if self.node_index < 0:
            return np.empty(0, dtype=np.int64)
        return owned_ids(self.owners, self.node_index)

    def held(self) -> np.ndarray:
        """The ids this node's cache holds for the job (what it stages), sorted:
        those it owns and keeps, and those spilled to it by others."""
        if self.node_index < 0:
            return np.empty(0, dtype=np.int64)
        return owned_ids(self.holders, self.node_index)

    @property
    def held_for_others(self) -> int:
        """How many samples of other nodes this node's cache holds."""
        if self.node_index < 0:
            return 0
        return int(((self.holders == self.node_index) & (self.owners != self.node_index)).sum())


class Placements:
    """Owner arrays of the jobs this daemon serves, computed on first use.

    Args:
        link: the directory, for the jobs' settings.
        node_name: this node, to find its index in a job.
        state_dir: where owner arrays of moving modes are saved (None: memory only).
        lost: the nodes of a job whose share the others hold (none when not given).
    """

    def __init__(
        self,
        link: DirectoryLink,
        node_name: str,
        state_dir: Path | None = None,
        lost: Callable[[jpb.Job], tuple[str, ...]] | None = None,
    ) -> None:
        self.link = link
        self.lost = lost or (lambda job: ())
        self.node_name = node_name
        self.saved_dir = state_dir / "placements" if state_dir is not None else None
        self._kept: dict[tuple[str, str, int], Placement] = {}
        # One computation per (job, dataset version, epoch, job creation,
        # capacities, lost nodes) at a time: callers that ask meanwhile wait for it and take its result.
        self._computing: dict[tuple[str, str, int, float, tuple[int, ...], tuple[str, ...]], asyncio.Lock] = {}
        self._saves = itertools.count()
        self._holders: dict[tuple[str, str, float, tuple[int, ...]], np.ndarray] = {}
        #: Per job: (its record, the listing, the capacities listed there); see :meth:`_capacities`.
        self._listed_capacities: dict[str, tuple[jpb.Job, Mapping[str, jpb.NodeStatus], tuple[int, ...]]] = {}
        #: (job, epoch, absent nodes): whether this node's cache is short of what it holds.
        self._short: dict[tuple[str, int, tuple[str, ...]], bool] = {}

    async def placement(self, job_id: str, entry: Registered, epoch: int | None = None) -> Placement:
        """The job's placement for ``epoch`` (default: the job's current epoch).

        Raises:
            UnknownJobError: neither this node nor the directory knows the job.
            DataquayError: the job was started on another version of the dataset.
        """
        job = await self.link.job(job_id)
        epoch = job.epoch if epoch is None else epoch
        key = (job_id, entry.record.manifest_id, epoch)
        moving = MODES[job.spec.mode].owners_move
        capacities = () if moving else self._capacities(job)
        lost = absent_at(job.absences, epoch) if moving else self.lost(job)
        kept = self._kept.get(key)
        if kept is not None and (kept.job.created_unix, kept.capacities, kept.lost) == (
            job.created_unix,
            capacities,
            lost,
        ):
            return kept
        computing = (*key, job.created_unix, capacities, lost)
        lock = self._computing.setdefault(computing, asyncio.Lock())
        try:
            async with lock:
                kept = self._kept.get(key)
                if kept is not None and (kept.job.created_unix, kept.capacities, kept.lost) == (
                    job.created_unix,
                    capacities,
                    lost,
                ):
                    return kept
                return await self._compute(job, entry, epoch, capacities, lost)
        finally:
            if not lock.locked():
                self._computing.pop(computing, None)

    async def _compute(
        self, job: jpb.Job, entry: Registered, epoch: int, capacities: tuple[int, ...], lost: tuple[str, ...] = ()
    ) -> Placement:
        key = (job.spec.job_id, entry.record.manifest_id, epoch)
        plan = job_plan(job, entry.manifest)
        nodes = list(job.spec.nodes)
        index = nodes.index(self.node_name) if self.node_name in nodes else -1
        loop = asyncio.get_running_loop()
        # Off the loop: a permutation of 10^7 ids takes a good part of a second.
        if MODES[plan.settings.mode].owners_move:
            owner = await loop.run_in_executor(None, self._stepped, job, plan, epoch)
            holders = owner
        else:
            owner = await loop.run_in_executor(None, owners, plan, epoch, None)
            holders = await self._spilled(job, entry, owner, capacities)
        if lost:
            holders = await loop.run_in_executor(None, healed_holders, plan, holders, lost)
        kept = self._kept[key] = Placement(job, epoch, owner, index, holders, capacities, lost)
        while len(self._kept) > KEPT_EPOCHS:
            del self._kept[next(iter(self._kept))]
        return kept

    async def kept_here(self, job_id: str, entry: Registered) -> np.ndarray | None:
        """The ids a live job will read from this node's cache, sorted: what
        its placement gives this node. None when not known here: this node
        is not one of the job's, or its owners move (the exchange decides
        what stays, up to epochs ahead of the job's, see
        :mod:`dataquay.server.node.exchange.sender`)."""
        now = await self.placement(job_id, entry)
        if now.node_index < 0 or now.owners_move:
            return None
        return now.held()

    async def kept_for(self, cache_db: str, registry: Registry) -> np.ndarray | None:
        """The ids of ``cache_db`` that the live jobs on this node will read
        from its cache, sorted (see :meth:`kept_here`); None when not known:
        no job reads it, it is not the registered version, a job's placement
        cannot be computed or this node is not one of a job's."""
        on_db = [
            job
            for job in list(self.link.jobs.values())
            if (not job.spec.nodes or self.node_name in job.spec.nodes)
            and job.spec.dataset in registry.names()
            and registry.get(job.spec.dataset).record.cache_db == cache_db
        ]
        kept = []
        for job in on_db:
            entry = registry.get(job.spec.dataset)
            if job.manifest_id != entry.record.manifest_id:
                return None
            try:
                ids = await self.kept_here(job.spec.job_id, entry)
            except (DataquayError, ValueError):  # a job this node cannot plan: keep what it may read
                return None
            if ids is None:
                return None
            kept.append(ids)
        return np.unique(np.concatenate(kept)) if kept else None

    def short_of_share(self, placement: Placement, entry: Registered, capacity: int) -> bool:
        """Whether this node's cache of ``capacity`` bytes, less the exchange's
        reserve, cannot hold what it holds in ``placement``'s epoch: its share,
        and an absent node's part (worked out once per job, epoch and absent
        nodes; :func:`~dataquay.server.planning.capacity.short_of_share`)."""
        key = (placement.job.spec.job_id, placement.epoch, placement.lost)
        if key not in self._short:
            for old in [k for k in self._short if k[0] == key[0] and k[1] < placement.epoch - 1]:
                del self._short[old]
            held = entry.manifest.sample_length[placement.held()]
            self._short[key] = placement.node_index >= 0 and short_of_share(capacity, held)
        return self._short[key]

    def caches_pfs_reads(self, placement: Placement, entry: Registered, capacity: int) -> bool:
        """Whether what this node reads from the PFS in ``placement``'s epoch
        may go into its cache of ``capacity`` bytes: not where the cache is
        short of its share in a job whose owners move.

        Such a cache holds what staging filled. The exchange passes on what a
        cache holds, so every read cached would add to the short caches'
        holdings, epoch after epoch, up to their capacity, where no exchange
        has room left to move a sample: it stalls, and ranks read from peers.
        """
        return not (placement.owners_move and self.short_of_share(placement, entry, capacity))

    async def holders(self, job: jpb.Job, entry: Registered, lost: tuple[str, ...]) -> np.ndarray:
        """The holders of a job whose owners never move, with the share of the
        ``lost`` nodes held by the others; computed for the asking (the healer
        compares node sets with it), not kept as the job's placement."""
        plan = job_plan(job, entry.manifest)
        loop = asyncio.get_running_loop()
        owner = await loop.run_in_executor(None, owners, plan, 0, None)
        holders = await self._spilled(job, entry, owner, self._capacities(job))
        if lost:
            holders = await loop.run_in_executor(None, healed_holders, plan, holders, lost)
        return holders

    def _capacities(self, job: jpb.Job) -> tuple[int, ...]:
        """The cache capacity of each of the job's nodes as the directory lists
        them (0: not listed, not known). Every read asks: kept until the job's
        record or the listing is replaced (each is a new object when it changes)."""
        listed = self.link.nodes
        kept = self._listed_capacities.get(job.spec.job_id)
        if kept is not None and kept[0] is job and kept[1] is listed:
            return kept[2]
        capacities = tuple(listed[name].info.cache_capacity if name in listed else 0 for name in job.spec.nodes)
        self._listed_capacities[job.spec.job_id] = (job, listed, capacities)
        while len(self._listed_capacities) > KEPT_JOBS:
            del self._listed_capacities[next(iter(self._listed_capacities))]
        return capacities

    async def _spilled(
        self, job: jpb.Job, entry: Registered, owner: np.ndarray, capacities: tuple[int, ...]
    ) -> np.ndarray:
        """The holders of a job whose owners never move, for these capacities:
        the same for every epoch, so computed once."""
        key = (job.spec.job_id, entry.record.manifest_id, job.created_unix, capacities)
        holders = self._holders.get(key)
        if holders is None:
            sizes = entry.manifest.sample_length.astype(np.int64)
            holders = await asyncio.get_running_loop().run_in_executor(
                None, spill_holders, owner, sizes, list(capacities), job.spec.seed
            )
            self._holders[key] = holders
            while len(self._holders) > KEPT_EPOCHS:
                del self._holders[next(iter(self._holders))]
            spilled = int(((holders != owner) & (holders != NO_HOLDER)).sum())
            if spilled or (holders == NO_HOLDER).any():
                log.info(
                    "caches short of their share: samples spilled to nodes with room",
                    extra={
                        "fields": {
                            "job": job.spec.job_id,
                            "spilled": spilled,
                            "uncached": int((holders == NO_HOLDER).sum()),
                        }
                    },
                )
        return holders

    def _stepped(self, job: jpb.Job, plan: JobPlan, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s owners, stepped from the nearest earlier epoch kept or saved."""
        start, current = self._nearest(job, epoch)
        if start == epoch and current is not None:
            return current
        for step in range(start + 1, epoch + 1):
            current = owners(plan, step, current)
        assert current is not None
        self._save(job, epoch, current)
        return current

    def _nearest(self, job: jpb.Job, epoch: int) -> tuple[int, np.ndarray | None]:
        """The latest epoch up to ``epoch`` whose owners are in memory or on disk; (-1, None) if none."""
        for earlier in range(epoch, -1, -1):
            kept = self._kept.get((job.spec.job_id, job.manifest_id, earlier))
            if kept is not None and kept.job.created_unix == job.created_unix:
                return earlier, kept.owners
            saved = self._load(job, earlier)
            if saved is not None:
                return earlier, saved
        return -1, None

    def _path(self, job: jpb.Job, epoch: int) -> Path | None:
        if self.saved_dir is None:
            return None
        created = int(job.created_unix * 1e6)
        return self.saved_dir / job.spec.job_id / f"{job.manifest_id[:16]}-{created}-{epoch}.npy"

    def _load(self, job: jpb.Job, epoch: int) -> np.ndarray | None:
        path = self._path(job, epoch)
        if path is None or not path.exists():
            return None
        try:
            loaded = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            log.warning(
                "ignoring an unreadable saved placement", extra={"fields": {"path": str(path), "error": str(exc)}}
            )
            return None
        return loaded if loaded.shape == (job.num_samples,) else None

    def _save(self, job: jpb.Job, epoch: int, epoch_owners: np.ndarray) -> None:
        path = self._path(job, epoch)
        if path is None:
            return
        try:
            private_dir(path.parent)
            partial = path.with_suffix(f".{os.getpid()}-{next(self._saves)}.tmp.npy")
            with open(partial, "wb", opener=private_opener) as out:
                np.save(out, epoch_owners, allow_pickle=False)
            partial.replace(path)
            saved = sorted(
                (p for p in path.parent.glob("*.npy") if not p.name.endswith(".tmp.npy")),
                key=lambda p: p.stat().st_mtime,
            )
            for old in saved[:-SAVED_EPOCHS]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            log.warning(
                "cannot save a placement; a restart will replay epochs",
                extra={"fields": {"path": str(path), "error": str(exc)}},
            )
