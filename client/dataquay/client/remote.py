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
daemon in one streamed Read, payloads through a shared memory segment where
the daemon can map it. A training loop
never fails because its daemon died: the reader logs one warning, reads from
the PFS itself (by the dataset's manifest), and tries the daemon again every
:data:`RETRY_DAEMON_SECONDS`. A daemon that is alive but hung (stopped,
swapping) is found out by a Read's deadline, which grows with the batch's
bytes, and is then treated as down the same way.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from dataquay.client.cache_behind import CacheBehindNotices
from dataquay.client.channels import batch_deadline
from dataquay.client.connection import DaemonConnection
from dataquay.client.errors import CorruptValueError, DaemonUnavailableError, DataquayError, PfsReadError
from dataquay.client.memfd import MemfdSegment
from dataquay.client.notices import first_to_tell, no_longer
from dataquay.client.pfs import PfsReader
from dataquay.client.pieces import Joiner
from dataquay.client.records import checksum
from dataquay.client.segment_reads import NOT_PLACED, OK, BatchReply, BatchRequest, parse_reply, request_frame
from dataquay.client.shm import Segment, SegmentPool
from dataquay.client.stats import ReadStats
from dataquay.client.status_codes import code_of_number, error_from_status
from dataquay.client.tiers import CACHE, CLIENT_TIERS, SERVED_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc

if TYPE_CHECKING:
    from dataquay.client.dataset import Dataset

log = logging.getLogger("dataquay.client")

#: While the daemon is unreachable, it is tried again this often, with a call
#: that must answer within PROBE_SECONDS: a daemon that hangs costs its
#: trainers that much per retry, not a read's whole deadline.
RETRY_DAEMON_SECONDS = 2.0
PROBE_SECONDS = 0.5
#: Floor of a Read's deadline (see :func:`~dataquay.client.channels.batch_deadline`):
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
        self._down_until = 0.0
        self._down_reason: str | None = None
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
    def _down_topic(self) -> str:
        return f"daemon down: {self._connection.address}"

    @property
    def daemon_down(self) -> bool:
        """Whether the daemon was found unreachable and its retry time has not come."""
        return time.monotonic() < self._down_until

    def read(self, dataset: Dataset, ids: np.ndarray, epoch: int | None = None) -> list[bytes]:
        """Samples the local cache lacks, in order: read here from the PFS (a
        read for no job), from the daemon, or from the PFS while the daemon is
        unreachable. ``epoch`` names the job's epoch they are read for
        (default: the job's current one)."""
        if self._reads_own(dataset):
            try:
                return self._read_own(dataset, ids)
            except PfsReadError as exc:
                return self._read_after_failure(dataset, ids, exc)
        return self._read_through_daemon(dataset, ids, epoch)

    def _read_through_daemon(self, dataset: Dataset, ids: np.ndarray, epoch: int | None = None) -> list[bytes]:
        """Samples from the daemon, or from the PFS while it is unreachable."""
        out: list[bytes] = []
        step = self.info.max_batch or len(ids)
        for start in range(0, len(ids), step):
            if not self._daemon_back():
                out += self._read_pfs(dataset, ids[start:])
                break
            try:
                out += self._read_daemon(dataset, ids[start : start + step], epoch)
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
        self._stats.add("pfs", len(out), nbytes)
        self.notices.note(dataset.name, dataset.manifest.manifest_id, ids, out, nbytes)
        return out

    def _read_after_failure(self, dataset: Dataset, ids: np.ndarray, failure: PfsReadError) -> list[bytes]:
        """The misses through the daemon, after this process failed to read
        them; the daemon's error if it fails too (a file that changed)."""
        out: list[bytes] = []
        step = self.info.max_batch or len(ids)
        try:
            for start in range(0, len(ids), step):
                out += self._read_daemon(dataset, ids[start : start + step], None)
        except DaemonUnavailableError as exc:
            self.mark_down(exc)
            raise failure from None
        key = (dataset.name, dataset.manifest.manifest_id)
        if key not in self._daemon_reads_until:
            log.info("%s; the daemon can read it: misses of %r go through the daemon", failure, dataset.name)
        self._daemon_reads_until[key] = time.monotonic() + OWN_READS_RETRY_SECONDS
        return out

    def _read_daemon(self, dataset: Dataset, ids: np.ndarray, epoch: int | None) -> list[bytes]:
        """Samples from the daemon, payloads through shared memory where it can.

        A payload whose checksum fails is asked for once more inline before
        the read fails: a segment is never trusted over the bytes themselves.
        """
        # The daemon places each payload at a 64-byte boundary.
        nbytes = int(dataset.manifest.sample_length[ids].sum()) + 64 * len(ids)
        with self._segments.segment(nbytes) as seg:
            try:
                out, bad = self._read_daemon_once(dataset, ids, seg, epoch)
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
        self, dataset: Dataset, ids: np.ndarray, seg: Segment | MemfdSegment | None, epoch: int | None
    ) -> tuple[list[bytes], list[int]]:
        """(samples in order, positions whose checksum failed): on the sealed
        segment's own connection where the daemon answers reads there, else
        in a streamed gRPC Read."""
        lengths = dataset.manifest.sample_length
        nbytes = int(lengths[ids].sum())
        deadline = batch_deadline(READ_FLOOR_SECONDS, nbytes)
        reply = _Reply(dataset.name, ids.tolist(), lengths, seg, self._verify)
        # A batch the segment cannot hold whole goes over gRPC at once: the
        # daemon would read its first samples (from the PFS, maybe) before
        # finding that out, and they would be read again.
        if not (
            isinstance(seg, MemfdSegment) and len(ids) <= seg.read_ids and nbytes <= seg.size
            and self._read_on_segment(dataset, ids, seg, epoch, deadline, reply)
        ):
            self._read_grpc(dataset, ids, seg, epoch, deadline, reply)
        self._daemon_up()
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

    def _read_on_segment(
        self, dataset: Dataset, ids: np.ndarray, seg: MemfdSegment, epoch: int | None, deadline: float,
        reply: _Reply,
    ) -> bool:
        """Reads a batch into ``seg`` with one framed request on its connection
        (:mod:`dataquay.client.segment_reads`); False where the daemon could not
        place it there (nothing was taken into ``reply``)."""
        frame = request_frame(BatchRequest(
            dataset.name, dataset.manifest.manifest_id, dataset.job or "", epoch if dataset.job else None, ids
        ))
        try:
            data = seg.read(frame, deadline)
        except OSError as exc:
            raise DaemonUnavailableError(
                f"dataquay daemon at {self._connection.address} did not answer a read on its fd socket ({exc})"
            ) from None
        if not data:
            raise DaemonUnavailableError(
                f"dataquay daemon at {self._connection.address} ended a segment's connection during a read"
            )
        try:
            answer = parse_reply(data, len(ids))
        except ValueError as exc:
            raise DataquayError(f"the daemon's reply to a read of {dataset.name!r} makes no sense: {exc}") from None
        if answer.code == NOT_PLACED:
            return False
        if answer.code != OK:
            code = code_of_number(answer.code)
            raise error_from_status(code, answer.message, answer.error) or DataquayError(
                f"Read failed: {code.name}: {answer.message}"
            )
        reply.take_placed(answer)
        return True

    def _read_grpc(
        self, dataset: Dataset, ids: np.ndarray, seg: Segment | MemfdSegment | None, epoch: int | None,
        deadline: float, reply: _Reply,
    ) -> None:
        request = pb.ReadRequest(
            dataset=dataset.name, ids=ids.tolist(), manifest_id=dataset.manifest.manifest_id, job=dataset.job or ""
        )
        if epoch is not None and dataset.job:
            request.epoch = epoch
        if seg is not None:
            request.shm_name, request.shm_size = seg.name, seg.size

        def read(stub: cache_pb2_grpc.CacheStub) -> None:
            call = stub.Read(request, timeout=deadline)
            try:
                for chunk in call:
                    reply.take(chunk)
            except DataquayError:
                call.cancel()  # the rest of a reply that makes no sense is not waited for
                raise

        self._connection.call("Read", read)

    def _read_pfs(self, dataset: Dataset, ids: np.ndarray) -> list[bytes]:
        out = self._pfs_reader(dataset).read(ids)
        self._stats.add("fallback", len(out), sum(map(len, out)))
        return out

    def _pfs_reader(self, dataset: Dataset) -> PfsReader:
        key = (dataset.name, dataset.manifest.manifest_id)
        reader = self._pfs.get(key)
        if reader is None:
            reader = self._pfs[key] = PfsReader(dataset.manifest, dataset.name, confined=False)
        return reader

    def mark_down(self, exc: DaemonUnavailableError) -> None:
        """Reads go to the PFS until the daemon answers a probe; ``exc`` says why."""
        if self._down_reason is None:
            # Once for a trainer and its DataLoader workers, not once each.
            told = first_to_tell(self._down_topic)
            log.log(
                logging.WARNING if told else logging.DEBUG,
                "%s; reading misses from the PFS and trying the daemon again every %.0f s",
                exc, RETRY_DAEMON_SECONDS,
            )
        self._down_reason = str(exc)
        self._down_until = time.monotonic() + RETRY_DAEMON_SECONDS

    def _daemon_back(self) -> bool:
        """Whether reads may go to the daemon: it was not found unreachable,
        or it answers a quick call once its retry time has come."""
        if self._down_reason is None:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            info = self._connection.call("Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=PROBE_SECONDS))
        except DataquayError:
            self._down_until = time.monotonic() + RETRY_DAEMON_SECONDS
            return False
        self._daemon_up(info)
        return True

    def _daemon_up(self, info: pb.InfoReply | None = None) -> None:
        """Marks the daemon reachable again; ``info`` is its answer to Info, if just asked."""
        if self._down_reason is not None:
            self._down_reason = None
            no_longer(self._down_topic)
            log.info("dataquay daemon at %s answers again; misses go through it", self._connection.address)
            # A restarted daemon may run with other limits.
            self.info = info or self._connection.call(
                "Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=self._timeout)
            )


class _Reply:
    """A Read's reply taken apart as it streams in, a chunk at a time, so that
    the client never holds the reply's messages besides its samples.

    ``out`` collects the payloads in order (the pieces of a large one joined),
    ``bad`` the positions whose checksum failed, ``tiers`` and ``sizes`` what
    each tier served.

    A payload in a sealed memfd segment that the reply marks
    ``checked_in_place`` is not checked again: checksums are checked once per
    hop, and its hop was the network. The daemon received it from a peer
    straight into this segment and checked its xxh3 there, where it lies.
    From there to this process there is no hop that could change a byte: the
    segment is sealed against writes other than through the mappings that
    existed when the daemon sealed it (the daemon's and this process's own,
    which is read only), against shrinking and against punched holes, so no
    third process can touch it; and the daemon writes nothing over a payload
    its reply names (one position moves forward through the segment for the
    whole reply, and a segment serves one call at a time). What this leaves
    to the daemon is its own bookkeeping of offsets, as the client already
    leaves it the checksums that every payload is checked against. A
    /dev/shm segment (any process of the user may open it while it is
    linked, and the daemon writes it without a check in place), a payload
    that came inline or was written into the segment by a copy, and any
    payload without the mark, are checked here.
    """

    def __init__(
        self, dataset: str, ids: list[int], lengths: np.ndarray, seg: Segment | MemfdSegment | None, verify: bool
    ) -> None:
        self.dataset = dataset
        self.ids = ids
        self.lengths = lengths
        self.seg = seg
        self.verify = verify
        self.out: list[bytes] = []
        self.bad: list[int] = []
        self.tiers = dict.fromkeys(CLIENT_TIERS, 0)
        self.sizes = dict.fromkeys(CLIENT_TIERS, 0)
        self.used_segment = False
        #: Whether marks of payloads checked in place are taken (see above).
        self.sealed = isinstance(seg, MemfdSegment)
        self._joiner = Joiner("the daemon")

    def take(self, chunk: pb.ReadChunk) -> None:
        if chunk.HasField("piece"):
            self._take_piece(chunk.piece)
            return
        if self._joiner.pending is not None:
            self._joiner.check_done()
        ids, out, bad, seg, verify, sealed = self.ids, self.out, self.bad, self.seg, self.verify, self.sealed
        tiers, sizes, count = self.tiers, self.sizes, len(self.ids)
        used_segment = False
        for sample in chunk.samples:
            position = len(out)
            if position >= count or sample.id != ids[position]:
                raise self._unexpected(sample.id, position)
            checked = False
            if sample.in_shm and seg is not None:
                data = seg.map[sample.shm_offset : sample.shm_offset + sample.length]
                used_segment = True
                checked = sealed and sample.checked_in_place
            else:
                data = sample.data
            if verify and not checked and checksum(data) != sample.checksum:
                bad.append(position)
            tier = SERVED_TIERS.get(sample.tier, CACHE)
            tiers[tier] += 1
            sizes[tier] += len(data)
            out.append(data)
        self.used_segment |= used_segment

    def take_placed(self, answer: BatchReply) -> None:
        """Takes a whole batch from a reply framed on a sealed segment's
        connection: every payload lies in the segment."""
        seg, out, bad, verify = self.seg, self.out, self.bad, self.verify
        assert seg is not None and not out
        tiers, sizes = self.tiers, self.sizes
        for position, (offset, length, digest, tier_code, checked) in enumerate(zip(
            answer.offsets.tolist(), answer.lengths.tolist(), answer.checksums.tolist(), answer.tiers.tolist(),
            answer.checked.tolist(),
        )):
            data = seg.map[offset : offset + length]
            if verify and not checked and checksum(data) != digest:
                bad.append(position)
            tier = SERVED_TIERS.get(tier_code, CACHE)
            tiers[tier] += 1
            sizes[tier] += length
            out.append(data)
        self.used_segment = bool(out)

    def _take_piece(self, piece: pb.Sample) -> None:
        position = len(self.out)
        if position >= len(self.ids) or piece.id != self.ids[position]:
            raise self._unexpected(piece.id, position)
        data = self._joiner.add(piece.id, piece.offset, piece.length, piece.data, int(self.lengths[piece.id]))
        if data is None:
            return
        if self.verify and checksum(data) != piece.checksum:
            self.bad.append(position)
        tier = SERVED_TIERS.get(piece.tier, CACHE)
        self.tiers[tier] += 1
        self.sizes[tier] += len(data)
        self.out.append(data)

    def check_complete(self) -> None:
        self._joiner.check_done()
        if len(self.out) != len(self.ids):
            raise DataquayError(f"the daemon sent {len(self.out)} samples of {self.dataset!r} for {len(self.ids)} ids")

    def _unexpected(self, sample_id: int, position: int) -> DataquayError:
        if position >= len(self.ids):
            return DataquayError(f"the daemon sent more samples of {self.dataset!r} than the {len(self.ids)} asked for")
        return DataquayError(
            f"the daemon sent sample {sample_id} of {self.dataset!r} where {self.ids[position]} was due"
        )
