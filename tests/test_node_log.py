"""Node-set versions without sockets: coalescing, the changes since a version,
the whole list for a version the log no longer has, and a daemon's copy
brought up to date by the replies."""

from __future__ import annotations

from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.listing import NodeListing
from dataquay.server.directory.node_log import NodeLog, first_version
from dataquay.server.directory.records import NodeInfo
from dataquay.server.directory.state import DirectoryState, identity_of
from dataquay.server.node.cluster.directory_link import merged_nodes

PERIOD = 5.0
#: The identity every node here registers with.
KEY = identity_of(bytes(32))


def info(name: str, port: int = 7070) -> NodeInfo:
    return NodeInfo(name=name, tcp_address=f"10.0.0.1:{port}")


def test_changes_within_a_period_are_one_version_and_the_first_is_published_at_once() -> None:
    log = NodeLog(PERIOD)
    log.mark("a")
    assert log.publish(now=100.0) and log.version == 1
    for name, now in (("b", 100.5), ("c", 101.0), ("b", 104.9)):
        log.mark(name)
        assert not log.publish(now) and log.version == 1
    assert log.publish(now=105.0) and log.version == 2
    assert not log.publish(now=200.0), "nothing marked since"
    assert log.changes_since(1) == {"b", "c"} and log.changes_since(2) == frozenset()


def test_the_changes_since_a_version_are_those_of_every_later_version() -> None:
    log = NodeLog()
    for now, names in enumerate((["a", "b"], ["c"], ["a"])):
        for name in names:
            log.mark(name)
        log.publish(float(now))
    assert log.version == 3
    assert log.changes_since(1) == {"a", "c"}
    assert log.changes_since(2) == {"a"}


def test_no_version_one_older_than_the_history_or_of_another_run_gets_the_whole_list() -> None:
    log = NodeLog(history=2, version=first_version(previous=7, now=1000.0))
    base = log.version
    assert base == 1000 << 32
    assert log.changes_since(base) == frozenset()
    for now, name in enumerate("abc"):
        log.mark(name)
        log.publish(float(now))
    assert log.version == base + 3
    assert log.changes_since(base + 1) == {"b", "c"}
    assert log.changes_since(base) is None, "older than the two versions kept"
    assert log.changes_since(0) is None
    assert log.changes_since(7) is None, "a version of the last run"
    assert log.changes_since(base + 4) is None, "a version this run never published"


def test_a_clock_set_back_does_not_hold_changes_back() -> None:
    log = NodeLog(PERIOD)
    log.mark("a")
    log.publish(now=100.0)
    log.mark("b")
    assert log.publish(now=50.0) and log.version == 2


def test_a_copy_follows_the_directory_through_deltas_and_the_whole_list() -> None:
    state = DirectoryState(lease_seconds=10.0, publish_seconds=PERIOD)
    listing = NodeListing(max_age=PERIOD)

    def listed(since: int, now: float) -> dpb.ListNodesReply:
        v = state.publish_nodes(now)
        versions = dpb.Versions(nodes=v.nodes, datasets=v.datasets, jobs=v.jobs)
        return dpb.ListNodesReply.FromString(listing.reply(state, since, versions, now))

    state.register(info("a"), now=0.0, identity=KEY)
    state.register(info("b"), now=1.0, identity=KEY)
    whole = listed(0, now=1.0)
    assert not whole.delta and [n.info.name for n in whole.nodes] == ["a", "b"] and whole.versions.nodes == 1
    copy = merged_nodes({}, whole)

    state.register(info("c"), now=2.0, identity=KEY)
    state.register(info("a", port=7071), now=3.0, identity=KEY)
    assert listed(1, now=4.0).nodes == [], "nothing published since version 1"
    delta = listed(1, now=5.0)
    assert delta.delta and delta.versions.nodes == 2
    assert [(n.info.name, n.info.tcp_address) for n in delta.nodes] == [
        ("a", "10.0.0.1:7071"),
        ("b", "10.0.0.1:7070"),
        ("c", "10.0.0.1:7070"),
    ]
    copy = merged_nodes(copy, delta)
    assert state.expire(now=11.5) == ["b"]
    down = listed(2, now=11.5)
    assert [(n.info.name, n.state) for n in down.nodes] == [("b", jpb.NODE_DOWN)]
    copy = merged_nodes(copy, down)
    assert {name: (n.info.tcp_address, n.state) for name, n in copy.items()} == {
        "a": ("10.0.0.1:7071", jpb.NODE_UP),
        "b": ("10.0.0.1:7070", jpb.NODE_DOWN),
        "c": ("10.0.0.1:7070", jpb.NODE_UP),
    }
    assert listing.sent == {"full": 1, "delta": 3}


def test_a_delta_drops_the_names_it_removes() -> None:
    a, b = (jpb.NodeStatus(info=jpb.NodeInfo(name=n)) for n in "ab")
    reply = dpb.ListNodesReply(delta=True, nodes=[jpb.NodeStatus(info=jpb.NodeInfo(name="c"))], removed=["a"])
    assert sorted(merged_nodes({"a": a, "b": b}, reply)) == ["b", "c"]
