"""A Read's reply as messages: each window's samples, in request order, in
messages of about READ_CHUNK_BYTES.

Messages are made as they are sent, so a reply is never held twice (once as
payloads and once as messages); only the message in flight is. A payload in
the caller's shared memory goes as its offset; a payload that repeats in a
window is placed there, or made into bytes, once, and named at every
position. A payload larger than a chunk goes inline as pieces, a message
each (:mod:`dataquay.client.pieces`).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence

from dataquay.client.channels import READ_CHUNK_BYTES
from dataquay.client.pieces import PIECE_BYTES, pieces
from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.reads import MISSING, Served, Window
from dataquay.server.proto_maps import TIER_TO_PROTO


def reply_chunks(
    window: Window, offsets: Sequence[int | None], checked: Container[int] = (), limit: int = READ_CHUNK_BYTES
) -> Iterator[pb.ReadChunk]:
    """The messages of ``window``; ``offsets[k]`` is where ``window.served[k]``
    lies in the caller's segment, None for a payload that goes inline;
    ``checked`` holds the ids whose payloads were checked where they lie there."""
    served = window.served
    inline: list[bytes | None] = [None] * len(served)
    chunk: list[pb.Sample] = []
    size = 0
    for k in window.index.tolist():
        s = served[k]
        offset = offsets[k]
        if s.tier == MISSING:
            sample, n = pb.Sample(id=s.sample_id, missing=True), 0
        elif offset is not None:
            sample = pb.Sample(id=s.sample_id, tier=TIER_TO_PROTO[s.tier], checksum=s.checksum, in_shm=True,
                               shm_offset=offset, length=len(s.data), checked_in_place=s.sample_id in checked)
            n = 0
        else:
            data = inline[k]
            if data is None:
                if len(s.data) > PIECE_BYTES:
                    if chunk:
                        yield pb.ReadChunk(samples=chunk)
                        chunk, size = [], 0
                    yield from _pieces(s)
                    continue
                data = inline[k] = bytes(s.data)
            sample = pb.Sample(id=s.sample_id, tier=TIER_TO_PROTO[s.tier], data=data, checksum=s.checksum)
            n = len(data)
        if chunk and size + n > limit:
            yield pb.ReadChunk(samples=chunk)
            chunk, size = [], 0
        chunk.append(sample)
        size += n
    if chunk:
        yield pb.ReadChunk(samples=chunk)


def _pieces(s: Served) -> Iterator[pb.ReadChunk]:
    """One message per piece of a payload larger than a chunk."""
    tier, length = TIER_TO_PROTO[s.tier], len(s.data)
    for offset, part in pieces(s.data):
        yield pb.ReadChunk(piece=pb.Sample(
            id=s.sample_id, tier=tier, checksum=s.checksum, data=part, offset=offset, length=length))
