"""One reply's payloads in the caller's shared-memory segment, written as they arrive.

A peer hit has two hops: the owner to this daemon, this daemon to its
trainer. Gathering the whole batch before writing any of it into the
trainer's segment makes a peer hit cost their sum and copy it twice.
Instead, into a sealed memfd segment, which the daemon has mapped and a
store into which cannot fault (:mod:`.segments`), a bulk read receives each
payload straight at its place (:meth:`ShmForward.reserve`, from the bulk
thread), so that the kernel's copy out of the socket is the only copy of
the peer's bytes on this node; its xxh3 is checked there, and a payload
that fails it is never named in a reply (the bytes left in the segment are
the trainer's to overwrite). A sample's room stays its own until it is
written: one a peer did not send after all is written there once it comes
from elsewhere. The window's reply names each by offset; only what was not
forwarded is written when the window is answered. One position moves
through the segment for the whole reply.

The reply marks the payloads checked in place (``Sample.checked_in_place``),
which the trainer then need not check again (:mod:`dataquay.client.remote`):
those, and those copied into a memfd segment from this node's cache, each
checked there against the checksum stored with it.
A /dev/shm segment is written with ``pwrite`` only, when the window is
answered.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from dataquay.client.wire.record_loops import payloads_into
from dataquay.client.wire.records import CHECKSUM_BYTES
from dataquay.client.wire.tiers import CACHE
from dataquay.server.node.handoff.segments import ShmSegments, aligned, fit
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
        #: Room given to a sample not written there yet (a peer read's, in
        #: flight or come back without it): kept for that sample alone.
        self._rooms: dict[int, int] = {}
        self._lock = threading.Lock()

    def reserve(self, ids: np.ndarray, lengths: np.ndarray) -> list[memoryview | None]:
        """Room in a memfd segment for each of a peer read's payloads to be
        received into; None (a buffer of its own) for each in a /dev/shm
        segment, placed already, or past the segment's end."""
        out: list[memoryview | None] = [None] * len(ids)
        with self._lock:
            view = self._view()
            if view is None:
                return out
            for k, (sample_id, length) in enumerate(zip(ids.tolist(), lengths.tolist())):
                offset = self._room(sample_id, length, len(view))
                if offset is not None:
                    out[k] = view[offset : offset + length]
            return out

    def received(self, ids: list[int]) -> None:
        """The payloads of ``ids`` were received where :meth:`reserve` put them and passed their checksums there."""
        with self._lock:
            for sample_id in ids:
                self.placed[sample_id] = self._rooms.pop(sample_id)
            self.forwarded += len(ids)
            self.checked.update(ids)

    def copy_in(self, ids: Sequence[int], values: list[memoryview | None]) -> list[memoryview | None]:
        """Copies the payloads of cache values read from this node's cache
        straight into a memfd segment (the one copy each needs on its way to
        the trainer), each checked there against its stored checksum, in one
        call without the GIL: the view of each intact copy; None for each in
        a /dev/shm segment, absent, placed already, out of room or corrupt
        (whose room stays its own, for its bytes from elsewhere)."""
        out: list[memoryview | None] = [None] * len(ids)
        with self._lock:
            view = self._view()
            if view is None:
                return out
            picked: list[tuple[int, int, memoryview]] = []
            for k, (sample_id, value) in enumerate(zip(ids, values)):
                if value is None or len(value) < CHECKSUM_BYTES:
                    continue
                offset = self._room(sample_id, len(value) - CHECKSUM_BYTES, len(view))
                if offset is not None:
                    picked.append((k, offset, value))
            # The view is held meanwhile, so the client's letting go cannot unmap the segment under the copy.
            intact = payloads_into([value for *_, value in picked], view, [offset for _, offset, _ in picked])
            for (k, offset, value), ok in zip(picked, intact):
                if ok:
                    self.placed[ids[k]] = self._rooms.pop(ids[k])
                    out[k] = view[offset : offset + len(value) - CHECKSUM_BYTES]
        return out

    def window(self, served: Sequence[Served]) -> list[int | None]:
        """The offset of each of a window's samples, writing those not forwarded
        yet (into the room a peer read left them, where it did); None for one
        that goes inline."""
        with self._lock:
            offsets: list[int | None] = [self.placed.get(s.sample_id) for s in served]
            rest = [k for k, offset in enumerate(offsets) if offset is None]
            for k in [k for k in rest if served[k].sample_id in self._rooms]:
                offsets[k] = self._fill_room(served[k].sample_id, served[k].data)
            rest = [k for k in rest if offsets[k] is None]
            if rest:
                written, self.at = self.shm.write(self.name, self.size, [served[k].data for k in rest], self.at)
                for k, offset in zip(rest, written):
                    offsets[k] = offset
            return offsets

    def trusted(self, served: Sequence[Served]) -> set[int]:
        """The ids of ``served`` whose payloads the trainer need not check in
        a memfd segment: received there and checked there, or copied there
        from this node's cache (checked against its stored checksum: a check
        per hop, and the segment adds none); none in a /dev/shm segment."""
        if self._mapping is None:
            return set()
        with self._lock:
            return {s.sample_id for s in served if s.sample_id in self.checked or s.tier == CACHE}

    def _view(self) -> memoryview | None:
        """The memfd segment's mapping; None for a /dev/shm segment or one
        the client let go of (unmapped)."""
        if self._mapping is None:
            return None
        try:
            return memoryview(self._mapping)
        except ValueError:
            return None

    def _fill_room(self, sample_id: int, payload: bytes | memoryview) -> int | None:
        """Writes ``sample_id``'s payload into the room it was given: its
        offset, or None where the segment is gone. Under the lock."""
        assert self._mapping is not None  # rooms are given in a memfd segment only
        offset = self._rooms.pop(sample_id)
        try:
            self._mapping[offset : offset + len(payload)] = payload
        except ValueError:  # unmapped: the client let go of the segment
            return None
        self.placed[sample_id] = offset
        return offset

    def _room(self, sample_id: int, length: int, mapped: int) -> int | None:
        """Where ``sample_id`` goes: the room it was given, else new room at
        the end of what was given out; None for one placed already or one
        that does not fit. Under the lock."""
        if sample_id in self.placed:
            return None
        offset = self._rooms.get(sample_id)
        if offset is not None:
            return offset
        offset = fit(self.at, length, min(self.size, mapped))
        if offset is None:
            return None
        self.at = aligned(offset + length)
        self._rooms[sample_id] = offset
        return offset
