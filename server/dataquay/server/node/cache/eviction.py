"""Which cached datasets give way when a staging or an exchange needs room: pure policy, no I/O.

Within a dataset a live job reads, nothing is ever evicted: the job's epochs
would otherwise read from the PFS what the cache was sized to hold. Between
datasets the cache is least recently used: a dataset no live job pins, and
that no one has used for at least the operator's minimum age, gives way to
one being staged, oldest use first; the last one taken gives only what is
still missing. A holding a live job pins may still hold samples no live job's
placement gives this node (its share moved elsewhere when a node was lost,
came back or joined): when the unpinned holdings are not room enough, those
go, oldest holding first, and never a sample a live job will read here. Each
holding is one cache sub-database (one version of a dataset), described by
parallel arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Holdings:
    """The cache's sub-databases, one element each.

    Attributes:
        nbytes: bytes of cache pages each holds.
        last_use: Unix time each was last staged, read or exchanged into.
        pinned: whether a live job (or the operator) pins it.
        orphans: bytes of pages of a pinned holding that no live job's
            placement gives this node (0 where unknown or unpinned).
    """

    nbytes: np.ndarray
    last_use: np.ndarray
    pinned: np.ndarray
    orphans: np.ndarray | None = None


@dataclass(frozen=True)
class Eviction:
    """Bytes to take from one holding: ``whole`` drops it, else its last
    samples go; ``orphans``: only samples no live job's placement gives this node."""

    index: int
    nbytes: int
    whole: bool
    orphans: bool = False


@dataclass(frozen=True)
class Admission:
    """What a staging of ``need`` bytes may expect before it reads anything.

    Attributes:
        need: bytes the staging would add.
        fits: of those, bytes that fit once the evictions are done.
        evictions: what gives way, oldest use first.
    """

    need: int
    fits: int
    evictions: tuple[Eviction, ...]

    @property
    def short(self) -> int:
        """Bytes that fit nowhere: served from the PFS."""
        return self.need - self.fits


def evictable(holdings: Holdings, now: float, min_age: float) -> np.ndarray:
    """Whether each holding may give way: unpinned, not empty, unused for ``min_age`` seconds."""
    return ~holdings.pinned & (holdings.nbytes > 0) & (now - holdings.last_use >= min_age)


def plan_evictions(holdings: Holdings, room: int, now: float, min_age: float) -> tuple[Eviction, ...]:
    """What to evict, least recently used first, to free ``room`` bytes (as
    much as may be, when fewer are evictable). Ties go to the larger holding,
    so that fewer datasets lose their cache. Then, when that is not enough,
    the orphans of pinned holdings, the least recently used holding first: a
    pinned holding is in use, but no live job reads those samples here."""
    if room <= 0:
        return ()
    candidates = np.flatnonzero(evictable(holdings, now, min_age))
    order = candidates[np.lexsort((-holdings.nbytes[candidates], holdings.last_use[candidates]))]
    plan: list[Eviction] = []
    left = room
    for index in order.tolist():
        size = int(holdings.nbytes[index])
        plan.append(Eviction(index, min(size, left), whole=size <= left))
        left -= size
        if left <= 0:
            return tuple(plan)
    orphans = holdings.orphans if holdings.orphans is not None else np.zeros(len(holdings.nbytes), dtype=np.int64)
    with_orphans = np.flatnonzero(holdings.pinned & (orphans > 0))
    for index in with_orphans[np.argsort(holdings.last_use[with_orphans], kind="stable")].tolist():
        size = int(orphans[index])
        plan.append(Eviction(index, min(size, left), whole=False, orphans=True))
        left -= size
        if left <= 0:
            break
    return tuple(plan)


def admit(need: int, free: int, holdings: Holdings, now: float, min_age: float) -> Admission:
    """What of ``need`` bytes fit in ``free`` bytes and what evictions would add."""
    if need <= free:
        return Admission(need, need, ())
    evictions = plan_evictions(holdings, need - max(free, 0), now, min_age)
    freed = sum(e.nbytes for e in evictions)
    return Admission(need, min(need, max(free, 0) + freed), evictions)


def partial_ids(cached: np.ndarray, sizes: np.ndarray, nbytes: int) -> np.ndarray:
    """The ids a partial eviction of ``nbytes`` takes from a holding: its
    highest cached ids, which a staging in id order reaches last.

    Args:
        cached: the holding's cached ids, sorted.
        sizes: bytes each of them takes, in the same order.
        nbytes: bytes to free.
    """
    if nbytes <= 0 or not len(cached):
        return cached[:0]
    taken = np.cumsum(sizes[::-1])
    count = int(np.searchsorted(taken, nbytes)) + 1
    return cached[::-1][:count]
