"""How far this node's ranks have read each job's epoch, as their clients report it.

Local hits never reach the daemon, so a client reports its ranks' read
positions (:class:`~dataquay.client.sampler.JobSampler` moves them); the
sender deletes a sample it gave away only once the rank that reads it here has
gone past it. A report is only ever a reason to delete sooner: a rank that
reports nothing has its samples deleted when its node enters the next epoch
(one that reported a position in the epoch before is waited for until it has
read it all, or its node enters the epoch after),
and a position reported too far makes its rank read those samples from their
new owner, never a wrong byte.
"""

from __future__ import annotations

import numpy as np

#: A rank that reported a later epoch has read all of this one.
WHOLE_EPOCH = np.iinfo(np.int64).max


class ReadPositions:
    """The furthest (epoch, position) each rank of each job reported."""

    def __init__(self) -> None:
        self._ranks: dict[str, dict[int, tuple[int, int]]] = {}

    def report(self, job_id: str, epoch: int, rank: int, position: int) -> bool:
        """Keeps a report; True if it moved the rank on."""
        ranks = self._ranks.setdefault(job_id, {})
        if (epoch, position) <= ranks.get(rank, (-1, -1)):
            return False
        ranks[rank] = (epoch, position)
        return True

    def read_upto(self, job_id: str, epoch: int, ranks: np.ndarray) -> np.ndarray:
        """For each of ``ranks``, how many ids of its ``epoch`` order it has read."""
        reported = self._ranks.get(job_id, {})
        upto = np.zeros(len(ranks), dtype=np.int64)
        for i, rank in enumerate(ranks.tolist()):
            rank_epoch, position = reported.get(rank, (-1, 0))
            upto[i] = WHOLE_EPOCH if rank_epoch > epoch else position if rank_epoch == epoch else 0
        return upto

    def still_reading(self, job_id: str, epoch: int, ranks: np.ndarray) -> np.ndarray:
        """Which of ``ranks`` reported a position in ``epoch`` and none later."""
        reported = self._ranks.get(job_id, {})
        return np.array([reported.get(rank, (-1, 0))[0] == epoch for rank in ranks.tolist()], dtype=bool)

    def forget(self, keep: set[str]) -> None:
        """Drops the jobs not in ``keep`` (ended, or never known to this node)."""
        for job_id in set(self._ranks) - keep:
            del self._ranks[job_id]
