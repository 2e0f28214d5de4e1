"""A coordinated prep group's state machine, driven without sockets or processes:
the deal, freeing once every member consumed a batch, the budget, epoch
boundaries, and members that die, go silent or stall."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.prep.group import PrepGroup, SyncAnswer
from dataquay.server.node.prep.groups import check, mismatch

BATCHES = 6


def spec(jobs: int = 2, memory: int = 1 << 20, timeout: float = 10.0) -> pb.PrepGroupSpec:
    return pb.PrepGroupSpec(
        group="g",
        dataset="ds",
        manifest_id="m",
        jobs=jobs,
        batch_size=4,
        seed=0,
        num_batches=BATCHES,
        memory_bytes=memory,
        timeout_seconds=timeout,
    )


class Members:
    """Calls a group as its members would, with a clock and a set of live pids."""

    def __init__(self, group: PrepGroup) -> None:
        self.group = group
        self.now = 0.0
        self.dead: set[int] = set()

    def call(
        self,
        member: str,
        epoch: int = 0,
        consumed: int = 0,
        claim: int = 0,
        prepped: tuple[int, ...] = (),
        size: int = 100,
        leave: bool = False,
    ) -> tuple[int, list[int], list[int]]:
        self.last = self.answer(member, epoch, consumed, claim, prepped, size, leave)
        return self.last.role, self.last.claims, [index for index, _, _ in self.last.ready]

    def answer(
        self, member: str, epoch: int, consumed: int, claim: int, prepped: tuple[int, ...], size: int, leave: bool
    ) -> SyncAnswer:
        request = pb.PrepSyncRequest(
            spec=self.group.spec,
            member=member,
            pid=int(member[1:]),
            epoch=epoch,
            consumed=consumed,
            claim=claim,
            prepped=[
                pb.PreppedBatch(index=i, segment=f"dataquay-prep-{member}-{epoch}-{i}", bytes=size) for i in prepped
            ],
            leave=leave,
        )
        return self.group.sync(request, self.now, lambda pid: pid not in self.dead)


def started(jobs: int = 2, **settings: float) -> Members:
    members = Members(PrepGroup(spec(jobs, **settings), 0, 0.0))  # type: ignore[arg-type]
    for m in range(1, jobs + 1):
        members.call(f"m{m}")
    return members


def test_first_epoch_waits_for_its_jobs_then_deals_each_batch_once_one_per_call() -> None:
    members = Members(PrepGroup(spec(jobs=2), 0, 0.0))
    assert members.call("m1", claim=1)[0] == pb.PREP_WAIT
    role, claims, _ = members.call("m2", claim=2)
    assert role == pb.PREP_MEMBER and claims == [0]
    assert members.call("m2", claim=2)[1] == [1]
    assert members.call("m2", claim=2)[1] == []  # two held: one per prep thread
    assert [members.call("m1", claim=4)[1] for _ in range(5)] == [[2], [3], [4], [5], []]


def test_a_batch_is_freed_once_every_member_consumed_it() -> None:
    members = started()
    members.call("m1", claim=2)
    members.call("m1", claim=2)
    _, _, ready = members.call("m1", prepped=(0, 1))
    assert ready == [0, 1] and members.group.take_freed() == []
    members.call("m1", consumed=2)
    assert members.group.take_freed() == []
    members.call("m2", consumed=1)
    assert members.group.take_freed() == ["dataquay-prep-m1-0-0"]
    members.call("m2", consumed=2)
    assert members.group.take_freed() == ["dataquay-prep-m1-0-1"]
    assert members.group.staged_bytes == 0


def test_a_dead_members_batches_are_redealt_and_what_it_prepped_stays() -> None:
    members = started(jobs=3)
    assert members.call("m1", claim=1)[1] == [0]
    assert members.call("m2", claim=2)[1] + members.call("m2", claim=2)[1] == [1, 2]
    members.call("m1", prepped=(0,))
    members.dead.add(2)
    role, claims, ready = members.call("m3", claim=2)
    assert role == pb.PREP_MEMBER and claims == [1] and ready == [0]
    assert members.call("m3", claim=2)[1] == [2]
    assert members.group.status().dropped_total == 1 and members.group.status().redealt_total == 2
    assert members.call("m2", prepped=(1,))[0] == pb.PREP_SOLO  # too late: not a member any more
    assert members.last.rejected == ["dataquay-prep-m2-0-1"] and members.group.take_freed() == []


def test_a_silent_member_is_dropped_after_the_timeout() -> None:
    members = started(timeout=5.0)
    members.now = 4.0
    members.call("m1")
    members.now = 6.0
    members.call("m1")
    assert list(members.group.members) == ["m1"]


def test_a_member_that_holds_the_others_up_past_the_budget_is_dropped() -> None:
    members = started(memory=200, timeout=5.0)
    for index in range(2):
        members.call("m1", claim=1)
        members.call("m1", prepped=(index,))
    assert members.call("m1", consumed=2, claim=1)[1] == []  # budget full: 200 bytes held, m2 has used none
    members.now = 4.0
    members.call("m1", consumed=2)
    members.call("m2")
    assert set(members.group.members) == {"m1", "m2"}  # slow, but not for long yet
    members.now = 5.5
    members.call("m2")
    assert list(members.group.members) == ["m1"]
    assert sorted(members.group.take_freed()) == [f"dataquay-prep-m1-0-{i}" for i in range(2)]


def test_the_slowest_members_next_batch_is_dealt_even_over_budget() -> None:
    members = started(memory=50)
    members.call("m1", claim=1)
    members.call("m1", prepped=(0,))
    assert members.call("m2", claim=1)[1] == []  # over budget, and no one needs batch 1 yet
    members.call("m1", consumed=1)
    members.call("m2", consumed=1)
    assert members.call("m2", claim=1)[1] == [1]


def test_the_next_epoch_starts_when_every_member_moved_on_and_a_late_joiner_waits_for_it() -> None:
    members = started()
    assert members.call("m3")[0] == pb.PREP_SOLO  # epoch 0 is running: m3 preps it alone
    assert members.call("m3", epoch=1)[0] == pb.PREP_WAIT
    assert members.call("m1", epoch=1)[0] == pb.PREP_WAIT  # m2 is still in epoch 0
    role, claims, _ = members.call("m2", epoch=1, claim=1)
    assert role == pb.PREP_MEMBER and claims == [0]
    assert members.group.epoch == 1 and set(members.group.members) == {"m1", "m2", "m3"}


def test_unconsumed_batches_are_never_carried_into_the_next_epoch() -> None:
    members = started()
    members.call("m1", claim=1)
    members.call("m1", prepped=(0,))
    members.call("m1", epoch=1)
    members.call("m2", epoch=1)
    assert members.group.take_freed() == ["dataquay-prep-m1-0-0"]
    assert members.group.ready == {}


def test_a_member_that_leaves_gives_back_its_batches() -> None:
    members = started()
    assert members.call("m1", claim=2)[1] + members.call("m1", claim=2)[1] == [0, 1]
    members.call("m1", leave=True)
    assert members.call("m2", claim=2)[1] + members.call("m2", claim=2)[1] == [0, 1]


def test_settings_no_group_can_have_are_refused_by_name() -> None:
    bad = spec()
    bad.jobs = 0
    with pytest.raises(ValueError, match="jobs must be 1 to 64"):
        check(pb.PrepSyncRequest(spec=bad, member="m1"), 7)
    with pytest.raises(ValueError, match="member id"):
        check(pb.PrepSyncRequest(spec=spec(), member="a/b"), 7)
    other_daemons = pb.PrepSyncRequest(
        spec=spec(), member="m1", prepped=[pb.PreppedBatch(segment="dataquay-prep-8-1-0123456789ab")]
    )
    with pytest.raises(ValueError, match="named dataquay-prep-7-<pid>-<token>"):
        check(other_daemons, 7)
    other = spec()
    other.batch_size = 8
    assert mismatch(spec(), other) == "prep group 'g' has another batch_size than this member; its members must agree"


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(1, 3), st.sampled_from(["claim", "prep", "use", "die"])), max_size=120))
def test_any_interleaving_frees_each_batch_once_after_every_live_member_used_it(moves: list[tuple[int, str]]) -> None:
    members = started(jobs=3, memory=300)
    claimed: dict[int, list[int]] = {1: [], 2: [], 3: []}
    used = {1: 0, 2: 0, 3: 0}
    freed: set[str] = set()

    def check_freed() -> None:
        for segment in members.group.take_freed():
            index = int(segment.rsplit("-", 1)[1])
            assert segment not in freed
            assert all(used[m] > index for m in used if f"m{m}" in members.group.members)
            freed.add(segment)

    def move(m: int, what: str) -> None:
        name = f"m{m}"
        if what == "die" and len(members.dead) < 2:
            members.dead.add(m)
        elif what == "claim":
            claimed[m] += members.call(name, consumed=used[m], claim=1)[1]
        elif what == "prep" and claimed[m]:
            members.call(name, consumed=used[m], prepped=(claimed[m].pop(0),))
        elif what == "use" and used[m] in members.call(name, consumed=used[m])[2]:
            used[m] += 1
        check_freed()

    for m, what in moves:
        if m not in members.dead:
            move(m, what)
    for _ in range(4 * BATCHES):  # the living finish the epoch, in turns
        for m in (1, 2, 3):
            if m not in members.dead and used[m] < BATCHES:
                move(m, "use" if used[m] in members.call(f"m{m}", consumed=used[m])[2] else "claim")
                move(m, "prep")
    for m in (1, 2, 3):
        if m not in members.dead:
            assert used[m] == BATCHES
            members.call(f"m{m}", consumed=used[m])
    check_freed()
    assert len(freed) == BATCHES and members.group.staged_bytes == 0
