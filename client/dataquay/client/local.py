"""The node daemon's LMDB cache, read directly by a trainer process.

A local hit never goes through the daemon: the client maps the daemon's
environment read-only and reads values in place. The daemon stays the only
writer; it may add samples, create sub-databases and grow the map while
clients read, and each of those is picked up here without a restart.

LMDB's rules shape this module:

* An environment must be opened once per process and kept open: a fresh map
  pays page faults on first touch, and py-lmdb refuses to open the same files
  twice in one process.
* An environment must not be used by a forked child, and must not be closed
  there either while the parent has a read transaction (closing releases the
  parent's reader slots, letting the writer reuse pages the parent is
  reading; py-lmdb always keeps one such idle transaction). So the cache is
  closed in the parent just before a fork, when no read is running, and both
  processes reopen it lazily. A fork that happens during a read leaves the
  child without the local tier: every read is a miss and goes to the daemon.
* A grown map is adopted with ``set_mapsize(0)``, which remaps and so must only
  happen while this process has no transaction open.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb
import numpy as np

from dataquay.client.errors import DataquayError, SampleIdError
from dataquay.client.wire import record_loops
from dataquay.client.wire.records import CHECKSUM_BYTES, checksum

log = logging.getLogger("dataquay.client")

#: Named sub-databases this process can open: as many as the daemon has (one
#: per dataset, plus its own metadata).
MAX_DBS = 1025
#: A sub-database that did not exist is looked up again at most this often.
DB_RETRY_SECONDS = 1.0
#: How long a fork waits for reads on other threads to end before giving up
#: the local tier in the child.
FORK_WAIT_SECONDS = 1.0

_T = TypeVar("_T")
_header = struct.Struct("<Q").unpack_from
# Environments a forked child inherited while the parent was reading: never
# used, never closed here, kept alive so that nothing finalises them.
_inherited: list[object] = []
_caches: weakref.WeakSet[LocalCache] = weakref.WeakSet()
_shared_caches: weakref.WeakValueDictionary[str, LocalCache] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def sample_keys(ids: np.ndarray | Sequence[int]) -> list[bytes]:
    """LMDB keys (8-byte big-endian) of many sample ids.

    Raises:
        TypeError: an id is not an integer.
        SampleIdError: an id is negative.
    """
    if isinstance(ids, np.ndarray):
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"sample ids must be integers, not {ids.dtype}")
        ids = ids.ravel().tolist()
    try:
        return record_loops.sample_keys(ids)
    except OverflowError:
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise SampleIdError(f"sample id {bad} is not in 0..2**64-1") from None


def _as_keys(keys_or_ids: Sequence[bytes] | np.ndarray | Sequence[int]) -> Sequence[bytes]:
    if isinstance(keys_or_ids, np.ndarray):
        return sample_keys(keys_or_ids)
    if keys_or_ids and isinstance(keys_or_ids[0], bytes):
        return keys_or_ids  # type: ignore[return-value]
    return sample_keys(keys_or_ids)  # type: ignore[arg-type]


def _lookup(txn: lmdb.Transaction[memoryview], keys: Sequence[bytes]) -> list[memoryview | None]:
    """Values of ``keys`` in order, None where absent.

    One ``get`` per key: py-lmdb's batched ``getmulti`` costs more per key.
    """
    return list(map(txn.get, keys))


def _verified(values: list[memoryview | None], verify: bool) -> tuple[list[memoryview | None], int, int]:
    """Payload views of cache values (None for a miss, a value shorter than
    its header or, with ``verify``, one whose checksum fails), how many were
    absent and how many failed; :func:`record_loops.payload_copies` without the copy."""
    out: list[memoryview | None] = []
    append = out.append
    header, digest, skip = _header, checksum, CHECKSUM_BYTES
    absent = bad = 0
    for value in values:
        if value is None:
            absent += 1
            append(None)
            continue
        payload = value[skip:]
        if len(value) < skip or (verify and header(value)[0] != digest(payload)):
            bad += 1
            append(None)
            continue
        append(payload)
    return out, absent, bad


class Found(list[_T | None]):
    """Lookups in request order, None for each miss, and how many missed.

    The count saves callers a scan for None (slow on memoryviews, whose
    comparison with None goes through a failed buffer request).
    """

    misses: int = 0

    def set_all_missing(self, count: int) -> None:
        self[:] = [None] * count
        self.misses = count


class LocalCache:
    """Read-only, fork-safe view of the daemon's LMDB environment at ``path``.

    Thread-safe: each call runs in its own read transaction.

    Raises:
        DataquayError: the environment cannot be opened (missing, not
            readable, or not an LMDB environment).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._reset_process_state()
        self._closed = False
        self._env: lmdb.Environment | None = self._open()
        _caches.add(self)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._forking = False
        self._active = 0
        self._mine = threading.local()
        self._dbs: dict[str, lmdb._Database] = {}
        self._db_retry: dict[str, float] = {}
        self._disabled: str | None = None
        self._corrupt = 0

    def _open(self) -> lmdb.Environment:
        try:
            return lmdb.open(
                str(self.path), readonly=True, lock=True, subdir=True, create=False, max_dbs=MAX_DBS, readahead=True
            )
        except lmdb.Error as exc:
            raise DataquayError(f"cannot open the local cache {self.path} read-only: {exc}") from exc

    # ------------------------------------------------------------------ reads

    def get_many(
        self, db: str, keys_or_ids: Sequence[bytes] | np.ndarray | Sequence[int], verify: bool = True
    ) -> Found[bytes]:
        """Payloads of many samples from one read transaction, in request order.

        None marks a miss: not cached, or (with ``verify``) a value whose
        checksum does not match, which is counted in :attr:`corrupt` and left
        for the daemon to re-read and repair.

        Args:
            db: the dataset's sub-database (``DatasetInfo.cache_db``).
            keys_or_ids: sample ids (numpy or a sequence of ints), or keys
                already built with :func:`sample_keys`.
            verify: check each value's xxh3 against its header.
        """
        keys = _as_keys(keys_or_ids)
        out: Found[bytes] = Found()
        begun = self._begin(db)
        if begun is None:
            out.set_all_missing(len(keys))
            return out
        txn, pid = begun
        bad = 0
        try:
            payloads, absent, bad = record_loops.payload_copies(_lookup(txn, keys), verify)
            out.extend(payloads)
            out.misses = absent + bad
        except lmdb.Error as exc:
            self._failed(db, exc)
            out.set_all_missing(len(keys))
        finally:
            self._end(txn, pid, bad)
        return out

    @contextmanager
    def views(
        self, db: str, keys_or_ids: Sequence[bytes] | np.ndarray | Sequence[int], verify: bool = True
    ) -> Iterator[Found[memoryview]]:
        """Like :meth:`get_many`, without copying: memoryviews into the map.

        The views are valid only inside the ``with`` block (the read
        transaction ends with it). Every view in the list when the block
        ends is released, so one kept by mistake raises instead of showing
        bytes the daemon may reuse; one that still has an export (a numpy
        array made from it, say) cannot be released and must not be used
        after the block either.
        """
        keys = _as_keys(keys_or_ids)
        out: Found[memoryview] = Found()
        begun = self._begin(db, held=True)
        if begun is None:
            out.set_all_missing(len(keys))
            yield out
            return
        txn, pid = begun
        bad = 0
        try:
            try:
                payloads, absent, bad = _verified(_lookup(txn, keys), verify)
                out.extend(payloads)
                out.misses = absent + bad
            except lmdb.Error as exc:
                self._failed(db, exc)
                out.set_all_missing(len(keys))
            yield out
        finally:
            release = memoryview.release
            for view in out:
                if view is not None:
                    try:
                        release(view)
                    except BufferError:
                        pass
            self._end(txn, pid, bad, held=True)

    @property
    def corrupt(self) -> int:
        """Values that failed verification in this process so far."""
        return self._corrupt

    @property
    def available(self) -> bool:
        """False once this process cannot use the cache (see the module notes)."""
        return self._disabled is None and not self._closed

    # ------------------------------------------------------- transactions

    def _begin(self, db: str, held: bool = False) -> tuple[lmdb.Transaction[memoryview], int] | None:
        """A read transaction on ``db`` and the process it belongs to, or None
        when this process cannot read the cache or ``db`` does not exist.

        ``held`` marks a transaction that stays open while the caller's code
        runs (views), which is the only way this thread can fork during one.
        """
        with self._lock:
            if self._pid != os.getpid():
                self._after_fork_in_child()
            while self._forking:
                self._idle.wait()
            if self._closed:
                raise DataquayError(f"local cache {self.path} is closed")
            env = self._env
            if env is None:
                env = self._reopen()
                if env is None:
                    return None
            handle = self._dbs.get(db)
            if handle is None:
                handle = self._open_db(env, db)
                if handle is None:
                    return None
            try:
                try:
                    txn = env.begin(db=handle, buffers=True)
                except lmdb.MapResizedError:
                    if not self._adopt_map_size(env):
                        return None
                    txn = env.begin(db=handle, buffers=True)
            except lmdb.Error as exc:
                self._failed(db, exc)
                return None
            self._active += 1
            if held:
                self._mine.held = getattr(self._mine, "held", 0) + 1
            return txn, self._pid

    def _end(self, txn: lmdb.Transaction[memoryview], pid: int, bad: int, held: bool = False) -> None:
        with self._lock:
            if pid != self._pid:
                # Begun by the parent before a fork: ending it here would
                # release the parent's reader slot.
                _inherited.append(txn)
                return
            txn.abort()
            self._active -= 1
            if held:
                self._mine.held -= 1
            self._corrupt += bad
            if not self._active:
                self._idle.notify_all()

    def _failed(self, db: str, exc: lmdb.Error) -> None:
        """A read that LMDB refused: served as misses; the handle is opened afresh."""
        log.warning("local cache %s: reading %s failed, serving it through the daemon: %s", self.path, db, exc)
        self._dbs.pop(db, None)

    def _adopt_map_size(self, env: lmdb.Environment) -> bool:
        """Remaps to the size the daemon grew the map to, if nothing is reading."""
        if self._active:
            return False
        env.set_mapsize(0)
        return True

    def _open_db(self, env: lmdb.Environment, db: str) -> lmdb._Database | None:
        now = time.monotonic()
        if now < self._db_retry.get(db, 0.0):
            return None
        for attempt in range(2):
            try:
                handle = env.open_db(db.encode(), create=False)
            except lmdb.MapResizedError:
                if attempt or not self._adopt_map_size(env):
                    return None
                continue
            except (lmdb.NotFoundError, lmdb.DbsFullError):
                # Nothing staged yet (or more datasets than handles): a miss
                # for now, looked at again after a while.
                self._db_retry[db] = now + DB_RETRY_SECONDS
                return None
            self._dbs[db] = handle
            self._db_retry.pop(db, None)
            return handle
        return None

    def _reopen(self) -> lmdb.Environment | None:
        if self._disabled is not None:
            return None
        try:
            self._env = self._open()
        except DataquayError as exc:
            self._disable(str(exc))
            return None
        return self._env

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        log.warning(
            "local cache %s unavailable in process %d, reading through the daemon: %s", self.path, os.getpid(), reason
        )

    # --------------------------------------------------------------- fork

    def _before_fork(self) -> None:
        with self._lock:
            if self._pid != os.getpid() or self._env is None:
                return
            self._forking = True
            if not getattr(self._mine, "held", 0):
                self._idle.wait_for(lambda: not self._active, FORK_WAIT_SECONDS)
            if not self._active:
                self._env.close()
                self._env = None
                self._dbs.clear()

    def _after_fork_in_parent(self) -> None:
        with self._lock:
            self._forking = False
            self._idle.notify_all()

    def _after_fork_in_child(self) -> None:
        # Runs single-threaded (from the fork hook, or from the pid check
        # when something forked without running Python's hooks). The lock
        # may have been held by a thread that does not exist here.
        env = self._env
        self._reset_process_state()
        if env is not None:
            _inherited.append(env)
            self._env = None
            self._disable("the cache was being read when this process was forked")

    # -------------------------------------------------------------- close

    def close(self) -> None:
        """Closes the environment (in the process that opened it)."""
        with self._lock:
            self._closed = True
            if self._env is not None and self._pid == os.getpid() and not self._active:
                self._env.close()
            self._env = None
            self._dbs.clear()

    def __enter__(self) -> LocalCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedLocalCache:
    """A client's way to the daemon's LMDB: opened on first use and shared with
    the other clients of this process, since LMDB allows one open of an
    environment per process.

    Args:
        path: where the daemon keeps its cache, asked at the first use (a
            client learns it from the daemon); empty when it cannot be read here.
    """

    def __init__(self, path: Callable[[], str]) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._cache: LocalCache | None = None
        self._opened = False

    def get(self) -> LocalCache | None:
        """The cache, opened on first use; None when it cannot be read here."""
        if not self._opened:
            with self._lock:
                if not self._opened and (path := self._path()):
                    try:
                        self._cache = _shared(path)
                    except DataquayError as exc:
                        log.warning("reading every sample through the daemon: %s", exc)
                self._opened = True
        return self._cache

    @property
    def corrupt(self) -> int:
        """Local values that failed checksum verification in this process."""
        cache = self._cache
        return cache.corrupt if cache is not None else 0

    def release(self) -> None:
        """Lets the cache go for good; it closes when no client of this process holds it."""
        with self._lock:
            self._cache = None

    def after_fork_in_child(self) -> None:
        """A new lock: the parent's may have been held by a thread that does not exist here."""
        self._lock = threading.Lock()


def _shared(path: str) -> LocalCache:
    key = os.path.realpath(path)
    with _shared_lock:
        cache = _shared_caches.get(key)
        if cache is None:
            cache = _shared_caches[key] = LocalCache(path)
        return cache


def _each_cache(method: str) -> None:
    for cache in list(_caches):
        getattr(cache, method)()


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()
    _each_cache("_after_fork_in_child")


os.register_at_fork(
    before=lambda: _each_cache("_before_fork"),
    after_in_parent=lambda: _each_cache("_after_fork_in_parent"),
    after_in_child=_after_fork_in_child,
)
