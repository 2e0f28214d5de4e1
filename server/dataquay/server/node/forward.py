"""One reply's payloads in the caller's shared-memory segment, written as they arrive.

A peer hit has two hops: the owner to this daemon, this daemon to its
trainer. Gathering the whole batch before writing any of it into the
trainer's segment makes a peer hit cost their sum. Instead each payload that
lands from a peer is written into the segment at once (on the event loop,
while the bulk thread receives the next), and the window's reply later names
it by offset; only what was not forwarded is written when the window is
answered. Every write goes through :class:`ShmSegments`' public API, one
position moving through the segment for the whole reply.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataquay.server.node.reads import Served
from dataquay.server.node.shm import ShmSegments


class ShmForward:
    """The caller's segment ``name`` of ``size`` bytes, filled in arrival order."""

    def __init__(self, shm: ShmSegments, name: str, size: int) -> None:
        self.shm = shm
        self.name = name
        self.size = size
        self.at = 0
        #: Where each forwarded sample lies in the segment.
        self.placed: dict[int, int] = {}
        self.forwarded = 0

    def arrived(self, landed: list[tuple[int, memoryview, int]]) -> None:
        """Writes payloads as they land (their checksums were checked on arrival)."""
        new = [(sample_id, payload) for sample_id, payload, _digest in landed if sample_id not in self.placed]
        if not new:
            return
        offsets, self.at = self.shm.write(self.name, self.size, [payload for _, payload in new], self.at)
        for (sample_id, _), offset in zip(new, offsets):
            if offset is not None:
                self.placed[sample_id] = offset
                self.forwarded += 1

    def window(self, served: Sequence[Served]) -> list[int | None]:
        """The offset of each of a window's samples, writing those not forwarded
        yet; None for one that goes inline."""
        offsets: list[int | None] = [self.placed.get(s.sample_id) for s in served]
        rest = [k for k, offset in enumerate(offsets) if offset is None]
        if rest:
            written, self.at = self.shm.write(self.name, self.size, [served[k].data for k in rest], self.at)
            for k, offset in zip(rest, written):
                offsets[k] = offset
        return offsets
