"""The node cache manager: who each cached dataset is charged to, when it was
last used, who pins it, and what gives way when a staging or an exchange needs
room (the policy is :mod:`.eviction`'s and :mod:`dataquay.server.quotas`', pure; this module
does their I/O).

A daemon under systemd serves every user of its node for weeks: without it,
finished jobs' datasets fill the cache for good and every new one is read
from the PFS each epoch. What it keeps per holding (one dataset version's
sub-database) is small and saved under the state dir as JSON, so that the
order of last use survives a restart. Times are the Unix clock: "unused for
a day" means a day of the calendar, across restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES
from dataquay.server.dirs import private_opener
from dataquay.server.errors import CacheQuotaError, InvalidRequestError
from dataquay.server.node.cache.eviction import Eviction, Holdings, admit, partial_ids, plan_evictions
from dataquay.server.node.cache.store import Store
from dataquay.server.planning.capacity import refill_margin, value_bytes
from dataquay.server.quotas import Quota, charged_to, exceeded
from dataquay.server.registry import Registered, Registry
from dataquay.server.sizes import format_bytes

log = logging.getLogger("dataquay.cache")

#: The operator's pin, as :attr:`Holding.pinned_by` names it.
OPERATOR = "operator"
#: A staging run's pin, as :attr:`Holding.pinned_by` names it.
STAGING = "staging"
#: Seconds between saves of last uses that only reads changed.
SAVE_SECONDS = 60.0


@dataclass
class Use:
    """What the manager keeps of one holding."""

    uid: int
    gids: list[int]
    last_use: float
    pinned: bool = False


@dataclass(frozen=True)
class Holding:
    """One holding as ``dataquay cache ls`` and ``dataquay status`` show it."""

    cache_db: str
    datasets: tuple[str, ...]
    nbytes: int
    samples: int
    last_use: float
    uid: int
    pinned_by: tuple[str, ...]


@dataclass(frozen=True)
class Evicted:
    """What one eviction took: ``nbytes`` of pages of ``holding``, all of it when ``whole``."""

    holding: Holding
    nbytes: int
    whole: bool


@dataclass(frozen=True)
class Admitted:
    """What a staging was told before it read anything (see :class:`.eviction.Admission`)."""

    need: int
    fits: int
    evicted: tuple[Evicted, ...]


@dataclass(frozen=True)
class UserUse:
    """Bytes charged to one user or group, and its quota (0: none)."""

    kind: str
    ident: int
    nbytes: int
    quota: int = 0
    quota_text: str = ""


class CacheManager:
    """Eviction, quotas and pins over one :class:`Store`.

    Args:
        store: the cache.
        registry: the datasets registered here (names of the holdings).
        state_dir: where the last uses are saved.
        min_age: seconds a holding must be unused before it may give way.
        quotas: the operator's quotas.
        job_pins: the live jobs' pins, job ids per cache sub-database.
        staging_left: the fraction of its bytes each staging run under way
            has still to write, by cache sub-database: of the room it was
            admitted to, what a later admission must not count free.
        job_holds: the ids the live jobs' placements give this node in a
            cache sub-database, sorted; None when not known (all are kept).
    """

    def __init__(
        self,
        store: Store,
        registry: Registry,
        state_dir: Path,
        min_age: float,
        quotas: tuple[Quota, ...] = (),
        job_pins: Callable[[], Mapping[str, list[str]]] = dict,
        staging_left: Callable[[], Mapping[str, float]] = dict,
        job_holds: Callable[[str], Awaitable[np.ndarray | None]] | None = None,
    ) -> None:
        self.store = store
        self.job_holds = job_holds
        self.registry = registry
        self.path = Path(state_dir) / "cache_use.json"
        self.min_age = min_age
        self.quotas = quotas
        self.job_pins = job_pins
        self.staging_left = staging_left
        #: Bytes of pages each staging was admitted to, by cache sub-database.
        self._admitted: dict[str, int] = {}
        #: What is kept per holding, by its cache sub-database.
        self._uses: dict[str, Use] = {}
        #: One admission or eviction at a time: each plans from what the one before left.
        self._planning = asyncio.Lock()
        #: Samples and bytes evicted, for the metrics.
        self.evicted_samples = 0
        self.evicted_bytes = 0

    # ----------------------------------------------------------- state

    def load(self) -> None:
        """Reads the saved uses of what the cache holds (opened first); a
        holding it does not know counts as unused since the epoch."""
        try:
            saved = json.loads(self.path.read_text())
            held = self.store.writer.payload_bytes
            self._uses = {db: Use(**use) for db, use in saved.items() if db.encode() in held}
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError) as exc:
            log.error(
                "cache uses unreadable; every holding counts as long unused",
                extra={"fields": {"path": str(self.path), "error": str(exc)}},
            )

    def save(self) -> None:
        """Writes the uses to a temporary name and renames it: a crash leaves the old file or the new."""
        tmp = self.path.with_suffix(".tmp")
        try:
            with open(tmp, "w", opener=private_opener) as out:
                json.dump({db: asdict(use) for db, use in self._uses.items()}, out)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("cannot save the cache uses", extra={"fields": {"path": str(self.path), "error": str(exc)}})

    def used(self, cache_db: str) -> None:
        """Notes a read of ``cache_db`` (from any thread; saved by :meth:`run_saver`)."""
        use = self._uses.get(cache_db)
        if use is not None:
            use.last_use = time.time()

    async def run_saver(self) -> None:
        """Saves the uses every :data:`SAVE_SECONDS`, so that reads' last uses survive a crash."""
        while True:
            await asyncio.sleep(SAVE_SECONDS)
            self.save()

    def _charge(self, cache_db: str, uid: int, gids: frozenset[int]) -> None:
        """Charges ``cache_db`` to its first stager and notes its use now."""
        use = self._uses.get(cache_db)
        if use is None:
            self._uses[cache_db] = Use(uid, sorted(gids), time.time())
        else:
            use.last_use = time.time()
        self.save()

    # -------------------------------------------------------- holdings

    def holdings(self) -> list[Holding]:
        """Every cache sub-database, registered or left by a replaced version, by name."""
        names: dict[str, list[str]] = {}
        for name in self.registry.names():
            names.setdefault(self.registry.get(name).record.cache_db, []).append(name)
        pins = self.job_pins()
        rows = []
        for raw, nbytes in sorted(self.store.writer.payload_bytes.items()):
            db = raw.decode()
            use = self._uses.get(db)
            pinned_by = tuple(pins.get(db, ())) + ((OPERATOR,) if use is not None and use.pinned else ())
            rows.append(
                Holding(
                    db,
                    tuple(names.get(db, ())),
                    nbytes,
                    self.store.writer.cached.count(raw),
                    use.last_use if use is not None else 0.0,
                    use.uid if use is not None else -1,
                    pinned_by,
                )
            )
        return rows

    def _arrays(self, rows: list[Holding], keep: str = "", orphans: Mapping[str, np.ndarray] | None = None) -> Holdings:
        """The policy's view of ``rows``, in bytes of pages; ``keep`` is pinned too (what is staged)."""
        orphans = orphans or {}
        return Holdings(
            nbytes=np.array([self._pages(r.nbytes) for r in rows], dtype=np.int64),
            last_use=np.array([r.last_use for r in rows], dtype=np.float64),
            pinned=np.array([bool(r.pinned_by) or r.cache_db == keep for r in rows], dtype=bool),
            orphans=np.array([self._orphan_pages(r, orphans.get(r.cache_db)) for r in rows], dtype=np.int64),
        )

    async def _orphans(self, rows: list[Holding], keep: str = "") -> dict[str, np.ndarray]:
        """The cached ids of each holding pinned by live jobs alone that none
        of their placements gives this node. A holding being staged, pinned
        by the operator or by a job whose placement is not known keeps all."""
        if self.job_holds is None:
            return {}
        found = {}
        for row in rows:
            if not row.pinned_by or row.cache_db == keep or {OPERATOR, STAGING} & set(row.pinned_by):
                continue
            holds = await self.job_holds(row.cache_db)
            if holds is None:
                continue
            cached = self.store.writer.cached.ids(row.cache_db.encode())
            orphans = cached[~np.isin(cached, holds, assume_unique=True)]
            if len(orphans):
                found[row.cache_db] = orphans
        return found

    def _orphan_pages(self, row: Holding, orphans: np.ndarray | None) -> int:
        """Bytes of pages ``orphans`` of ``row`` take, at the holding's mean sample size."""
        if orphans is None or not row.samples:
            return 0
        return self._pages(row.nbytes) * len(orphans) // row.samples

    def _pages(self, payload: int) -> int:
        """Bytes of pages ``payload`` bytes take, at the cache's own ratio."""
        total = sum(self.store.writer.payload_bytes.values())
        return int(payload * self.store.space.live_bytes / total) if total else payload

    def users(self) -> list[UserUse]:
        """Bytes charged to each user, and to each group with a quota."""
        rows = self.holdings()
        charged: dict[int, int] = {}
        for row in rows:
            charged[row.uid] = charged.get(row.uid, 0) + row.nbytes
        limits = {(q.kind, q.ident): q for q in self.quotas}
        out = [
            UserUse("user", uid, nbytes, *_limit(limits.get(("user", uid)))) for uid, nbytes in sorted(charged.items())
        ]
        owner_uid, owner_gids, nbytes_of = self._owners(rows)
        for quota in self.quotas:
            if quota.kind == "group":
                used = int(nbytes_of[charged_to(quota, owner_uid, owner_gids)].sum())
                out.append(UserUse("group", quota.ident, used, quota.limit, quota.text))
        return out

    def _owners(self, rows: list[Holding]) -> tuple[np.ndarray, list[frozenset[int]], np.ndarray]:
        uses = [self._uses.get(r.cache_db) for r in rows]
        return (
            np.array([r.uid for r in rows], dtype=np.int64),
            [frozenset(u.gids) if u is not None else frozenset() for u in uses],
            np.array([r.nbytes for r in rows], dtype=np.int64),
        )

    # ------------------------------------------------------- admission

    def free(self, leave_room: bool) -> int:
        """Bytes of pages a staging may still add, those the runs under way will take counted out."""
        space = self.store.space
        room = space.capacity - space.live_bytes - space.reserved_bytes - refill_margin(space.capacity)
        promised = sum(self._admitted.get(db, 0) * left for db, left in self.staging_left().items())
        return room - int(promised) - (space.exchange_reserve if leave_room else 0)

    async def admit(
        self, entry: Registered, ids: np.ndarray, uid: int, gids: frozenset[int], leave_room: bool = False
    ) -> Admitted:
        """Checks the caller's quotas, evicts what the policy gives way and
        says what of the staging of ``ids`` will fit.

        Raises:
            CacheQuotaError: the staging would pass a quota of ``uid`` or ``gids``, named.
        """
        async with self._planning:
            return await self._admit(entry, ids, uid, gids, leave_room)

    async def _admit(
        self, entry: Registered, ids: np.ndarray, uid: int, gids: frozenset[int], leave_room: bool
    ) -> Admitted:
        db = entry.record.cache_db
        missing = ids[~self.store.cached_mask(db, ids)]
        lengths = entry.manifest.sample_length[missing]
        rows = self.holdings()
        owner_uid, owner_gids, nbytes = self._owners(rows)
        mine = np.array([r.cache_db == db for r in rows], dtype=bool)
        if not mine.any() or self._uses.get(db) is None:  # not yet charged: it will be, to the caller
            owner_uid, owner_gids = (
                np.where(mine, uid, owner_uid),
                [gids if m else g for m, g in zip(mine.tolist(), owner_gids)],
            )
        over = exceeded(self.quotas, uid, gids, int(lengths.sum()), owner_uid, owner_gids, nbytes)
        if over is not None:
            raise _quota_error(f"staging {entry.record.name!r}", int(lengths.sum()), *over)
        self._charge(db, uid, gids)
        need = int(value_bytes(lengths + CHECKSUM_BYTES).sum())
        free = self.free(leave_room)
        orphans = await self._orphans(rows, keep=db) if need > free else {}
        admission = admit(need, free, self._arrays(rows, db, orphans), time.time(), self.min_age)
        evicted = await self._evict(rows, admission.evictions, "staging", entry.record.name, orphans)
        self._admitted[db] = admission.fits
        return Admitted(admission.need, admission.fits, evicted)

    def check_arrivals(self, cache_db: str, nbytes: int) -> None:
        """Refuses ``nbytes`` of exchanged samples of ``cache_db`` that would
        pass a quota of the user it is charged to (the sender offers them
        again later; the job reads them from their holder meanwhile); notes
        the use of what it takes.

        Raises:
            CacheQuotaError: naming the quota.
        """
        use = self._uses.get(cache_db)
        if use is None:
            return
        if self.quotas:
            owner_uid, owner_gids, charged = self._owners(self.holdings())
            over = exceeded(self.quotas, use.uid, frozenset(use.gids), nbytes, owner_uid, owner_gids, charged)
            if over is not None:
                raise _quota_error(f"exchanged samples of {cache_db}", nbytes, *over)
        use.last_use = time.time()

    async def make_room(self, nbytes: int) -> int:
        """Evicts up to ``nbytes`` of pages for an exchange's arrivals; returns what was evicted."""
        async with self._planning:
            rows = self.holdings()
            orphans = await self._orphans(rows)
            plan = plan_evictions(self._arrays(rows, orphans=orphans), nbytes, time.time(), self.min_age)
            return sum(e.nbytes for e in await self._evict(rows, plan, "exchange", "", orphans))

    # ------------------------------------------------------- operators

    def find(self, name: str) -> Holding:
        """The holding a dataset name or a cache sub-database names.

        Raises:
            InvalidRequestError: none does.
        """
        rows = self.holdings()
        found = next((r for r in rows if name in r.datasets or name == r.cache_db), None)
        if found is None:
            known = ", ".join(sorted({n for r in rows for n in r.datasets} | {r.cache_db for r in rows})) or "none"
            raise InvalidRequestError(f"no cached dataset {name!r} on this node (cached: {known})")
        return found

    async def evict(self, name: str, dry_run: bool = False, force: bool = False) -> tuple[Evicted, ...]:
        """Evicts one holding whole (``dataquay cache evict``), or every one
        the policy lets go when ``name`` is empty. A pinned one only with ``force``."""
        async with self._planning:
            return await self._evict_named(name, dry_run, force)

    async def _evict_named(self, name: str, dry_run: bool, force: bool) -> tuple[Evicted, ...]:
        rows = self.holdings()
        if name:
            target = self.find(name)
            if target.pinned_by and not force:
                raise InvalidRequestError(
                    f"{name!r} is pinned by {', '.join(target.pinned_by)}: unpin it, or evict with --force "
                    "(a live job's reads then go to the PFS)"
                )
            index = rows.index(target)
            plan: tuple[Eviction, ...] = (Eviction(index, self._pages(target.nbytes), whole=True),)
        else:
            plan = plan_evictions(self._arrays(rows), 1 << 62, time.time(), self.min_age)
        if dry_run:
            return tuple(Evicted(rows[e.index], e.nbytes, e.whole) for e in plan)
        return await self._evict(rows, plan, "operator", "")

    def pin(self, name: str, pinned: bool) -> Holding:
        """Pins (or unpins) a holding against eviction, as a live job does."""
        target = self.find(name)
        use = self._uses.setdefault(target.cache_db, Use(-1, [], target.last_use))
        use.pinned = pinned
        self.save()
        return self.find(name)

    # -------------------------------------------------------- evicting

    async def _evict(
        self,
        rows: list[Holding],
        plan: tuple[Eviction, ...],
        why: str,
        staging: str,
        orphans: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[Evicted, ...]:
        for eviction in plan:
            row = rows[eviction.index]
            if eviction.orphans:
                samples, freed = await self._evict_part(row, eviction.nbytes, (orphans or {})[row.cache_db])
            elif eviction.whole:
                samples = await self.store.drop_dataset(row.cache_db)
                freed = row.nbytes
                self._uses.pop(row.cache_db, None)
            else:
                samples, freed = await self._evict_part(row, eviction.nbytes)
            self.evicted_samples += samples
            self.evicted_bytes += freed
            log.info(
                "evicted from the cache",
                extra={
                    "fields": {
                        "cache_db": row.cache_db,
                        "datasets": ",".join(row.datasets),
                        "samples": samples,
                        "bytes": freed,
                        "whole": eviction.whole,
                        "orphans": eviction.orphans,
                        "for": why,
                        "staging": staging,
                        "unused_seconds": round(time.time() - row.last_use),
                    }
                },
            )
        if plan:
            self.save()
        return tuple(Evicted(rows[e.index], e.nbytes, e.whole) for e in plan)

    async def _evict_part(self, row: Holding, nbytes: int, among: np.ndarray | None = None) -> tuple[int, int]:
        """Deletes a holding's highest ids (of ``among`` when given) until its
        tree has freed ``nbytes`` of pages; (samples, payload bytes) freed.

        The ids are first counted at the cache's mean pages per sample, which
        counts other trees' pages too: a second round deletes what the first
        left short, as the tree's own pages measure it."""
        raw = row.cache_db.encode()
        held = self.store.writer.cached.ids(raw)
        left = held if among is None else among
        per_sample = self._pages(row.nbytes) / max(1, len(held))
        payload_before = self.store.writer.payload_bytes.get(raw, 0)
        tree_before = self.store.tree_bytes(row.cache_db)
        removed = 0
        while len(left):
            short = nbytes - (tree_before - self.store.tree_bytes(row.cache_db))
            if short <= 0:
                break
            ids = partial_ids(left, np.full(len(left), per_sample), short)
            removed += await self.store.discard(row.cache_db, ids)
            left = left[: len(left) - len(ids)]
        return removed, payload_before - self.store.writer.payload_bytes.get(raw, 0)


def _limit(quota: Quota | None) -> tuple[int, str]:
    return (quota.limit, quota.text) if quota is not None else (0, "")


def _quota_error(what: str, need: int, quota: Quota, used: int) -> CacheQuotaError:
    return CacheQuotaError(
        f"{what}: {format_bytes(need)} more of the cache is over the {quota.kind} quota {quota.text} "
        f"(cache_quotas): it has {format_bytes(max(0, quota.limit - used))} left of {format_bytes(quota.limit)}; "
        "drop or evict a dataset charged to it (dataquay cache ls), or ask the operator"
    )
