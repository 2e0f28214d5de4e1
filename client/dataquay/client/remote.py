"""Reads of the samples a trainer's local cache lacks: from the PFS, or from the daemon.

A miss of a read for no job is read from the PFS by the client itself, by
the dataset's manifest, as fast as a direct read of the file; the daemon is
told in a notice sent behind the trainer's back and caches the sample from
the page cache (:mod:`dataquay.client.cache_behind`). Where this process
cannot read the PFS (a file it has no access to, a root not mounted here)
and the daemon can, the dataset's misses go to the daemon for
:data:`OWN_READS_RETRY_SECONDS` before the client tries again; a file that
changed since registration fails the read either way. A daemon that caps
its node's PFS reads (``--pfs-bandwidth``) reads every miss itself, under
the cap; so does the daemon of a client with ``DATAQUAY_MISS_READS=daemon``.

Misses of a job's reads, which other nodes' caches may hold, go to the
daemon, payloads through a shared memory segment where the daemon can map
it; how a batch travels is :mod:`dataquay.client.daemon_transports`'. A
training loop never fails because its daemon died: the reader logs one
warning, reads from the PFS itself (by the dataset's manifest), and tries
the daemon again as :mod:`dataquay.client.daemon_health` says. A daemon that
is alive but hung (stopped, swapping) is found out by a Read's deadline,
which grows with the batch's bytes, and is then treated as down the same way.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from dataquay.client.cache_behind import CacheBehindNotices
from dataquay.client.connection import DaemonConnection
from dataquay.client.daemon_health import DaemonHealth
from dataquay.client.daemon_transports import DaemonReply as _Reply  # the name the bulk path's tests take
from dataquay.client.daemon_transports import pick_transports
from dataquay.client.errors import CorruptValueError, DaemonUnavailableError, PfsReadError
from dataquay.client.pfs import PfsReader
from dataquay.client.stats import ReadStats
from dataquay.client.wire.channels import batch_deadline
from dataquay.client.wire.memfd import MemfdSegment
from dataquay.client.wire.shm import Segment, SegmentPool
from dataquay.client.wire.tiers import FALLBACK, PFS
from dataquay.protos import cache_pb2 as pb

if TYPE_CHECKING:
    from dataquay.client.dataset import Dataset

log = logging.getLogger("dataquay.client")

#: Floor of a Read's deadline (see :func:`~dataquay.client.wire.channels.batch_deadline`):
#: twice a daemon's default peer deadline, so that a daemon waiting out a dead
#: peer is not taken for a hung one. A daemon that misses it is treated as down.
READ_FLOOR_SECONDS = 10.0

#: ``client`` (the default): a trainer reads its misses of reads for no job
#: from the PFS itself; ``daemon``: every miss goes through the daemon.
MISS_READS_ENV = "DATAQUAY_MISS_READS"
#: How long a dataset's misses go through the daemon after this process
#: failed to read a file that the daemon could read.
OWN_READS_RETRY_SECONDS = 60.0


class RemoteReader:
    """Reads misses through ``connection`` and counts them into ``stats``.

    Thread-safe. Whether the daemon is down is shared with forked children:
    they start by trying it again when its retry time has come.

    Args:
        connection: the channel to the daemon.
        stats: the counters each read's tier goes to.
        timeout: deadline of the Info call that refreshes :attr:`info`.
        verify: check the checksum of every sample read.
    """

    def __init__(self, connection: DaemonConnection, stats: ReadStats, *, timeout: float, verify: bool) -> None:
        self._connection = connection
        self._stats = stats
        self._timeout = timeout
        self._verify = verify
        #: The daemon's latest Info answer; a restarted daemon's replaces it.
        self.info = pb.InfoReply()
        self._health = DaemonHealth(connection, self._refresh_info)
        self._pfs: dict[tuple[str, str], PfsReader] = {}
        self._segments = SegmentPool(daemon_address=connection.address, token=connection.credentials.token)
        miss_reads = os.environ.get(MISS_READS_ENV, "client").strip().lower() or "client"
        if miss_reads not in ("client", "daemon"):
            raise ValueError(f"{MISS_READS_ENV}={miss_reads!r}: use client or daemon")
        self._own_reads = miss_reads == "client"
        # (dataset, manifest id) -> until when its misses go through the daemon.
        self._daemon_reads_until: dict[tuple[str, str], float] = {}
        self.notices = CacheBehindNotices(connection, self._segments, timeout, daemon_down=self.mark_down)

    @property
    def daemon_down(self) -> bool:
        """Whether the daemon was found unreachable and its retry time has not come."""
        return self._health.down

    def read(
        self, dataset: Dataset, ids: np.ndarray, epoch: int | None = None, *, copy: bool = True, looked_up: bool = True
    ) -> list[bytes]:
        """Samples the local cache lacks, in order: read here from the PFS (a
        read for no job), from the daemon, or from the PFS while the daemon is
        unreachable. ``epoch`` names the job's epoch they are read for
        (default: the job's current one). ``copy=False``: the daemon's
        payloads are read-only memoryviews into the shared memory segment
        they arrived in (see :meth:`SegmentPool.lend`), not copies.
        ``looked_up`` False: this process cannot read the local cache (another
        user's daemon, a daemon across the network), so the samples may well
        be cached there: they go to the daemon, which reads the PFS only for
        what it lacks."""
        if looked_up and self._reads_own(dataset):
            try:
                return self._read_own(dataset, ids)
            except PfsReadError as exc:
                return self._read_after_failure(dataset, ids, exc, copy)
        return self._read_through_daemon(dataset, ids, epoch, copy)

    def _read_through_daemon(
        self, dataset: Dataset, ids: np.ndarray, epoch: int | None = None, copy: bool = True
    ) -> list[bytes]:
        """Samples from the daemon, or from the PFS while it is unreachable."""
        out: list[bytes] = []
        step = self.info.max_batch or len(ids)
        for start in range(0, len(ids), step):
            if not self._health.usable():
                out += self._read_pfs(dataset, ids[start:])
                break
            try:
                out += self._read_daemon(dataset, ids[start : start + step], epoch, copy)
            except DaemonUnavailableError as exc:
                self.mark_down(exc)
                out += self._read_pfs(dataset, ids[start:])
                break
        return out

    def after_fork_in_child(self) -> None:
        self.notices.after_fork_in_child()

    def flush(self) -> None:
        """Sends the notices of samples read from the PFS (at most a few seconds), then stops sending."""
        self.notices.close()

    def close(self) -> None:
        """Removes this process's shared memory segments."""
        self._segments.close()

    def _reads_own(self, dataset: Dataset) -> bool:
        """Whether this process reads the dataset's misses from the PFS itself."""
        if not self._own_reads or dataset.job is not None or self.info.pfs_bandwidth or self.daemon_down:
            return False
        key = (dataset.name, dataset.manifest.manifest_id)
        return time.monotonic() >= self._daemon_reads_until.get(key, 0.0)

    def _read_own(self, dataset: Dataset, ids: np.ndarray) -> list[bytes]:
        """Misses read from the PFS by this process, counted as PFS reads and
        noticed to the daemon to cache; those whose notice was lost before
        are read through the daemon instead, which caches them."""
        lost = self.notices.take_lost(dataset.name, dataset.manifest.manifest_id, ids)
        if lost is not None:
            merged: list[bytes] = [b""] * len(ids)
            for positions, values in (
                (np.flatnonzero(lost), self._read_through_daemon(dataset, ids[lost])),
                (np.flatnonzero(~lost), self._read_own(dataset, ids[~lost]) if not lost.all() else []),
            ):
                for position, value in zip(positions.tolist(), values):
                    merged[position] = value
            return merged
        out = self._pfs_reader(dataset).read(ids)
        nbytes = sum(map(len, out))
        self._stats.add(PFS, len(out), nbytes)
        self.notices.note(dataset.name, dataset.manifest.manifest_id, ids, out, nbytes)
        return out

    def _read_after_failure(
        self, dataset: Dataset, ids: np.ndarray, failure: PfsReadError, copy: bool = True
    ) -> list[bytes]:
        """The misses through the daemon, after this process failed to read
        them; the daemon's error if it fails too (a file that changed)."""
        out: list[bytes] = []
        step = self.info.max_batch or len(ids)
        try:
            for start in range(0, len(ids), step):
                out += self._read_daemon(dataset, ids[start : start + step], None, copy)
        except DaemonUnavailableError as exc:
            self.mark_down(exc)
            raise failure from None
        key = (dataset.name, dataset.manifest.manifest_id)
        if key not in self._daemon_reads_until:
            log.info("%s; the daemon can read it: misses of %r go through the daemon", failure, dataset.name)
        self._daemon_reads_until[key] = time.monotonic() + OWN_READS_RETRY_SECONDS
        return out

    def _read_daemon(self, dataset: Dataset, ids: np.ndarray, epoch: int | None, copy: bool = True) -> list[bytes]:
        """Samples from the daemon, payloads through shared memory where it can
        (with ``copy=False`` left there, as views).

        A payload whose checksum fails is asked for once more inline before
        the read fails: a segment is never trusted over the bytes themselves.
        """
        # The daemon places each payload at a 64-byte boundary.
        nbytes = int(dataset.manifest.sample_length[ids].sum()) + 64 * len(ids)
        with self._segments.segment(nbytes) as seg:
            lent = None if copy or seg is None else self._segments.lend(seg)
            try:
                out, bad = self._read_daemon_once(dataset, ids, seg, epoch, lent)
            except DaemonUnavailableError:
                # A hung daemon may still write into it once it resumes.
                if seg is not None:
                    self._segments.discard(seg)
                raise
        if bad:
            again, still_bad = self._read_daemon_once(dataset, ids[bad], None, epoch)
            if still_bad:
                want = int(ids[bad][still_bad[0]])
                raise CorruptValueError(f"sample {want} of {dataset.name!r} arrived with a bad checksum")
            for position, value in zip(bad, again):
                out[position] = value
        return out

    def _read_daemon_once(
        self,
        dataset: Dataset,
        ids: np.ndarray,
        seg: Segment | MemfdSegment | None,
        epoch: int | None,
        lent: memoryview | None = None,
    ) -> tuple[list[bytes], list[int]]:
        """(samples in order, positions whose checksum failed), by the first
        transport :func:`~dataquay.client.daemon_transports.pick_transports`
        names that carries the batch; payloads in ``seg`` are cut from
        ``lent`` (views) where given, else copied out."""
        lengths = dataset.manifest.sample_length
        nbytes = int(lengths[ids].sum())
        deadline = batch_deadline(READ_FLOOR_SECONDS, nbytes)
        reply = _Reply(dataset.name, ids.tolist(), lengths, seg, self._verify, lent)
        for transport in pick_transports(self._connection, seg, len(ids), nbytes):
            if transport.read(dataset, ids, epoch, deadline, reply):
                break
        self._health.answered()
        reply.check_complete()
        if seg is not None:
            if reply.used_segment:
                seg.daemon_mapped()
            elif seg.linked or (len(ids) and int(lengths[ids].min()) <= seg.size):
                # Unusable for the daemon (never mapped, or no longer: restarted,
                # or it let go of a memfd segment): the next call makes a new one.
                self._segments.discard(seg)
        for tier, count in reply.tiers.items():
            if count:
                self._stats.add(tier, count, reply.sizes[tier])
        return reply.out, reply.bad

    def _read_pfs(self, dataset: Dataset, ids: np.ndarray) -> list[bytes]:
        out = self._pfs_reader(dataset).read(ids)
        self._stats.add(FALLBACK, len(out), sum(map(len, out)))
        return out

    def _pfs_reader(self, dataset: Dataset) -> PfsReader:
        key = (dataset.name, dataset.manifest.manifest_id)
        reader = self._pfs.get(key)
        if reader is None:
            reader = self._pfs[key] = PfsReader(dataset.manifest, dataset.name, confined=False)
        return reader

    def mark_down(self, exc: DaemonUnavailableError) -> None:
        """Reads go to the PFS until the daemon answers a probe; ``exc`` says why."""
        self._health.mark_down(exc)

    def _refresh_info(self, info: pb.InfoReply | None) -> None:
        """Takes the Info of a daemon that answers again: a restarted daemon may run with other limits."""
        self.info = info or self._connection.call(
            "Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=self._timeout)
        )
