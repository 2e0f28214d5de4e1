"""One coordinated prep group's state: who is in which epoch, who preps which
batch, which prepped batches are held and when each is freed. Sans-IO: the
caller passes the time and a test of whether a process lives, and removes
the segments :meth:`PrepGroup.take_freed` returns.

The deal is dynamic: a member that asks for work gets the lowest batch no one
holds, re-dealt batches of dropped members first, so a fast member preps more
and a dead member's share goes to whoever asks next. A batch is freed once
every member of the epoch has consumed it, exactly once, and never carried
into the next epoch. New members join at an epoch boundary: the first epoch
waits for ``jobs`` members (or ``timeout`` seconds), each later one starts
when every member of the one before has finished it. A member is dropped when
its process is gone, when it has not called for ``timeout`` seconds, or when
it made no progress for that long while others wait on it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from dataquay.protos import cache_pb2 as pb

#: Ready batches a reply lists from the member's position on.
READY_WINDOW = 8
#: Batches one member may hold for prep at once (one per prep thread).
MAX_CLAIMS = 16


@dataclass
class _Member:
    pid: int
    seen: float
    progress: float
    consumed: int = 0
    claims: dict[int, float] = field(default_factory=dict)  # batch -> when dealt


@dataclass(frozen=True)
class _Ready:
    segment: str
    nbytes: int


@dataclass(frozen=True)
class SyncAnswer:
    role: int
    claims: list[int]
    ready: list[tuple[int, str, int]]  # (batch, segment, bytes)
    members: int
    #: Segments the caller handed in that no one will read: the caller removes
    #: them (the daemon removes only segments it accepted into the group).
    rejected: list[str] = field(default_factory=list)


class PrepGroup:
    """See the module docstring; ``spec`` is the first member's."""

    def __init__(self, spec: pb.PrepGroupSpec, epoch: int, now: float) -> None:
        self.spec = spec
        self.epoch = epoch
        self.started = False
        self.formed_at = now
        self.members: dict[str, _Member] = {}
        self.waiting: dict[str, _Member] = {}
        self.version = 0
        self.prepped_total = 0
        self.dropped_total = 0
        self.redealt_total = 0
        self._prepped_bytes = 0
        self._freed: list[str] = []
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self._next = 0
        self._redealt: list[int] = []
        self.ready: dict[int, _Ready] = {}
        self.prepped_epoch = 0

    # ------------------------------------------------------------- calls

    def sync(self, request: pb.PrepSyncRequest, now: float, alive: Callable[[int], bool]) -> SyncAnswer:
        """Applies one member's call and answers it."""
        self.expire(now, alive)
        name, epoch = request.member, request.epoch
        member = self.members.get(name)
        rejected = [batch.segment for batch in request.prepped]
        if request.leave:
            self._leave(name)
        elif member is not None and epoch == self.epoch:
            member.seen = now
            rejected = self._hand_in(member, request.prepped, now)
            self._consumed(member, min(request.consumed, self.spec.num_batches), now)
        else:
            if member is not None:
                member.seen = now  # a call about an earlier epoch can still be on its way
            if member is not None and epoch == self.epoch + 1:
                self._finished_epoch(member, now)
            elif member is not None and epoch > self.epoch:
                self._leave(name)  # it skipped epochs: the group's is no longer its own
            if (epoch == self.epoch and not self.started) or (epoch == self.epoch + 1 and self.started):
                if name not in self.waiting:
                    self.waiting[name] = _Member(request.pid, now, now)
                    self.version += 1
                self.waiting[name].seen = now
        self._advance(now)
        member = self.members.get(name)
        if member is None or epoch != self.epoch:
            role = pb.PREP_WAIT if name in self.waiting else pb.PREP_SOLO
            return SyncAnswer(role, [], [], len(self.members), rejected)
        claims = self._deal(member, min(request.claim, MAX_CLAIMS), now)
        start = member.consumed
        ready = [(i, r.segment, r.nbytes) for i in range(start, start + READY_WINDOW) if (r := self.ready.get(i))]
        return SyncAnswer(pb.PREP_MEMBER, claims, ready, len(self.members), rejected)

    def expire(self, now: float, alive: Callable[[int], bool]) -> None:
        """Drops members whose process is gone, who went silent, or who hold the others up."""
        timeout = self.spec.timeout_seconds
        for name, member in list(self.waiting.items()):
            if not alive(member.pid) or now - member.seen > timeout:
                del self.waiting[name]
                self.version += 1
        consumed = [m.consumed for m in self.members.values()]
        slowest, fastest = min(consumed, default=0), max(consumed, default=0)
        budget_full = self.staged_bytes >= self.spec.memory_bytes
        for name, member in list(self.members.items()):
            done = member.consumed >= self.spec.num_batches
            holding_up = (
                (done and bool(self.waiting) and name not in self.waiting)
                or (budget_full and member.consumed == slowest < fastest)
                or any(now - dealt > timeout for dealt in member.claims.values())
            )
            if not alive(member.pid) or now - member.seen > timeout or (holding_up and now - member.progress > timeout):
                self._drop(name)
        self._advance(now)

    def take_freed(self) -> list[str]:
        """Segments no member needs any more, each returned once."""
        freed, self._freed = self._freed, []
        return freed

    def close(self) -> None:
        """Frees every segment the group still holds."""
        self._freed.extend(r.segment for r in self.ready.values())
        self.ready = {}

    @property
    def idle(self) -> bool:
        return not self.members and not self.waiting

    @property
    def staged_bytes(self) -> int:
        return sum(r.nbytes for r in self.ready.values())

    def status(self) -> pb.PrepGroupStatus:
        consumed = [m.consumed for m in self.members.values()]
        return pb.PrepGroupStatus(
            group=self.spec.group,
            dataset=self.spec.dataset,
            epoch=self.epoch,
            members=len(self.members),
            num_batches=self.spec.num_batches,
            batches_prepped=self.prepped_epoch,
            prepped_total=self.prepped_total,
            slowest_consumed=min(consumed, default=0),
            fastest_consumed=max(consumed, default=0),
            staged_bytes=self.staged_bytes,
            memory_bytes=self.spec.memory_bytes,
            dropped_total=self.dropped_total,
            redealt_total=self.redealt_total,
        )

    # --------------------------------------------------------- internals

    def _hand_in(self, member: _Member, prepped: list[pb.PreppedBatch], now: float) -> list[str]:
        """Accepts the batches that were dealt to ``member``; the segments of the others."""
        rejected = []
        for batch in prepped:
            if member.claims.pop(batch.index, None) is None or batch.index in self.ready:
                rejected.append(batch.segment)  # not dealt to it (any more): no one reads it
                continue
            self.ready[batch.index] = _Ready(batch.segment, batch.bytes)
            self.prepped_epoch += 1
            self.prepped_total += 1
            self._prepped_bytes += batch.bytes
            member.progress = now
            self.version += 1
        return rejected

    def _consumed(self, member: _Member, consumed: int, now: float) -> None:
        if consumed <= member.consumed:
            return
        member.consumed, member.progress = consumed, now
        self.version += 1
        self._free_used()

    def _free_used(self) -> None:
        """Frees the ready batches every member has consumed."""
        slowest = min((m.consumed for m in self.members.values()), default=self.spec.num_batches)
        for index in [i for i in self.ready if i < slowest]:
            self._freed.append(self.ready.pop(index).segment)

    def _finished_epoch(self, member: _Member, now: float) -> None:
        """A member moved on to the next epoch: whatever it did not consume it never will."""
        self._redeal(member)
        self._consumed(member, self.spec.num_batches, now)

    def _deal(self, member: _Member, held: int, now: float) -> list[int]:
        """One more batch for ``member`` if it holds fewer than ``held``: each of
        its prep threads asks for its own, so none gets another's share."""
        dealt: list[int] = []
        slowest = min(m.consumed for m in self.members.values())
        if len(member.claims) < held:
            index = self._redealt[0] if self._redealt else self._next
            if index < self.spec.num_batches and (index <= slowest or self._room_for_one()):
                if self._redealt:
                    heapq.heappop(self._redealt)
                else:
                    self._next += 1
                member.claims[index] = now
                dealt.append(index)
        return dealt

    def _room_for_one(self) -> bool:
        """Whether one more batch fits the budget, counting those being prepped at the average size."""
        average = self._prepped_bytes // self.prepped_total if self.prepped_total else 0
        in_prep = sum(len(m.claims) for m in self.members.values())
        return self.staged_bytes + (in_prep + 1) * average <= self.spec.memory_bytes

    def _redeal(self, member: _Member) -> None:
        for index in member.claims:
            heapq.heappush(self._redealt, index)
        self.redealt_total += len(member.claims)
        member.claims.clear()

    def _drop(self, name: str) -> None:
        self._redeal(self.members.pop(name))
        self.dropped_total += 1
        self.version += 1
        self._free_used()

    def _leave(self, name: str) -> None:
        member = self.members.pop(name, None)
        if member is not None:
            self._redeal(member)
            self._free_used()
        if self.waiting.pop(name, None) is not None or member is not None:
            self.version += 1

    def _advance(self, now: float) -> None:
        """Starts the first epoch once its members came, and each later one once the last is done."""
        if not self.started:
            enough = len(self.waiting) >= self.spec.jobs
            if self.waiting and (enough or now - self.formed_at > self.spec.timeout_seconds):
                self._start(now)
            return
        everyone_done = all(m.consumed >= self.spec.num_batches for m in self.members.values())
        moved_on = all(name in self.waiting for name in self.members)
        if self.waiting and everyone_done and moved_on:
            self.close()
            self.epoch += 1
            self._reset_epoch()
            self._start(now)
        elif not self.members:
            self.close()

    def _start(self, now: float) -> None:
        self.members = {name: _Member(m.pid, now, now) for name, m in self.waiting.items()}
        self.waiting = {}
        self.started = True
        self.version += 1
