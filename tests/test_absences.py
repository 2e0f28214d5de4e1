"""The nodes absent from a job whose owners move, as the directory records
them from epoch reports: the pure rule, the state machine that applies it,
and the state file that keeps it."""

from __future__ import annotations

import json

import pytest
from test_directory_state import KEY, LEASE, SESSION, cluster, facts, info, join_request

from dataquay.server.directory.state import DirectoryState
from dataquay.server.errors import StateFileError
from dataquay.server.planning.absences import KEPT_EPOCHS, LEAD_EPOCHS, Absence, absent_at, follow_absences

NODES = ("a", "b", "c", "d")


def test_a_lost_node_listed_down_is_absent_two_epochs_on_and_back_two_epochs_after_it_is_up() -> None:
    lost = follow_absences((), NODES, ["c"], up={"a", "b", "d"}, epoch=5)
    assert lost == (Absence("c", 5 + LEAD_EPOCHS),)
    assert [absent_at(lost, e) for e in (6, 7, 100)] == [(), ("c",), ("c",)]
    # Reported again, or by another node: nothing changes.
    assert follow_absences(lost, NODES, ["c"], up={"a", "b", "d"}, epoch=6) == lost
    back = follow_absences(lost, NODES, [], up=set(NODES), epoch=9)
    assert back == (Absence("c", 7, 11),)
    assert [absent_at(back, e) for e in (6, 7, 10, 11)] == [(), ("c",), ("c",), ()]
    # Lost again later: a second absence beside the first.
    again = follow_absences(back, NODES, ["c"], up={"a", "b", "d"}, epoch=12)
    assert again == (Absence("c", 7, 11), Absence("c", 14))
    assert absent_at(again, 12) == () and absent_at(again, 14) == ("c",)


def test_a_report_cannot_make_a_live_node_or_a_stranger_or_the_last_node_absent() -> None:
    assert follow_absences((), NODES, ["c"], up=set(NODES), epoch=3) == (), "the directory lists c up"
    assert follow_absences((), NODES, ["zz"], up=set(), epoch=3) == (), "not one of the job's nodes"
    three = follow_absences((), NODES, ["a", "b", "c", "d"], up=set(), epoch=3)
    assert [a.node for a in three] == ["a", "b", "c"], "one node stays present"


def test_a_return_before_the_absence_began_forgets_it_and_old_absences_are_forgotten() -> None:
    lost = follow_absences((), NODES, ["b"], up={"a", "c", "d"}, epoch=4)
    assert follow_absences(lost, NODES, [], up=set(NODES), epoch=4) == (), "back before epoch 6 began"
    ended = (Absence("b", 2, 5),)
    assert follow_absences(ended, NODES, [], up=set(NODES), epoch=5 + KEPT_EPOCHS - 1) == ended
    assert follow_absences(ended, NODES, [], up=set(NODES), epoch=5 + KEPT_EPOCHS) == ()


def test_the_directory_records_absences_for_partial_jobs_only_and_keeps_them_in_its_state_file() -> None:
    state = cluster("a", "b", "c")
    state.join(join_request("p", dataset="imgs", mode="partial", q=0.25), facts, 0.0)
    state.join(join_request("g", dataset="imgs", mode="global"), facts, 0.0)
    state.expire(now=LEASE)  # every lease ends ...
    for name in ("a", "b"):  # ... and a and b come back
        state.register(info(name), LEASE, KEY)
    version = state.versions.jobs
    job = state.report_epoch("p", 3, LEASE, lost=["c"])
    assert [(a.node, a.from_epoch, a.until_epoch) for a in job.absences] == [("c", 5, 0)]
    assert state.versions.jobs == version + 1, "daemons refetch the record"
    assert state.report_epoch("g", 3, LEASE, lost=["c"]).absences == (), "a job whose owners never move heals apart"
    restarted = DirectoryState.from_json(json.loads(json.dumps(state.to_json())), LEASE, now=100.0)
    assert restarted.get_job("p").absences == (Absence("c", 5),)
    state.heartbeat("c", 0, 0, now=LEASE + 1, session=SESSION)
    state.register(info("c"), LEASE + 1, KEY)
    assert state.report_epoch("p", 4, LEASE + 1).absences == (Absence("c", 5, 6),)


def test_a_state_file_with_a_bad_absence_is_refused_naming_the_field() -> None:
    state = cluster("a")
    state.join(join_request("p", dataset="imgs", mode="partial", q=0.25), facts, 0.0)
    doc = json.loads(json.dumps(state.to_json()))
    doc["jobs"][0]["absences"] = [{"node": "a", "from_epoch": -1}]
    with pytest.raises(StateFileError, match=r"jobs\[0\].absences\[0\].from_epoch is -1, expected an integer >= 0"):
        DirectoryState.from_json(doc, LEASE, 0.0)
    doc["jobs"][0]["absences"] = {"node": "a"}
    with pytest.raises(StateFileError, match=r"jobs\[0\].absences is .*, expected a list"):
        DirectoryState.from_json(doc, LEASE, 0.0)
