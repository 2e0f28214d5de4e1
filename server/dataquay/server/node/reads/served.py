"""What a read resolves to, a window at a time: each distinct sample with
the tier it came from. Shared by the read service, its peer answers and the
reply's framing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

#: A sample found elsewhere than in this node's cache: (tier, payload, checksum).
Found = tuple[str, bytes | memoryview, int]

#: Tier of a sample a peer was asked for and does not hold.
MISSING = "missing"


class Served(NamedTuple):
    """One distinct sample of a reply (a tuple: a read makes one per sample)."""

    sample_id: int
    tier: str
    data: bytes | memoryview
    checksum: int


@dataclass(frozen=True)
class Window:
    """Consecutive positions of a reply, resolved together: ``served`` holds
    each distinct id once, ``index`` the entry of ``served`` at each position."""

    served: list[Served]
    index: np.ndarray
