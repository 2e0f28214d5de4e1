"""One reply's payloads in the caller's shared-memory segment, written as they arrive.

A peer hit has two hops: the owner to this daemon, this daemon to its
trainer. Gathering the whole batch before writing any of it into the
trainer's segment makes a peer hit cost their sum. Instead each payload that
lands from a peer goes into the segment at once, and the window's reply
later names it by offset; only what was not forwarded is written when the
window is answered. One position moves through the segment for the whole
reply.

Into a sealed memfd segment, which the daemon has mapped and a store into
which cannot fault (:mod:`.segments`), a bulk read receives each payload straight
at its place (:meth:`ShmForward.place`, from the bulk thread), so that the
kernel's copy out of the socket is the only copy of the peer's bytes on this
node; its xxh3 is checked there, and a payload that fails it is never named
in a reply (the bytes left in the segment are the trainer's to overwrite).
The reply marks the payloads checked in place (``Sample.checked_in_place``),
which the trainer then need not check again (:mod:`dataquay.client.remote`):
those, and those copied into a memfd segment from this node's cache, whose
values the read checked against the checksums stored with them.
Into a /dev/shm segment, which is written with ``pwrite`` only, each payload
is received into a buffer and written on the event loop as it lands.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dataquay.client.wire.tiers import CACHE
from dataquay.server.node.handoff.segments import ShmSegments, aligned, place
from dataquay.server.node.reads.served import Served


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
        #: Of those, the ones received straight into the segment and checked there.
        self.checked: set[int] = set()
        self._mapping = shm.mapping(name)
        #: Where each sample being received in place goes: (offset, end of its room).
        self._receiving: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def place(self, sample_id: int, length: int) -> memoryview | None:
        """Room in a memfd segment for ``sample_id``'s payload to be received
        into; None (a buffer of its own) for a /dev/shm segment, a sample
        placed or being received already, or one that does not fit."""
        mapping = self._mapping
        if mapping is None:
            return None
        with self._lock:
            if sample_id in self.placed or sample_id in self._receiving:
                return None
            try:
                offset = next(place([length], min(self.size, len(mapping)), self.at))
                if offset is None:
                    return None
                view = memoryview(mapping)[offset : offset + length]
            except ValueError:  # unmapped: the client let go of the segment
                return None
            self.at = aligned(offset + length)
            self._receiving[sample_id] = (offset, self.at)
            return view

    def failed(self, sample_id: int) -> None:
        """``sample_id``'s payload failed its checksum where :meth:`place` put
        it: its room is given out again if nothing was placed after it (so
        that what replaces it still fits a segment sized to the batch)."""
        with self._lock:
            offset, end = self._receiving.pop(sample_id)
            if self.at == end:
                self.at = offset

    def received(self, sample_id: int) -> None:
        """``sample_id`` was received where :meth:`place` put it and passed its checksum there."""
        with self._lock:
            self.placed[sample_id] = self._receiving.pop(sample_id)[0]
            self.forwarded += 1
            self.checked.add(sample_id)

    def copy_in(self, sample_id: int, payload: memoryview) -> memoryview | None:
        """Copies a payload read from this node's cache straight into a memfd
        segment (the one copy it needs on its way to the trainer); None for a
        /dev/shm segment, or one placed already or out of room."""
        target = self.place(sample_id, len(payload))
        if target is None:
            return None
        target[:] = payload
        with self._lock:
            self.placed[sample_id] = self._receiving.pop(sample_id)[0]
        return target

    def arrived(self, landed: list[tuple[int, memoryview, int]]) -> None:
        """Writes payloads received into buffers of their own as they land
        (their checksums were checked on arrival)."""
        with self._lock:
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
        with self._lock:
            offsets: list[int | None] = [self.placed.get(s.sample_id) for s in served]
            rest = [k for k, offset in enumerate(offsets) if offset is None]
            if rest:
                written, self.at = self.shm.write(self.name, self.size, [served[k].data for k in rest], self.at)
                for k, offset in zip(rest, written):
                    offsets[k] = offset
            return offsets

    def trusted(self, served: Sequence[Served]) -> set[int]:
        """The ids of ``served`` whose payloads the trainer need not check in
        a memfd segment: received there and checked there, or copied there
        from this node's cache (checked against its stored checksum as it was
        read: a check per hop, and the segment adds none); none in a /dev/shm
        segment."""
        if self._mapping is None:
            return set()
        with self._lock:
            return {s.sample_id for s in served if s.sample_id in self.checked or s.tier == CACHE}
