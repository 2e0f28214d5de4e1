"""Batch reads a trainer asks on its memfd segment's connection, answered as a
streamed gRPC Read of the same batch would be, without the call's fixed cost.

The frames are :mod:`dataquay.client.wire.batch_reads`'s; the read is the
gRPC Read's own (:meth:`ReadService.read` with the payloads placed in the
segment by :class:`ShmForward`), and a domain error is answered with the
status code and class name the servicer would end the call with.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import TYPE_CHECKING

import numpy as np

from dataquay.client.wire.batch_reads import NOT_PLACED, OK, BatchReply, parse_request, reply_frame
from dataquay.client.wire.status_codes import code_number, status_of
from dataquay.server.errors import DataquayError
from dataquay.server.node.handoff.forward import ShmForward
from dataquay.server.node.users.callers import Caller
from dataquay.server.proto_maps import TIER_TO_PROTO
from dataquay.server.servicer_errors import MAX_DETAILS_CHARS

if TYPE_CHECKING:
    from prometheus_client import Histogram

    from dataquay.server.node.counters import FaceCounters
    from dataquay.server.node.handoff.segments import ShmSegments
    from dataquay.server.node.reads.service import ReadService
    from dataquay.server.node.users.access import UserAccess


class SegmentReads:
    """Answers framed batch reads into the segments of a daemon's trainers.

    Args:
        shm: the segments the payloads go into.
        access: who may read which dataset.
        reads: the gRPC Read's own reads.
        counters: what the faces count (payloads forwarded, batch reads answered).
        latency: the histogram of request times, by method.
    """

    def __init__(
        self, shm: ShmSegments, access: UserAccess, reads: ReadService, counters: FaceCounters, latency: Histogram
    ) -> None:
        self.shm = shm
        self.access = access
        self.reads = reads
        self.counters = counters
        self._latency = latency

    async def answer(self, segment: str, size: int, frame: bytes, caller: Caller) -> bytes:
        """The reply frame to request ``frame`` on the connection of ``segment``
        (of ``size`` bytes), which ``caller`` holds.

        Raises:
            ValueError: ``frame`` is not a request (the connection is to be closed).
        """
        started = time.perf_counter()
        request = parse_request(frame)
        forward = ShmForward(self.shm, segment, size)
        count = len(request.ids)
        offsets, lengths, checksums = (np.zeros(count, np.uint64) for _ in range(3))
        tiers, checked = np.zeros(count, np.uint8), np.zeros(count, np.uint8)
        at = 0
        try:
            await self.access.check_read(caller, request.dataset)
            windows = self.reads.read(
                request.dataset,
                request.ids,
                request.manifest_id,
                request.job,
                False,
                None,
                forward,
                epoch=request.epoch if request.job else None,
            )
            async with aclosing(windows):
                async for window in windows:
                    placed = forward.window(window.served)
                    if any(offset is None for offset in placed):
                        return reply_frame(BatchReply(NOT_PLACED))
                    served = window.served
                    stop = at + len(window.index)
                    offsets[at:stop] = np.array(placed, np.uint64)[window.index]
                    lengths[at:stop] = np.array([len(s.data) for s in served], np.uint64)[window.index]
                    checksums[at:stop] = np.array([s.checksum for s in served], np.uint64)[window.index]
                    tiers[at:stop] = np.array([TIER_TO_PROTO[s.tier] for s in served], np.uint8)[window.index]
                    trusted = forward.trusted(served)
                    checked[at:stop] = np.array([s.sample_id in trusted for s in served], np.uint8)[window.index]
                    at = stop
                    del window, served  # not held while the next one is resolved
        except DataquayError as exc:
            code, ((_, name),) = status_of(exc)
            return reply_frame(BatchReply(code_number(code), name, str(exc)[:MAX_DETAILS_CHARS]))
        self.counters.forwarded(forward.forwarded, len(forward.checked))
        self.counters.segment_read()
        self._latency.labels("Read").observe(time.perf_counter() - started)
        return reply_frame(
            BatchReply(OK, offsets=offsets, lengths=lengths, checksums=checksums, tiers=tiers, checked=checked)
        )
