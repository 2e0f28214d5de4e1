"""The trainer-to-daemon hop: how one batch's payloads get from the daemon to this process.

Three transports carry a batch, all behind :class:`DaemonTransport`:

- :class:`MemfdBatchTransport`: one framed request and reply on a sealed
  memfd segment's own connection (:mod:`dataquay.client.wire.batch_reads`), the
  payloads in the segment; no gRPC call at all.
- :class:`ShmGrpcTransport`: a streamed gRPC Read naming a shared memory
  segment (a /dev/shm one, or a memfd one the batch did not fit framed), the
  daemon writing the payloads there and the reply carrying their places.
- :class:`InlineGrpcTransport`: a streamed gRPC Read with the payloads in
  its messages, where no segment could be had.

:func:`pick_transports` is the one place that decides which run, in order.
Every transport presents the cluster's credentials the trainer's
:class:`~dataquay.client.connection.DaemonConnection` carries: the cluster
token, and the caller's ticket where the daemon asks for one; the memfd
connection presented the token once, when the segment was handed over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from dataquay.client.errors import DaemonUnavailableError, DataquayError
from dataquay.client.wire.batch_reads import NOT_PLACED, OK, BatchReply, BatchRequest, parse_reply, request_frame
from dataquay.client.wire.memfd import MemfdSegment
from dataquay.client.wire.read_stream import Mapped, ReadStream
from dataquay.client.wire.records import checksum
from dataquay.client.wire.shm import Segment
from dataquay.client.wire.status_codes import code_of_number, error_from_status
from dataquay.client.wire.tiers import CACHE, CLIENT_TIERS, SERVED_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc

if TYPE_CHECKING:
    from dataquay.client.connection import DaemonConnection
    from dataquay.client.dataset import Dataset


class DaemonTransport(Protocol):
    """One way of reading a batch from the daemon into a :class:`DaemonReply`."""

    #: Short name, for tests and logs.
    name: str

    def read(self, dataset: Dataset, ids: np.ndarray, epoch: int | None, deadline: float, reply: DaemonReply) -> bool:
        """Reads ``ids`` into ``reply`` within ``deadline`` seconds; False where
        this transport could not carry the batch and took nothing into ``reply``
        (the next transport picked is tried).

        Raises:
            DaemonUnavailableError: the daemon did not answer.
            DataquayError: the daemon's error for the read, or a reply that makes no sense.
        """
        ...


class MemfdBatchTransport:
    """A batch framed on a sealed memfd segment's own connection."""

    name = "memfd"

    def __init__(self, connection: DaemonConnection, segment: MemfdSegment) -> None:
        self._connection = connection
        self._segment = segment

    def read(self, dataset: Dataset, ids: np.ndarray, epoch: int | None, deadline: float, reply: DaemonReply) -> bool:
        frame = request_frame(
            BatchRequest(
                dataset.name, dataset.manifest.manifest_id, dataset.job or "", epoch if dataset.job else None, ids
            )
        )
        try:
            data = self._segment.read(frame, deadline)
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


class InlineGrpcTransport:
    """A streamed gRPC Read whose messages carry the payloads."""

    name = "grpc"

    def __init__(self, connection: DaemonConnection) -> None:
        self._connection = connection

    def request(self, dataset: Dataset, ids: np.ndarray, epoch: int | None) -> pb.ReadRequest:
        request = pb.ReadRequest(
            dataset=dataset.name, ids=ids.tolist(), manifest_id=dataset.manifest.manifest_id, job=dataset.job or ""
        )
        if epoch is not None and dataset.job:
            request.epoch = epoch
        return request

    def read(self, dataset: Dataset, ids: np.ndarray, epoch: int | None, deadline: float, reply: DaemonReply) -> bool:
        request = self.request(dataset, ids, epoch)

        def read(stub: cache_pb2_grpc.CacheStub) -> None:
            call = stub.Read(request, timeout=deadline)
            try:
                for chunk in call:
                    reply.take(chunk)
            except DataquayError:
                call.cancel()  # the rest of a reply that makes no sense is not waited for
                raise

        self._connection.call("Read", read)
        return True


class ShmGrpcTransport(InlineGrpcTransport):
    """A streamed gRPC Read naming a segment the daemon writes the payloads
    into; the daemon still answers inline what it cannot place there."""

    name = "shm+grpc"

    def __init__(self, connection: DaemonConnection, segment: Segment | MemfdSegment) -> None:
        super().__init__(connection)
        self._segment = segment

    def request(self, dataset: Dataset, ids: np.ndarray, epoch: int | None) -> pb.ReadRequest:
        request = super().request(dataset, ids, epoch)
        request.shm_name, request.shm_size = self._segment.name, self._segment.size
        return request


