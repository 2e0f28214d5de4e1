"""What the daemon's faces count as they answer trainers.

The gRPC servicer and the fd socket's batch reads both hand payloads into
trainers' segments; they bump one object, which the daemon's snapshot
(:mod:`.snapshot`) reads for Stats and /metrics alike. Counts that belong to
a part (the bulk listener's, the exchange's, the store's) stay with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FaceCounters:
    """Counts since the daemon started."""

    #: Peer payloads in trainers' segments before their windows were answered (see node/handoff/forward.py).
    forwarded_samples: int = 0
    #: Of those, received from the peer straight into a sealed memfd segment.
    in_place_samples: int = 0
    #: Trainers' batch reads answered on their segments' connections (see node/handoff/batch_reads.py).
    segment_reads: int = 0

    def forwarded(self, samples: int, in_place: int) -> None:
        """One read placed ``samples`` peer payloads in a segment, ``in_place`` of them received there."""
        self.forwarded_samples += samples
        self.in_place_samples += in_place

    def segment_read(self) -> None:
        """One batch read was answered on a segment's connection."""
        self.segment_reads += 1
