"""Epochs this node's ranks entered that the directory has not been told yet.

A node starts an epoch's exchange from the job record it holds, not from the
directory's answer (every node computes the same owners from the same
settings), so an epoch report is a message to send, not a call to wait on:
it waits here while the directory does not answer and goes when it is back.
Only the highest epoch of each job is kept, since the directory keeps a
job's highest epoch; a caller that wants the directory's answer waits on it
with a future of its own.
"""

from __future__ import annotations

import asyncio

from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.errors import DataquayError

#: What a waiter is handed: the directory's record of the job, or why it refused the report.
Answer = jpb.Job | DataquayError


class EpochReports:
    """The reports to send, one per job, and the callers waiting for their answers."""

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}
        self._waiting: dict[str, list[tuple[int, asyncio.Future[Answer]]]] = {}
        #: Set while a report waits to be sent.
        self.queued = asyncio.Event()

    def add(self, job_id: str, epoch: int) -> None:
        """Queues ``epoch`` of ``job_id`` (an older epoch than one queued changes nothing)."""
        self._pending[job_id] = max(epoch, self._pending.get(job_id, epoch))
        self.queued.set()

    def pending(self) -> list[tuple[str, int]]:
        """(job, epoch) of every report to send, by job."""
        return sorted(self._pending.items())

    def wait_for(self, job_id: str, epoch: int) -> asyncio.Future[Answer]:
        """A future the answer to a report of ``epoch`` or later is set on;
        :meth:`stop_waiting` it when giving up, so that none piles up."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job_id, []).append((epoch, future))
        return future

    def stop_waiting(self, job_id: str, future: asyncio.Future[Answer]) -> None:
        left = [(epoch, f) for epoch, f in self._waiting.get(job_id, []) if f is not future]
        if left:
            self._waiting[job_id] = left
        else:
            self._waiting.pop(job_id, None)

    def answered(self, job_id: str, epoch: int, answer: Answer) -> None:
        """The directory answered the report of ``epoch``: it leaves the queue
        unless a later epoch was queued meanwhile, and its waiters learn the answer."""
        if self._pending.get(job_id) == epoch:
            del self._pending[job_id]
        if not self._pending:
            self.queued.clear()
        left = []
        for waited, future in self._waiting.pop(job_id, []):
            if waited > epoch:
                left.append((waited, future))
            elif not future.done():
                future.set_result(answer)
        if left:
            self._waiting[job_id] = left
