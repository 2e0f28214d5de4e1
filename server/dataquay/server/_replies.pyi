"""The receiving end of a bulk READ's reply, in C (dataquay.server.node.peers.bulk.replies)."""

import numpy as np

HEADER_BYTES: int
FRAME_OK: int
FRAME_MISSING: int
FRAME_END: int
FRAME_ERROR: int

def receive_frames(
    fd: int,
    header: bytearray,
    ids: np.ndarray,
    targets: list[memoryview],
    digests: np.ndarray,
    statuses: np.ndarray,
    end: float,
    /,
) -> tuple[int, int, int, int, int]: ...
