"""The ids of coded passes: random, drawn by the job's first node, agreed over TCP.

A pass's id keys its datagrams (:mod:`.mcast_seal`), so it must be the same at
every node of the pass and never the same for two passes: a job that runs
epoch e's pass again (after a restart, or a job re-created under its name)
gets a new id, and nothing captured from the earlier run verifies in it.
Every node computes the same plan but cannot draw the same random number, so
the job's first node draws it on the first request and the others ask it
over the authenticated TCP path (the ``CodedPass`` RPC).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

#: Ids kept per leading node: the passes of every job it leads that may still be under way.
KEPT_PASSES = 1024


class PassIds:
    """The ids of the passes this node leads (it is first among their job's nodes)."""

    def __init__(self) -> None:
        self._ids: OrderedDict[tuple[str, int], int] = OrderedDict()

    def issue(self, job: str, epoch: int) -> int:
        """The id of ``job``'s pass into ``epoch``: drawn on first request, the same after."""
        key = (job, epoch)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = secrets.randbits(64)
            while len(self._ids) > KEPT_PASSES:
                self._ids.popitem(last=False)
        return found
