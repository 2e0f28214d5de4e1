"""A streamed Read's reply taken apart into samples: pieces joined, checksums checked.

Both hops that receive a ``ReadChunk`` stream read it here, the trainer's
(from its daemon, :mod:`dataquay.client.daemon_transports`) and a daemon's
(from a peer, ``dataquay.server.node.peers.reads``), so that a piece that does not
continue its payload or a checksum that fails is judged the same way on
both. The server imports this module; this module imports nothing of the
server.

What each side then does with a sample differs and stays with it: a
trainer wants the ids in the order it asked and counts a bad checksum
against a position (to ask again), a daemon keys what a peer sent by id
and drops what failed.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dataquay.client.errors import DataquayError
from dataquay.client.wire.pieces import Joiner
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb

#: One sample of a reply, whole: ``(id, data, checksum, tier, missing,
#: in_segment, intact)``. ``tier`` is the proto's Tier (where the sender
#: found it); ``missing``: the sender does not hold it (a peer asked only for
#: its own cache); ``in_segment``: ``data`` was read from the shared memory
#: segment; ``intact`` is False only where its checksum was checked and
#: failed. A plain tuple: one is made per sample on the read hot path, where
#: an object costs as much again as the rest of the parse.
Taken = tuple[int, "bytes | memoryview", int, "pb.Tier", bool, bool, bool]


class Mapped(Protocol):
    """Where payloads that a reply says lie in shared memory are read from."""

    @property
    def map(self) -> mmap.mmap | memoryview: ...


class ReadStream:
    """Takes a Read's reply apart a chunk at a time, never holding its
    messages besides the samples.

    Args:
        source: who sends the reply, for messages ("the daemon", "peer n1").
        lengths: every sample's payload length by id, as the manifest has
            them: a piece that claims another length is refused.
        verify: check every payload's checksum (a daemon always does).
        segment: the shared memory segment payloads marked ``in_shm`` lie
            in; None where the call named none (such marks are then ignored).
        trust_marks: whether a payload marked ``checked_in_place`` in the
            segment is taken unchecked; only for a sealed memfd segment, which
            no third process can write (see
            :class:`dataquay.client.daemon_transports.DaemonReply`).
        order: the ids the reply must carry, in this order; a sample or
            piece of another id at a position is refused before it is taken.
        dataset: the dataset read, for messages.
    """

    def __init__(
        self,
        source: str,
        lengths: np.ndarray,
        *,
        verify: bool = True,
        segment: Mapped | None = None,
        trust_marks: bool = False,
        order: Sequence[int] | None = None,
        dataset: str = "",
    ) -> None:
        self.source = source
        self.lengths = lengths
        self.verify = verify
        self.segment = segment
        self.trust_marks = trust_marks
        self.order = order
        self.dataset = dataset
        #: Samples taken so far (whole: a payload's pieces count once).
        self.taken = 0
        self._joiner = Joiner(source)

    def take(self, chunk: pb.ReadChunk) -> list[Taken]:
        """The samples ``chunk`` completes, in order.

        Raises:
            PieceError: a piece does not continue the payload begun, or a
                payload's pieces stopped before its end.
            DataquayError: a sample out of the ``order`` asked for.
        """
        if chunk.HasField("piece"):
            whole = self._take_piece(chunk.piece)
            return [] if whole is None else [whole]
        if self._joiner.pending is not None:
            self._joiner.check_done()
        segment, verify, trust_marks, order = self.segment, self.verify, self.trust_marks, self.order
        position, due = self.taken, len(order) if order is not None else 0
        out: list[Taken] = []
        append = out.append
        for sample in chunk.samples:
            sample_id = sample.id
            if order is not None and (position >= due or sample_id != order[position]):
                raise self._unexpected(sample_id, position)
            position += 1
            digest = sample.checksum
            if sample.in_shm and segment is not None:
                offset = sample.shm_offset
                data: bytes | memoryview = segment.map[offset : offset + sample.length]
                checked = trust_marks and sample.checked_in_place
                in_segment = True
            else:
                data, checked, in_segment = sample.data, False, False
            missing = sample.missing
            append(
                (
                    sample_id,
                    data,
                    digest,
                    sample.tier,
                    missing,
                    in_segment,
                    not verify or checked or missing or checksum(data) == digest,
                )
            )
        self.taken = position
        return out

    def end(self) -> None:
        """Raises PieceError when the reply ended inside a payload's pieces."""
        self._joiner.check_done()

    def _take_piece(self, piece: pb.Sample) -> Taken | None:
        if self.order is not None and (self.taken >= len(self.order) or piece.id != self.order[self.taken]):
            raise self._unexpected(piece.id, self.taken)
        lengths = self.lengths
        expected = int(lengths[piece.id]) if 0 <= piece.id < len(lengths) else -1
        data = self._joiner.add(piece.id, piece.offset, piece.length, piece.data, expected)
        if data is None:
            return None
        self.taken += 1
        intact = not self.verify or checksum(data) == piece.checksum
        return (piece.id, data, piece.checksum, piece.tier, False, False, intact)

    def _unexpected(self, sample_id: int, position: int) -> DataquayError:
        assert self.order is not None
        if position >= len(self.order):
            return DataquayError(
                f"{self.source} sent more samples of {self.dataset!r} than the {len(self.order)} asked for"
            )
        return DataquayError(
            f"{self.source} sent sample {sample_id} of {self.dataset!r} where {self.order[position]} was due"
        )