def pick_transports(
    connection: DaemonConnection, segment: Segment | MemfdSegment | None, count: int, nbytes: int
) -> list[DaemonTransport]:
    """The transports to try, in order, for a batch of ``count`` ids and
    ``nbytes`` of payload, given the segment this call holds (see
    :meth:`dataquay.client.wire.shm.SegmentPool.segment`):

    1. a sealed memfd segment that holds the batch whole, on a daemon that
       answers framed reads (``read_ids``) of that many ids: memfd batch
       read, with a segment Read over gRPC behind it for a batch the daemon
       could not place. One the segment cannot hold goes straight to gRPC:
       the daemon would read its first samples (from the PFS, maybe) before
       finding that out, and they would be read again;
    2. any other segment: a gRPC Read naming it;
    3. no segment (shared memory unusable here): an inline gRPC Read.
    """
    if segment is None:
        return [InlineGrpcTransport(connection)]
    grpc_read = ShmGrpcTransport(connection, segment)
    if isinstance(segment, MemfdSegment) and count <= segment.read_ids and nbytes <= segment.size:
        return [MemfdBatchTransport(connection, segment), grpc_read]
    return [grpc_read]


class _Lent:
    """A lent segment's view, where a reply cuts its payloads from."""

    def __init__(self, view: memoryview) -> None:
        self.map = view


class DaemonReply:
    """A batch's reply from the daemon, whichever transport carried it.

    ``out`` collects the payloads in order (the pieces of a large one joined),
    ``bad`` the positions whose checksum failed, ``tiers`` and ``sizes`` what
    each tier served.

    A payload in a sealed memfd segment that the reply marks
    ``checked_in_place`` is not checked again: checksums are checked once per
    hop, and the daemon checked its payload on the hop it came by. One from a
    peer it received straight into this segment and checked there, where it
    lies; one from its cache it checked against the checksum stored with it
    as it read it from the map, and copied in. From there to this process
    there is no hop that could change a byte: the
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
    that came inline, one read from the PFS, and any payload without the
    mark, are checked here.

    With ``lent`` (the segment's view from :meth:`SegmentPool.lend`), the
    payloads in the segment are cut from it as read-only memoryviews, not
    copied out: the pool keeps the segment out of use while any is held.
    """

    def __init__(
        self,
        dataset: str,
        ids: list[int],
        lengths: np.ndarray,
        seg: Segment | MemfdSegment | None,
        verify: bool,
        lent: memoryview | None = None,
    ) -> None:
        self.dataset = dataset
        self.ids = ids
        self.seg = seg
        self.verify = verify
        #: Where payloads in the segment are cut from.
        self._source: Mapped | None = seg if lent is None else _Lent(lent)
        self.out: list[bytes] = []
        self.bad: list[int] = []
        self.tiers = dict.fromkeys(CLIENT_TIERS, 0)
        self.sizes = dict.fromkeys(CLIENT_TIERS, 0)
        self.used_segment = False
        self._stream = ReadStream(
            "the daemon",
            lengths,
            verify=verify,
            segment=self._source,
            trust_marks=isinstance(seg, MemfdSegment),
            order=ids,
            dataset=dataset,
        )

    def take(self, chunk: pb.ReadChunk) -> None:
        """Takes one message of a streamed Read."""
        out, bad, tiers, sizes = self.out, self.bad, self.tiers, self.sizes
        used_segment = False
        for _, data, _, tier_code, _, in_segment, intact in self._stream.take(chunk):
            if not intact:
                bad.append(len(out))
            tier = SERVED_TIERS.get(tier_code, CACHE)
            tiers[tier] += 1
            sizes[tier] += len(data)
            out.append(data)  # type: ignore[arg-type]
            used_segment |= in_segment
        self.used_segment |= used_segment

    def take_placed(self, answer: BatchReply) -> None:
        """Takes a whole batch from a reply framed on a sealed segment's
        connection: every payload lies in the segment."""
        source, out = self._source, self.out
        assert source is not None and not out
        payloads = source.map
        offsets, lengths = answer.offsets.tolist(), answer.lengths.tolist()
        out.extend([payloads[offset : offset + length] for offset, length in zip(offsets, lengths)])  # type: ignore[misc]
        if self.verify:
            digests = answer.checksums.tolist()
            unchecked = np.flatnonzero(answer.checked == 0).tolist()
            self.bad.extend(k for k in unchecked if checksum(out[k]) != digests[k])
        for tier_code in set(answer.tiers.tolist()):  # most batches come from one tier
            served = answer.tiers == tier_code
            tier = SERVED_TIERS.get(tier_code, CACHE)
            self.tiers[tier] += int(served.sum())
            self.sizes[tier] += int(answer.lengths[served].sum())
        self.used_segment = bool(out)

    def check_complete(self) -> None:
        self._stream.end()
        if len(self.out) != len(self.ids):
            raise DataquayError(f"the daemon sent {len(self.out)} samples of {self.dataset!r} for {len(self.ids)} ids")
