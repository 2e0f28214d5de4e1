"""What the exchange's sending and receiving sides of one node tell each other.

The receiver must never acknowledge a sample as held while the sender deletes
it, the sender must keep what was offered to this node for an epoch to come,
a full receiver asks the sender to give up samples to make room, an offer
waits for the coded pass into its epoch, and an offer into a later epoch
waits while this node's ranks wait for the exchange into an earlier one (it
would take the room their arrivals need). Both sides get this broker when they
are built; neither reaches into the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

#: Deletes samples given away and not yet shipped, about the bytes asked; returns how many.
MakeRoom = Callable[[int], Awaitable[int]]


class ExchangeBroker:
    """The one node's shared state of its exchange sender and receiver."""

    def __init__(self) -> None:
        #: Held while the receiver answers "already held" and while the sender
        #: deletes given-away samples, so a sample is never acknowledged and then deleted.
        self.holding = asyncio.Lock()
        self._offered: dict[str, int] = {}
        self._room_makers: list[MakeRoom] = []
        self._coded: dict[tuple[str, int], asyncio.Event] = {}
        #: (job, epoch) of each rank here waiting for the exchange into that epoch.
        self._ranks_wait: list[tuple[str, int]] = []
        self._wait_ended = asyncio.Event()

    def offered(self, job: str, epoch: int) -> None:
        """An offer for ``epoch`` of ``job`` came in; call under :attr:`holding`."""
        self._offered[job] = max(self._offered.get(job, 0), epoch)

    def offered_upto(self, job: str) -> int:
        """The highest epoch of ``job`` offered to this node (0: none): the
        sender drops nothing this node owns up to it."""
        return self._offered.get(job, 0)

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
