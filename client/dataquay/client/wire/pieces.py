"""Payloads larger than a read chunk, sent as pieces and joined again.

Replies carry samples several to a message, about READ_CHUNK_BYTES of payload
each. A payload larger than that goes as pieces of :data:`PIECE_BYTES`, one
per message (``ReadChunk.piece``, ``ExchangeMessage.piece``), in order, each
naming its sample, the whole payload's length and its own offset. No message
then comes near gRPC's limit whatever a sample's size, and a hop forwards a
large sample without ever holding it as one message on top of its bytes.

The receiving side knows from the manifest how long each sample is, so a
piece that claims another length, comes out of order or runs past its
sample is refused before anything is allocated for it.
"""

from __future__ import annotations

from collections.abc import Iterator

from dataquay.client.errors import PieceError
from dataquay.client.wire.channels import READ_CHUNK_BYTES

#: Bytes of one piece; a payload up to this size goes whole.
PIECE_BYTES = READ_CHUNK_BYTES


def pieces(payload: bytes | memoryview, size: int = PIECE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of each piece of ``payload``, in order."""
    view = memoryview(payload)
    for offset in range(0, len(view), size):
        yield offset, bytes(view[offset : offset + size])


class Joiner:
    """Joins the pieces of one payload at a time, as they arrive in order.

    Args:
        source: who sends the pieces, for messages ("the daemon", "peer n1").
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._parts: list[bytes] = []
        self._sample = -1
        self._length = 0
        self._got = 0

    @property
    def pending(self) -> int | None:
        """The sample whose pieces have begun and not ended, if any."""
        return self._sample if self._parts else None

    def add(self, sample_id: int, offset: int, length: int, data: bytes, expected: int) -> bytes | None:
        """Takes the next piece; the whole payload once this was its last, else None.

        ``expected`` is the payload's length as the manifest has it.

        Raises:
            PieceError: the piece does not continue the payload begun, or
                claims a length other than ``expected``.
        """
        if not self._parts:
            if offset or length != expected:
                raise PieceError(
                    f"{self.source} sent a piece of sample {sample_id} at offset {offset} of a {length}-byte "
                    f"payload, where a first piece of its {expected} bytes was due"
                )
            self._sample, self._length = sample_id, length
        elif sample_id != self._sample or offset != self._got or length != self._length:
            raise PieceError(
                f"{self.source} sent a piece of sample {sample_id} at offset {offset}, where the piece of "
                f"sample {self._sample} at offset {self._got} was due"
            )
        if not data or self._got + len(data) > self._length:
            raise PieceError(
                f"{self.source} sent {len(data)} bytes at offset {offset} of sample {sample_id}, "
                f"which has {self._length}"
            )
        self._parts.append(data)
        self._got += len(data)
        if self._got < self._length:
            return None
        whole = b"".join(self._parts)
        self._parts, self._sample, self._length, self._got = [], -1, 0, 0
        return whole

    def check_done(self) -> None:
        """Raises PieceError when a payload's pieces stopped before its end
        (another sample came, or the reply ended)."""
        if self._parts:
            raise PieceError(
                f"{self.source} stopped sending sample {self._sample} after {self._got} of its {self._length} bytes"
            )
