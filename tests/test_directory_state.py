"""The directory's state machine without sockets: leases, versions, job joins
and persistence, driven step by step with an explicit clock."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import MAX_EPOCH
from dataquay.server.directory.records import Change, DatasetFacts, Job, JoinRequest, Node, NodeInfo, Versions
from dataquay.server.directory.state import DirectoryState, identity_of
from dataquay.server.errors import (
    InvalidRequestError,
    JobActiveError,
    JobMismatchError,
    NoLiveNodesError,
    UnknownDatasetError,
    UnknownJobError,
)

LEASE = 10.0
#: Every node's identity, and the session each registration hands out.
KEY, SESSION = identity_of(bytes(32)), 7


def info(name: str) -> NodeInfo:
    return NodeInfo(name=name, tcp_address=f"10.0.0.{len(name)}:7070", metrics_address=f"10.0.0.{len(name)}:9470")


def facts(name: str) -> DatasetFacts:
    if name != "imgs":
        raise UnknownDatasetError(f"unknown dataset {name!r}")
    return DatasetFacts(manifest_id="m1", num_samples=100)


def join_request(job_id: str, must_exist: bool = False, **named: Any) -> JoinRequest:
    """A join naming the settings given, as the servicer parses one."""
    return JoinRequest(JobSettings(job_id, **named), frozenset(named), must_exist)


def cluster(*names: str, now: float = 0.0) -> DirectoryState:
    state = DirectoryState(LEASE, sessions=lambda: SESSION)
    for name in names:
        state.register(info(name), now, KEY)
    return state


def up_names(state: DirectoryState) -> list[str]:
    return [n.info.name for n in state.up_nodes()]


def test_a_lease_ends_without_heartbeats_and_a_heartbeat_brings_the_node_back() -> None:
    state = cluster("b", "a")
    assert up_names(state) == ["a", "b"] and state.versions.nodes == 2
    assert state.heartbeat("a", 5, 1, now=8.0, session=SESSION) == (True, False, "")
    assert state.expire(now=9.0) == []
    assert state.expire(now=10.0) == ["b"]
    assert up_names(state) == ["a"] and state.node_counts() == (1, 1)
    assert state.versions.nodes == 3
    assert state.heartbeat("b", 0, 0, now=11.0, session=SESSION) == (True, True, "")
    assert up_names(state) == ["a", "b"] and state.versions.nodes == 4
    assert state.expire(now=18.0) == ["a"]
    node_a = state.nodes()[0]
    assert not node_a.up and node_a.cache_used_bytes == 5 and node_a.last_heartbeat == 8.0


def test_heartbeats_move_no_version_and_unknown_names_are_told_to_register() -> None:
    state = cluster("a")
    before, revision = state.versions, state.revision
    for t in range(1, 50):
        assert state.heartbeat("a", t, t, now=float(t), session=SESSION).known
    assert state.versions is before and state.revision == revision
    assert state.heartbeat("ghost", 0, 0, now=50.0, session=SESSION) == (False, False, "")
    assert state.heartbeats == 50


def test_a_datagram_sequence_already_used_renews_nothing_until_the_node_registers_again() -> None:
    state = cluster("a")
    assert not state.heartbeat("a", 0, 0, 1.0, sequence=100, session=SESSION).refused
    state.expire(LEASE + 2.0)
    replayed = state.heartbeat("a", 0, 0, LEASE + 3.0, sequence=100, session=SESSION)
    assert replayed.refused and not replayed.came_up and up_names(state) == []
    assert state.heartbeat("a", 0, 0, LEASE + 3.0, sequence=101, session=SESSION).came_up
    assert not state.heartbeat("a", 0, 0, LEASE + 3.0, session=SESSION).refused  # by RPC: no sequence to check
    state.register(info("a"), LEASE + 4.0, KEY)
    # a restart with its clock set back
    assert not state.heartbeat("a", 0, 0, LEASE + 4.0, sequence=5, session=SESSION).refused


def test_registration_reports_what_changed() -> None:
    state = cluster("a")
    assert state.register(info("b"), 1.0, KEY).change is Change.JOINED
    again = state.register(NodeInfo("a", "10.9.9.9:7070"), 2.0, KEY)
    assert again.change is Change.RENEWED and again.previous == info("a")
    state.expire(now=100.0)
    assert state.register(info("a"), 101.0, KEY).change is Change.UP
    assert up_names(state) == ["a"]


def test_a_node_restored_from_the_state_file_registers_from_a_new_address_as_up_not_renewed() -> None:
    state = cluster("a", "b")
    restarted = DirectoryState.from_json(json.loads(json.dumps(state.to_json())), LEASE, now=50.0)
    moved = restarted.register(NodeInfo("a", "10.9.9.9:7070"), 51.0, KEY)
    assert moved.change is Change.UP and moved.previous == info("a")
    assert restarted.heartbeat("b", 0, 0, now=51.0, session=SESSION).known
    assert restarted.register(NodeInfo("b", "10.9.9.8:7070"), 52.0, KEY).change is Change.RENEWED
    assert restarted.register(NodeInfo("a", "10.9.9.7:7070"), 53.0, KEY).change is Change.RENEWED


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (NodeInfo("", "h:1"), "bad node name ''"),
        (NodeInfo("a b", "h:1"), "bad node name 'a b'"),
        (NodeInfo("a", "nohost"), "bad tcp address 'nohost'"),
        (NodeInfo("a", "h:1", metrics_address="h:port"), "bad metrics address 'h:port'"),
    ],
)
def test_unusable_registrations_are_refused_with_the_reason(node: NodeInfo, message: str) -> None:
    state = DirectoryState(LEASE, sessions=lambda: SESSION)
    with pytest.raises(InvalidRequestError, match=message):
        state.register(node, 0.0, KEY)
    assert state.nodes() == [] and state.versions == Versions()


def test_a_new_job_takes_defaults_and_all_live_nodes_by_name() -> None:
    state = cluster("n2", "n0", "n1")
    state.expire(now=LEASE)
    state.register(info("n1"), LEASE, KEY)
    state.register(info("n0"), LEASE, KEY)
    jobs_version = state.versions.jobs
    job, created = state.join(join_request("j1", dataset="imgs"), facts, now=LEASE + 1)
    assert created and state.versions.jobs == jobs_version + 1
    spec = job.spec
    assert (spec.mode, spec.q, spec.seed, spec.drop_last, spec.partition, spec.ranks_per_node, spec.batch_size) == (
        "global",
        0.0,
        0,
        False,
        "sample",
        0,
        0,
    )
    assert spec.nodes == ("n0", "n1")
    assert (job.manifest_id, job.num_samples, job.epoch, job.created) == ("m1", 100, 0, LEASE + 1)


def test_a_join_with_other_settings_is_refused_naming_the_field() -> None:
    state = cluster("a", "b")
    state.join(join_request("j1", dataset="imgs", mode="global", seed=7, nodes=("b", "a")), facts, 0.0)
    with pytest.raises(JobMismatchError, match="job 'j1' exists with mode 'global'; this join asked for 'partial'"):
        state.join(join_request("j1", mode="partial"), facts, 1.0)
    with pytest.raises(JobMismatchError, match="exists with seed 7; this join asked for 8"):
        state.join(join_request("j1", dataset="imgs", seed=8), facts, 1.0)
    with pytest.raises(JobMismatchError, match=r"exists with nodes \[b, a\] \(2 nodes\)"):
        state.join(join_request("j1", nodes=("a", "b")), facts, 1.0)
    with pytest.raises(JobMismatchError, match="exists with dataset 'imgs'"):
        state.join(join_request("j1", dataset="other"), facts, 1.0)
    job, created = state.join(join_request("j1", seed=7, nodes=("b", "a")), facts, 1.0)
    assert not created and job.spec.seed == 7


def test_the_first_join_that_knows_ranks_per_node_fixes_it() -> None:
    state = cluster("a")
    state.join(join_request("j1", dataset="imgs"), facts, 0.0)
    version = state.versions.jobs
    job, _ = state.join(join_request("j1", ranks_per_node=0), facts, 1.0)
    assert job.spec.ranks_per_node == 0 and state.versions.jobs == version
    job, _ = state.join(join_request("j1", ranks_per_node=4), facts, 1.0)
    assert job.spec.ranks_per_node == 4 and state.versions.jobs == version + 1
    assert state.join(join_request("j1", ranks_per_node=0), facts, 1.0)[0].spec.ranks_per_node == 4
    with pytest.raises(JobMismatchError, match="ranks_per_node 4; this join asked for 8"):
        state.join(join_request("j1", ranks_per_node=8), facts, 1.0)


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (join_request("j/1", dataset="imgs"), InvalidRequestError, "bad job id 'j/1'"),
        (join_request("x" * 129, dataset="imgs"), InvalidRequestError, "bad job id"),
        (join_request("j1"), InvalidRequestError, "name its dataset to create it"),
        (join_request("j1", dataset="imgs", must_exist=True), UnknownJobError, "no job 'j1'"),
        (join_request("j1", dataset="nope"), UnknownDatasetError, "unknown dataset 'nope'"),
        (
            join_request("j1", dataset="imgs", mode="random"),
            InvalidRequestError,
            "mode must be one of .*, not 'random'",
        ),
        (
            join_request("j1", dataset="imgs", partition="rows"),
            InvalidRequestError,
            "partition must be one of sample, shard, not 'rows'",
        ),
        (join_request("j1", dataset="imgs", q=1.5), InvalidRequestError, r"q 1.5 is not in \[0, 1\]"),
        (join_request("j1", dataset="imgs", q=float("nan")), InvalidRequestError, "q nan"),
        (
            join_request("j1", dataset="imgs", mode="partial"),
            InvalidRequestError,
            r"job 'j1': q must be in \(0, 1\] for mode partial",
        ),
        (
            join_request("j1", dataset="imgs", mode="locality", batch_size=0),
            InvalidRequestError,
            "job 'j1': batch_size must be at least 1 for mode locality",
        ),
        (join_request("j1", dataset="imgs", nodes=("a", "x", "y")), InvalidRequestError, "registered: x, y"),
        (join_request("j1", dataset="imgs", nodes=("a", "a")), InvalidRequestError, "more than once: a"),
    ],
)
def test_bad_joins_are_refused_and_create_nothing(request_: JoinRequest, error: type[Exception], message: str) -> None:
    state = cluster("a")
    revision = state.revision
    with pytest.raises(error, match=message):
        state.join(request_, facts, 0.0)
    assert state.jobs() == [] and state.revision == revision


def test_a_job_naming_thousands_of_unknown_nodes_gets_a_short_answer() -> None:
    state = cluster("a")
    ghosts = tuple(f"ghost-{i}" for i in range(4096))
    with pytest.raises(InvalidRequestError) as refused:
        state.join(join_request("j1", dataset="imgs", nodes=("a", *ghosts)), facts, 0.0)
    message = str(refused.value)
    assert message.startswith("job 'j1' names 4096 node(s) no daemon registered: ghost-0, ghost-1,")
    assert "ghost-6" not in message and message.endswith("... (1 registered)") and len(message) < 200
    with pytest.raises(InvalidRequestError, match=r"names 4096 node\(s\) more than once: ghost-0, .*, \.\.\.$"):
        state.join(join_request("j1", dataset="imgs", nodes=ghosts + ghosts), facts, 0.0)
    assert state.jobs() == []


def test_a_job_on_all_live_nodes_needs_one_up() -> None:
    state = cluster("a")
    state.expire(now=LEASE)
    with pytest.raises(NoLiveNodesError, match="none is up"):
        state.join(join_request("j1", dataset="imgs"), facts, LEASE)
    job, _ = state.join(join_request("j1", dataset="imgs", nodes=("a",)), facts, LEASE)
    assert job.spec.nodes == ("a",)


def test_epochs_only_go_up_and_dropped_jobs_are_gone() -> None:
    state = cluster("a")
    state.join(join_request("j1", dataset="imgs"), facts, 0.0)
    version = state.versions
    assert not state.get_job("j1").started
    assert state.report_epoch("j1", 0, 1.0).started
    assert state.report_epoch("j1", 3, 2.0).epoch == 3
    assert state.report_epoch("j1", 2, 3.0).epoch == 3
    assert state.versions == version
    with pytest.raises(InvalidRequestError, match=f"epoch {MAX_EPOCH + 1} is beyond the last one"):
        state.report_epoch("j1", MAX_EPOCH + 1, 4.0)
    with pytest.raises(UnknownJobError, match="no job 'j2'"):
        state.report_epoch("j2", 1, 4.0)
    state.drop_job("j1")
    assert state.versions.jobs == version.jobs + 1
    with pytest.raises(UnknownJobError, match=r"no job 'j1' \(jobs: none\)"):
        state.get_job("j1")


def test_a_directory_that_did_not_run_marks_no_node_down_for_its_own_silence() -> None:
    # Stopped (SIGSTOP, a hung host) from 5 s to 65 s: no node could renew its lease meanwhile.
    state = cluster("a", "b")
    state.heartbeat("a", 0, 0, now=4.0, session=SESSION)
    state.hold_leases(60.0)
    assert state.expire(now=65.0) == [] and up_names(state) == ["a", "b"]
    assert state.heartbeat("a", 0, 0, now=66.0, session=SESSION) == (True, False, "")
    assert state.expire(now=70.0) == ["b"]  # what it did hear still counts: b was silent since 0


def test_state_survives_a_json_round_trip_and_live_nodes_get_a_fresh_lease() -> None:
    state = cluster("a", "b", "c")
    state.heartbeat("a", 10, 2, now=5.0, session=SESSION)
    state.expire(now=LEASE)  # b and c down
    state.register(info("c"), LEASE, KEY)
    state.join(join_request("j1", dataset="imgs", mode="global", seed=3, ranks_per_node=2), facts, 1.0)
    state.report_epoch("j1", 4, 2.0)
    state.datasets_changed()
    doc = json.loads(json.dumps(state.to_json()))

    restarted = DirectoryState.from_json(doc, LEASE, now=1000.0)
    assert [(n.info, n.up, n.cache_used_bytes) for n in restarted.nodes()] == [
        (n.info, n.up, n.cache_used_bytes) for n in state.nodes()
    ]
    assert restarted.jobs() == state.jobs()
    old, new = state.versions, restarted.versions
    assert (new.nodes, new.datasets, new.jobs) == (1000 << 32, old.datasets + 1, old.jobs + 1)  # a run of its own
    assert restarted.expire(now=1000.0 + LEASE - 0.1) == []
    assert restarted.expire(now=1000.0 + LEASE) == ["a", "c"]


def test_the_batch_size_is_a_job_setting_and_old_state_files_have_none() -> None:
    state = cluster("a")
    job, _ = state.join(join_request("j1", dataset="imgs", mode="locality", batch_size=32), facts, 0.0)
    assert job.spec.batch_size == 32
    assert state.join(join_request("j1", batch_size=32), facts, 1.0)[0].spec == job.spec
    with pytest.raises(JobMismatchError, match="exists with batch_size 32; this join asked for 16"):
        state.join(join_request("j1", batch_size=16), facts, 1.0)
    state.join(join_request("j2", dataset="imgs", mode="partial", q=0.25), facts, 0.0)
    doc = json.loads(json.dumps(state.to_json()))
    del doc["jobs"][1]["spec"]["batch_size"]
    restarted = DirectoryState.from_json(doc, LEASE, now=10.0)
    assert restarted.get_job("j1").spec.batch_size == 32
    assert restarted.get_job("j2").spec.batch_size == 0


def test_a_document_of_another_format_is_refused() -> None:
    with pytest.raises(ValueError, match="format is 99, expected 1"):
        DirectoryState.from_json({"format": 99, "versions": {}, "nodes": [], "jobs": []}, LEASE, 0.0)
    with pytest.raises(ValueError, match=r"nodes\[0\].info.name is missing"):
        DirectoryState.from_json({"format": 1, "versions": {}, "nodes": [{"info": {}}], "jobs": []}, LEASE, 0.0)


# ------------------------------------------------------------ job activity


def test_creation_joins_and_epoch_reports_mark_a_job_active() -> None:
    state = cluster("a")
    state.join(join_request("j1", dataset="imgs"), facts, now=10.0)
    assert state.get_job("j1").last_active == 10.0
    assert state.join(join_request("j1"), facts, now=20.0)[0].last_active == 20.0
    assert state.report_epoch("j1", 0, now=30.0).last_active == 30.0
    assert state.report_epoch("j1", 0, now=40.0).last_active == 40.0  # a repeated report is activity too
    with pytest.raises(JobMismatchError):
        state.join(join_request("j1", seed=5), facts, now=50.0)
    assert state.get_job("j1").last_active == 40.0
    assert state.report_epoch("j1", 0, now=35.0).last_active == 40.0  # a clock stepped back moves nothing


def test_activity_moves_no_version_and_reaches_the_disk_once_a_minute() -> None:
    state = cluster("a")
    state.join(join_request("j1", dataset="imgs"), facts, now=0.0)
    versions, revision = state.versions, state.revision
    for t in range(1, 60):
        state.report_epoch("j1", 0, now=float(t))
    assert state.revision == revision + 1  # the report that started epoch 0
    state.report_epoch("j1", 0, now=61.0)
    assert state.revision == revision + 2 and state.versions == versions
    assert state.to_json()["jobs"][0]["last_active"] == 61.0


def test_jobs_idle_for_the_ttl_expire_and_active_ones_stay() -> None:
    state = cluster("a")
    state.join(join_request("old", dataset="imgs"), facts, now=0.0)
    state.join(join_request("busy", dataset="imgs"), facts, now=0.0)
    state.report_epoch("busy", 3, now=50.0)
    version = state.versions.jobs
    assert state.expire_jobs(ttl=100.0, now=99.0) == [] and state.versions.jobs == version
    expired = state.expire_jobs(ttl=100.0, now=120.0)
    assert [(job.spec.job_id, idle) for job, idle in expired] == [("old", 120.0)]
    assert [job.spec.job_id for job in state.jobs()] == ["busy"]
    assert state.versions.jobs == version + 1 and state.jobs_expired == 1
    assert state.expire_jobs(ttl=100.0, now=149.0) == []
    assert [job.spec.job_id for job, _ in state.expire_jobs(ttl=100.0, now=150.0)] == ["busy"]
    assert state.jobs() == [] and state.jobs_expired == 2


def test_a_conditional_drop_keeps_a_job_active_since_and_drops_an_idle_one() -> None:
    state = cluster("a")
    state.join(join_request("j1", dataset="imgs"), facts, now=0.0)
    state.report_epoch("j1", 1, now=100.0)
    with pytest.raises(JobActiveError, match="job 'j1' was active 50s ago, less than the 60s idle asked for"):
        state.drop_idle_job("j1", 60.0, now=150.0)
    for bad in (-1.0, float("nan")):
        with pytest.raises(InvalidRequestError, match="minimum idle time"):
            state.drop_idle_job("j1", bad, now=150.0)
    with pytest.raises(JobActiveError):
        state.drop_idle_job("j1", float("inf"), now=150.0)
    assert [job.spec.job_id for job in state.jobs()] == ["j1"]
    assert state.drop_idle_job("j1", 60.0, now=160.0).spec.job_id == "j1"
    assert state.jobs() == [] and state.jobs_expired == 0
    with pytest.raises(UnknownJobError):
        state.drop_idle_job("j1", 60.0, now=160.0)


def test_a_shared_store_is_told_which_records_changed_and_the_embedded_one_is_not() -> None:
    state = cluster("a")
    assert state.changed is None
    state.changed = set()
    state.register(info("b"), now=1.0, identity=KEY)
    state.join(join_request("j", dataset="imgs"), facts, now=1.0)
    assert state.changed == {("node", "b"), ("new-job", "j")}
    state.changed.clear()
    state.report_epoch("j", 1, now=2.0)
    state.heartbeat("b", 0, 0, now=3.0, session=state.node("b").session)  # type: ignore[union-attr]  # writes nothing
    assert state.changed == {("job", "j")}
    state.drop_job("j")
    assert state.changed == {("job", "j")}


def test_another_replicas_records_replace_this_ones_keeping_what_only_it_heard() -> None:
    mine = DirectoryState(float("inf"))
    mine.register(info("a"), now=0.0, identity="id-a", wall=100.0)
    session = mine.node("a").session  # type: ignore[union-attr]
    assert mine.heartbeat("a", 7, 1, now=1.0, sequence=50, session=session).refused == ""
    theirs = Node(info("a"), registered=100.0, last_heartbeat=100.0, beat_sequence=0, identity="id-a", session=session)
    version = mine.versions.nodes
    mine.apply_node(theirs, up=True, now=2.0)
    node = mine.node("a")
    assert node is not None and node.beat_sequence == 50 and node.cache_used_bytes == 7
    assert mine.versions.nodes == version  # the same registration: nothing changed
    # Its lease ended in the store: down here, no beat of this replica's clock needed.
    mine.apply_up("a", False, now=3.0)
    assert up_names(mine) == [] and mine.versions.nodes > version
    # Another registration of the name (a new session) starts the replay mark afresh.
    mine.apply_node(replace(theirs, session=session + 1), up=True, now=4.0)
    assert up_names(mine) == ["a"] and mine.node("a").beat_sequence == 0  # type: ignore[union-attr]


def test_a_job_another_replica_wrote_counts_its_idle_time_from_its_record() -> None:
    state = DirectoryState(LEASE)
    job = Job(JobSettings("j", dataset="imgs"), "m1", 100, epoch=3, created=1000.0, started=True, last_active=1500.0)
    state.apply_job(job, now=50.0, wall=1600.0)
    assert state.get_job("j") == job and state.versions.jobs == 1
    assert [j.spec.job_id for j, idle in state.expire_jobs(100.0, now=50.0)] == ["j"]
    state.apply_job(job, now=50.0, wall=1600.0)
    state.apply_job_dropped("j")
    assert state.jobs() == [] and state.changed is None
