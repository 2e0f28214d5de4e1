"""What the exchange's sending and receiving sides of one node tell each other.

The receiver must never acknowledge a sample as held while the sender deletes
it, the sender must keep what the receiver answered as held for an epoch to come,
a full receiver asks the sender to give up samples to make room, an offer
waits for the coded pass into its epoch, and an offer into a later epoch
waits while this node's ranks wait for the exchange into an earlier one (it
would take the room their arrivals need), and the receiver knows which epoch
this node's ranks entered. Both sides get this broker when they
are built; neither reaches into the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import numpy as np

#: Deletes samples given away and not yet shipped, about the bytes asked; returns how many.
MakeRoom = Callable[[int], Awaitable[int]]


class ExchangeBroker:
    """The one node's shared state of its exchange sender and receiver."""

    def __init__(self) -> None:
        #: Held while the receiver answers "already held" and while the sender
        #: deletes given-away samples, so a sample is never acknowledged and then deleted.
        self.holding = asyncio.Lock()
        self._held: dict[tuple[str, int], np.ndarray] = {}
        self._room_makers: list[MakeRoom] = []
        self._coded: dict[tuple[str, int], asyncio.Event] = {}
        #: (job, epoch) of each rank here waiting for the exchange into that epoch.
        self._ranks_wait: list[tuple[str, int]] = []
        self._wait_ended = asyncio.Event()
        self._entered: dict[str, int] = {}

    def answered_held(self, job: str, epoch: int, ids: np.ndarray) -> None:
        """An offer for ``epoch`` of ``job`` was answered: ``ids`` are held here,
        and will not be sent; call under :attr:`holding`."""
        if len(ids):
            known = self._held.get((job, epoch))
            self._held[(job, epoch)] = ids if known is None else np.union1d(known, ids)

    def held_beyond(self, job: str, epoch: int) -> np.ndarray:
        """The ids answered as held to offers for epochs of ``job`` after
        ``epoch``, which the sender must keep; forgets those up to it."""
        for key in [k for k in self._held if k[0] == job and k[1] <= epoch]:
            del self._held[key]
        kept = [ids for (j, _), ids in self._held.items() if j == job]
        return np.unique(np.concatenate(kept)) if kept else np.empty(0, np.int64)

    def entered(self, job: str, epoch: int) -> None:
        """This node's ranks entered ``epoch`` of ``job`` (the sender's news)."""
        self._entered[job] = max(self._entered.get(job, -1), epoch)

    def entered_epoch(self, job: str) -> int:
        """The latest epoch of ``job`` this node's ranks entered; -1 before any."""
        return self._entered.get(job, -1)

    def makes_room(self, make_room: MakeRoom) -> None:
        """The sender's way to give up samples when the receiver waits for room."""
        self._room_makers.append(make_room)

    async def make_room(self, nbytes: int) -> int:
        """Asks the sender to delete about ``nbytes`` of samples it gives away; how many it deleted."""
        deleted = 0
        for make_room in self._room_makers:
            deleted += await make_room(nbytes)
        return deleted

    @contextmanager
    def coded_pass(self, job: str, epoch: int) -> Iterator[None]:
        """Marks the coded pass into ``epoch`` of ``job`` under way while the block runs."""
        key = (job, epoch)
        over = self._coded[key] = asyncio.Event()
        try:
            yield
        finally:
            over.set()
            if self._coded.get(key) is over:
                del self._coded[key]

    async def coded_pass_over(self, job: str, epoch: int) -> None:
        """Waits for the coded pass into ``epoch`` of ``job``, if one is under way."""
        over = self._coded.get((job, epoch))
        if over is not None:
            await over.wait()

    @contextmanager
    def ranks_wait(self, job: str, epoch: int) -> Iterator[None]:
        """Marks a rank here waiting for the exchange into ``epoch`` of ``job`` while the block runs."""
        self._ranks_wait.append((job, epoch))
        try:
            yield
        finally:
            self._ranks_wait.remove((job, epoch))
            ended, self._wait_ended = self._wait_ended, asyncio.Event()
            ended.set()

    async def ranks_waits_before(self, job: str, epoch: int) -> None:
        """Waits while a rank here waits for the exchange into an epoch of ``job`` before ``epoch``."""
        while any(j == job and e < epoch for j, e in self._ranks_wait):
            await self._wait_ended.wait()
