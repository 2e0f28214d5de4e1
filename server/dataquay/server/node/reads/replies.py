"""A Read's reply as messages: each window's samples, in request order, in
messages of about READ_CHUNK_BYTES.

Messages are made as they are sent, so a reply is never held twice (once as
payloads and once as messages); only the message in flight is. A payload in
the caller's shared memory goes as its offset; a payload that repeats in a
window is placed there, or made into bytes, once, and named at every
position. A payload larger than a chunk goes inline as pieces, a message
each (:mod:`dataquay.client.wire.pieces`).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence

from dataquay.client.wire.channels import READ_CHUNK_BYTES
from dataquay.client.wire.pieces import PIECE_BYTES, pieces
from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.reads.served import MISSING, Served, Window
from dataquay.server.proto_maps import TIER_TO_PROTO


def reply_chunks(
    window: Window, offsets: Sequence[int | None], checked: Container[int] = (), limit: int = READ_CHUNK_BYTES
) -> Iterator[pb.ReadChunk]:
    """The messages of ``window``; ``offsets[k]`` is where ``window.served[k]``
    lies in the caller's segment, None for a payload that goes inline;
    ``checked`` holds the ids whose payloads the caller need not check there
    (:meth:`~dataquay.server.node.handoff.forward.ShmForward.trusted`)."""
    served = window.served
    inline: list[bytes | None] = [None] * len(served)
    chunk, size = pb.ReadChunk(), 0
    for k in window.index.tolist():
        s = served[k]
        offset = offsets[k]
        data, n = b"", 0
        if s.tier != MISSING and offset is None:
            cached = inline[k]
            if cached is None:
                if len(s.data) > PIECE_BYTES:
                    if len(chunk.samples):
                        yield chunk
                        chunk, size = pb.ReadChunk(), 0
                    yield from _pieces(s)
                    continue
                cached = inline[k] = bytes(s.data)
            data, n = cached, len(cached)
        if len(chunk.samples) and size + n > limit:
            yield chunk
            chunk, size = pb.ReadChunk(), 0
        # Added in place: a message made apart and then put in the chunk is copied into it.
        if s.tier == MISSING:
            chunk.samples.add(id=s.sample_id, missing=True)
        elif offset is not None:
            chunk.samples.add(
                id=s.sample_id,
                tier=TIER_TO_PROTO[s.tier],
                checksum=s.checksum,
                in_shm=True,
                shm_offset=offset,
                length=len(s.data),
                checked_in_place=s.sample_id in checked,
            )
        else:
            chunk.samples.add(id=s.sample_id, tier=TIER_TO_PROTO[s.tier], data=data, checksum=s.checksum)
        size += n
    if len(chunk.samples):
        yield chunk


def _pieces(s: Served) -> Iterator[pb.ReadChunk]:
    """One message per piece of a payload larger than a chunk."""
    tier, length = TIER_TO_PROTO[s.tier], len(s.data)
    for offset, part in pieces(s.data):
        yield pb.ReadChunk(
            piece=pb.Sample(id=s.sample_id, tier=tier, checksum=s.checksum, data=part, offset=offset, length=length)
        )
