"""The daemon's coordinated prep groups (:mod:`.group` holds one's state):
creating them, answering members' calls, waiting for news on their behalf,
and removing the shared-memory segments of freed batches.

The daemon is the one long-lived process of the node, so it keeps the groups:
members come and go, any of them can be killed, and the group's state (and
the names of the segments it holds) outlives each of them. A member's call
waits up to its ``wait_seconds`` for something it can use (a batch to prep,
the batch it needs next, the epoch's start), so members neither spin nor
sleep past the moment their batch is ready.

Groups belong to an owner: on a daemon that keeps its users apart, the uid
of the members (:mod:`dataquay.server.node.users`), so that a group's name
means a group of the caller's own user, another user never reaches its
batches, and each user keeps at most ``per_owner`` groups; otherwise one
owner (None) for all. A refusal names the rule or the field that differs,
never a value of the group's settings.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from contextlib import suppress

from dataquay.client import prepped
from dataquay.client.errors import InvalidRequestError, JobMismatchError
from dataquay.client.wire.shm import SHM_DIR, process_alive
from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.prep.group import MAX_CLAIMS, PrepGroup, SyncAnswer

#: Groups one daemon keeps at once.
MAX_GROUPS = 64
#: Members of one group (the first epoch's ``jobs`` included).
MAX_MEMBERS = 64
#: Longest a call waits for news before it is answered anyway.
MAX_WAIT_SECONDS = 5.0
_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class PrepGroups:
    """Every prep group of this daemon, by owner and name."""

    def __init__(self, daemon_pid: int, per_owner: int = MAX_GROUPS) -> None:
        self._daemon_pid = daemon_pid
        self._per_owner = per_owner
        self._groups: dict[tuple[int | None, str], PrepGroup] = {}
        self._changed = asyncio.Event()
        self._unfreed: list[str] = []  # segments the daemon may not remove (another user's)

    async def sync(self, request: pb.PrepSyncRequest, owner: int | None = None) -> pb.PrepSyncReply:
        """Answers a member's call to a group of ``owner``, waiting up to its ``wait_seconds`` for news.

        Raises:
            InvalidRequestError: a spec or member no group can have.
            JobMismatchError: the group exists with other settings.
        """
        check(request, self._daemon_pid)
        if owner is not None:
            check_owned(request, owner)
        answer = self._apply(request, owner)
        rejected = answer.rejected
        wait = min(request.wait_seconds, MAX_WAIT_SECONDS) if math.isfinite(request.wait_seconds) else 0.0
        deadline = time.monotonic() + max(0.0, wait)
        again = pb.PrepSyncRequest()
        again.CopyFrom(request)
        del again.prepped[:]
        while not _useful(answer, request) and (left := deadline - time.monotonic()) > 0:
            changed = self._changed
            with suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
            answer = self._apply(again, owner)
        free, self._unfreed = rejected + self._unfreed, []
        return pb.PrepSyncReply(
            role=answer.role,  # type: ignore[arg-type]
            claims=answer.claims,
            ready=[pb.PreppedBatch(index=i, segment=s, bytes=n) for i, s, n in answer.ready],
            free=free,
            members=answer.members,
            daemon_pid=self._daemon_pid,
        )

    def reap(self) -> None:
        """Drops the dead and silent members of every group, and the groups left
        empty; removes what the groups of daemons that died left in shared memory."""
        prepped.remove_orphans()
        now = time.monotonic()
        for key, group in list(self._groups.items()):
            before = group.version
            group.expire(now, process_alive)
            self._settle(key, group, before)

    def status(self) -> list[pb.PrepGroupStatus]:
        return [group.status() for group in self._groups.values()]

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
            prepped.unlink(group.take_freed())
        self._groups = {}

    def _apply(self, request: pb.PrepSyncRequest, owner: int | None) -> SyncAnswer:
        name = request.spec.group
        key = (owner, name)
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= MAX_GROUPS:
                raise InvalidRequestError(f"this daemon already keeps {MAX_GROUPS} prep groups")
            if owner is not None and sum(1 for o, _ in self._groups if o == owner) >= self._per_owner:
                raise InvalidRequestError(
                    f"uid {owner} already keeps {self._per_owner} prep groups on this daemon, as many as one user "
                    "may (--prep-groups-per-user)"
                )
            group = self._groups[key] = PrepGroup(request.spec, request.epoch, time.monotonic())
        elif group.spec != request.spec:
            raise JobMismatchError(mismatch(group.spec, request.spec))
        elif request.member not in group.members and len(group.members) + len(group.waiting) >= MAX_MEMBERS:
            raise InvalidRequestError(f"prep group {name!r} already has {MAX_MEMBERS} members")
        before = group.version
        answer = group.sync(request, time.monotonic(), process_alive)
        self._settle(key, group, before)
        return answer

    def _settle(self, key: tuple[int | None, str], group: PrepGroup, version: int) -> None:
        """Removes freed segments, forgets an empty group and wakes the waiting calls after a change."""
        if group.idle:
            group.close()
            del self._groups[key]
        self._unfreed.extend(prepped.unlink(group.take_freed()))
        if group.version != version or group.idle:
            self._changed.set()
            self._changed = asyncio.Event()


def _useful(answer: SyncAnswer, request: pb.PrepSyncRequest) -> bool:
    """Whether a reply gives the caller something to act on: work, the batch
    it needs next, or the news that it must go on alone."""
    if request.leave or answer.role == pb.PREP_SOLO:
        return True
    if answer.role != pb.PREP_MEMBER:
        return False
    if request.claim:
        return bool(answer.claims)
    if request.consumed >= request.spec.num_batches:
        return True
    return any(index == request.consumed for index, _, _ in answer.ready)


def check(request: pb.PrepSyncRequest, daemon_pid: int) -> None:
    """Refuses a call whose spec or member no group can have, or that hands
    in a segment that is not one of this daemon's groups'.

    Raises:
        InvalidRequestError: naming the field and the allowed range.
    """
    spec = request.spec
    problems = [
        (not _NAME.match(spec.group), f"group name {spec.group[:200]!r} must be 1-128 of A-Z a-z 0-9 . _ : -"),
        (not _NAME.match(request.member), f"member id {request.member[:200]!r} must be 1-128 of A-Z a-z 0-9 . _ : -"),
        (not spec.dataset, "a prep group needs a dataset"),
        (not 1 <= spec.jobs <= MAX_MEMBERS, f"jobs must be 1 to {MAX_MEMBERS}, not {spec.jobs}"),
        (spec.batch_size < 1, "batch_size must be at least 1"),
        (not 1 <= spec.num_batches <= 1 << 31, f"num_batches must be 1 to 2**31, not {spec.num_batches}"),
        (spec.memory_bytes < 1, "memory_bytes must be at least 1"),
        (
            not (math.isfinite(spec.timeout_seconds) and 0 < spec.timeout_seconds <= 86400),
            f"timeout_seconds must be above 0 and at most a day, not {spec.timeout_seconds}",
        ),
        (request.claim > MAX_CLAIMS, f"claim must be at most {MAX_CLAIMS}, not {request.claim}"),
        (
            any(prepped.daemon_pid(b.segment) != daemon_pid for b in request.prepped),
            f"prepped batches' segments are named {prepped.PREFIX}{daemon_pid}-<pid>-<token>",
        ),
    ]
    for failed, message in problems:
        if failed:
            raise InvalidRequestError(message)


def check_owned(request: pb.PrepSyncRequest, owner: int) -> None:
    """Refuses prepped batches in segments of another user than the member's:
    the group would hand them to its members and the daemon remove them once
    read, another user's batch as well.

    Raises:
        InvalidRequestError: naming the rule.
    """
    for batch in request.prepped:
        try:
            found = os.stat(SHM_DIR / batch.segment, follow_symlinks=False).st_uid
        except OSError:
            continue  # gone already: the group's readers find it missing, as for any segment lost
        if found != owner:
            raise InvalidRequestError(
                f"a prepped batch must be in a segment of the member's own user (uid {owner}); {batch.segment!r} is not"
            )


def mismatch(have: pb.PrepGroupSpec, given: pb.PrepGroupSpec) -> str:
    """Which setting differs between a group's spec and a member's, for the
    error message: the field's name, never the group's value (a member's
    error must not teach the group's settings one field at a time)."""
    for field in have.DESCRIPTOR.fields:
        if getattr(have, field.name) != getattr(given, field.name):
            return f"prep group {have.group!r} has another {field.name} than this member; its members must agree"
    return f"prep group {have.group!r} has other settings"
