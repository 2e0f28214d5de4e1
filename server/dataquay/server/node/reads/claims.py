"""Who reads which sample from the PFS: one read per sample, however many want it.

A job may read while its staging runs, and several parts of the daemon then
want the same not-yet-cached sample at once: the stager, a rank's read that
missed, the overflow's reads ahead of the ranks. Each claims the ids it is
about to read; a claimed id is not read again by anyone else, who waits for
the claimant's value instead. So each sample costs the PFS its bytes once
over staging and the first epoch.

A staging run reserves everything it is going to read when it starts
(:meth:`PfsClaims.reserve`, one flag per sample), and claims a job of ranges
from its reservation when it queues the job, long before a thread reads it.
A rank must not wait behind that queue: a reservation, or a claim not yet
started, passes to the first reader that needs the sample now (``steal``);
the stager's thread, marking its ranges started just before it reads them
(:meth:`PfsClaims.start`), finds the stolen ids gone and skips them. A claim
once started is waited for. Reads ahead of the ranks (the overflow) never
steal: what staging reserved is not theirs to read. Claims end with a
value, or with None (the read failed or was dropped), after which a waiter
reads for itself.

Thread-safe: the stager's threads start and resolve claims, the event loop
takes and releases them; waiters on the loop wait through
:func:`asyncio.wrap_future`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

#: What a claim ends with: the sample's cache value, or None when its read did not deliver it.
Value = bytes | None


@dataclass
class _Claim:
    owner: object
    started: bool
    #: Taken from a staging run's reservation: its value goes into the cache.
    staged: bool = False
    future: Future[Value] = field(default_factory=Future)


class PfsClaims:
    """The samples being read from the PFS, per cache database; see the module notes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, int], _Claim] = {}
        self._reserved: dict[str, tuple[object, np.ndarray]] = {}

    def reserve(self, db: str, owner: object, ids: np.ndarray, num_samples: int) -> None:
        """Reserves ``ids`` of ``db`` for ``owner``'s run (one run per database
        at a time), but for those someone is reading."""
        mask = np.zeros(num_samples, dtype=bool)
        mask[ids] = True
        with self._lock:
            claimed = [i for d, i in self._claims if d == db]
            mask[claimed] = False  # being read: queued once read
            self._reserved[db] = (owner, mask)

    def narrow(self, db: str, owner: object, ids: np.ndarray) -> None:
        """Keeps of ``owner``'s reservation only ``ids``: a run reserves all it
        is asked for at once, so that no read meanwhile finds a gap, then
        only what it finds missing."""
        with self._lock:
            held = self._reserved.get(db)
            if held is not None and held[0] is owner:
                kept = np.zeros(len(held[1]), dtype=bool)
                kept[ids] = True
                held[1][:] &= kept

    def unreserve(self, db: str, owner: object) -> None:
        """Drops what ``owner`` reserved and has not claimed."""
        with self._lock:
            held = self._reserved.get(db)
            if held is not None and held[0] is owner:
                del self._reserved[db]

    def claim(
        self,
        db: str,
        ids: Iterable[int],
        owner: object,
        *,
        started: bool,
        steal: bool = False,
        reserved_only: bool = False,
    ) -> tuple[list[int], dict[int, Future[Value]]]:
        """Claims for ``owner`` the ``ids`` no one claimed or reserved (and,
        with ``steal``, those reserved or claimed but not started; with
        ``reserved_only``, only what ``owner`` reserved); returns (the ids now
        ``owner``'s, the futures of the others). ``started`` claims are read at once."""
        mine: list[int] = []
        theirs: dict[int, Future[Value]] = {}
        with self._lock:
            reserver, reserved = self._reserved.get(db, (None, None))
            for sample_id in ids:
                key = (db, sample_id)
                held = self._claims.get(key)
                if held is None and reserved is not None and reserved[sample_id]:
                    if reserver is owner or steal:
                        reserved[sample_id] = False
                        self._claims[key] = _Claim(owner, started, staged=True)
                        mine.append(sample_id)
                    else:
                        held = self._claims[key] = _Claim(reserver, False, staged=True)
                        reserved[sample_id] = False
                        theirs[sample_id] = held.future
                elif held is not None and held.owner is owner:
                    held.started = held.started or started
                    mine.append(sample_id)
                elif reserved_only:
                    continue
                elif held is None:
                    self._claims[key] = _Claim(owner, started)
                    mine.append(sample_id)
                elif steal and not held.started and not held.future.done():
                    held.owner, held.started = owner, True
                    mine.append(sample_id)
                else:
                    theirs[sample_id] = held.future
        return mine, theirs

    def reserved_mask(self, db: str, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` a staging run reserved and has not claimed yet."""
        with self._lock:
            held = self._reserved.get(db)
            return np.zeros(len(ids), dtype=bool) if held is None else held[1][ids]

    def coming_mask(self, db: str, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` this node's staging will bring into its cache:
        reserved by a run, or being read from its reservation (by the run,
        or by a read that took it over). Other reads (reads ahead of the
        ranks, say) need not keep what they read, and are not counted."""
        with self._lock:
            held = self._reserved.get(db)
            mask = np.zeros(len(ids), dtype=bool) if held is None else held[1][ids]
            if self._claims:
                claims = self._claims
                staged = ((claim := claims.get((db, i))) is not None and claim.staged for i in ids.tolist())
                mask |= np.fromiter(staged, dtype=bool, count=len(ids))
            return mask

    def staging(self, db: str) -> bool:
        """Whether a staging run of ``db`` holds a reservation."""
        with self._lock:
            return db in self._reserved

    def start(self, db: str, ids: Iterable[int], owner: object) -> list[int]:
        """Marks ``owner``'s claims on ``ids`` started; returns those still ``owner``'s."""
        kept: list[int] = []
        with self._lock:
            for sample_id in ids:
                held = self._claims.get((db, sample_id))
                if held is not None and held.owner is owner:
                    held.started = True
                    kept.append(sample_id)
        return kept

    def resolve(self, db: str, values: Mapping[int, bytes], owner: object) -> None:
        """Hands ``values`` to whoever waits for ``owner``'s claims on them; the
        claims stay until released (the values are not queued for the cache yet)."""
        with self._lock:
            ready = [
                (held.future, value)
                for i, value in values.items()
                if (held := self._claims.get((db, i))) is not None and held.owner is owner
            ]
        for future, value in ready:
            if not future.done():
                future.set_result(value)

    def release(self, db: str, ids: Iterable[int], owner: object) -> None:
        """Ends ``owner``'s claims on ``ids``; a waiter of one never resolved gets None."""
        ended: list[Future[Value]] = []
        with self._lock:
            for sample_id in ids:
                held = self._claims.get((db, sample_id))
                if held is not None and held.owner is owner:
                    del self._claims[(db, sample_id)]
                    ended.append(held.future)
        for future in ended:
            if not future.done():
                future.set_result(None)


async def wait_for(futures: Mapping[int, Future[Value]]) -> dict[int, bytes]:
    """The values others' claims ended with, by id; an id whose read did not deliver is left out."""
    if not futures:
        return {}
    ids = list(futures)
    got = await asyncio.gather(*(asyncio.wrap_future(futures[i]) for i in ids))
    return {i: value for i, value in zip(ids, got) if value is not None}
