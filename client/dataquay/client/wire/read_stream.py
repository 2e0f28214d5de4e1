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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dataquay.client.wire.pieces import Joiner
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb


class Mapped(Protocol):
    """Where payloads that a reply says lie in shared memory are read from."""

    @property
    def map(self) -> mmap.mmap: ...


@dataclass(slots=True)
class StreamSample:
    """One sample of a reply, whole."""

    id: int
    data: bytes | memoryview
    checksum: int
    #: The proto's Tier: where the sender found it.
    tier: pb.Tier
    #: The sender does not hold it (a peer asked only for its own cache).
    missing: bool
    #: Whether ``data`` was read from the shared memory segment.
    in_segment: bool
    #: False only where its checksum was checked and failed.
    intact: bool


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
        expect: called with each sample's and each piece's id before it is
            taken, to refuse one the receiver did not ask for at this point.
    """

    def __init__(
        self, source: str, lengths: np.ndarray, *, verify: bool = True, segment: Mapped | None = None,
        trust_marks: bool = False, expect: Callable[[int], None] | None = None,
    ) -> None:
        self.lengths = lengths
        self.verify = verify
        self.segment = segment
        self.trust_marks = trust_marks
        self.expect = expect
        self._joiner = Joiner(source)

    def take(self, chunk: pb.ReadChunk) -> Iterator[StreamSample]:
        """The samples ``chunk`` completes, in order.

        Raises:
            PieceError: a piece does not continue the payload begun, or a
                payload's pieces stopped before its end.
        """
        if chunk.HasField("piece"):
            whole = self._take_piece(chunk.piece)
            if whole is not None:
                yield whole
            return
        if self._joiner.pending is not None:
            self._joiner.check_done()
        segment, verify, trust_marks, expect = self.segment, self.verify, self.trust_marks, self.expect
        for sample in chunk.samples:
            if expect is not None:
                expect(sample.id)
            checked = False
            in_segment = sample.in_shm and segment is not None
            if in_segment:
                assert segment is not None
                data = segment.map[sample.shm_offset : sample.shm_offset + sample.length]
                checked = trust_marks and sample.checked_in_place
            else:
                data = sample.data
            intact = not verify or checked or sample.missing or checksum(data) == sample.checksum
            yield StreamSample(sample.id, data, sample.checksum, sample.tier, sample.missing, in_segment, intact)

    def end(self) -> None:
        """Raises PieceError when the reply ended inside a payload's pieces."""
        self._joiner.check_done()

    def _take_piece(self, piece: pb.Sample) -> StreamSample | None:
        if self.expect is not None:
            self.expect(piece.id)
        lengths = self.lengths
        expected = int(lengths[piece.id]) if 0 <= piece.id < len(lengths) else -1
        data = self._joiner.add(piece.id, piece.offset, piece.length, piece.data, expected)
        if data is None:
            return None
        intact = not self.verify or checksum(data) == piece.checksum
        return StreamSample(piece.id, data, piece.checksum, piece.tier, False, False, intact)
