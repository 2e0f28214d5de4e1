"""Node-set versions end to end: a real `dataquay directory`, nodes that are
gRPC calls, and a daemon's DirectoryLink keeping its copy of the node list by
the changes since its version."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from polling import TIMEOUT_SECONDS
from prometheus_client.parser import text_string_to_metric_families
from test_directory import Stub, heartbeat, http_get, register

from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.tools.processes import DirectoryProcess


def node_lists(directory: DirectoryProcess) -> dict[str, int]:
    """The directory's count of ListNodes replies, by kind (full, delta)."""
    metrics = http_get(directory.http_url + "/metrics")[1].decode()
    return {
        sample.labels["kind"]: int(sample.value)
        for family in text_string_to_metric_families(metrics)
        if family.name == "dataquay_directory_node_lists"
        for sample in family.samples
    }


def listed(reply: dpb.ListNodesReply) -> list[tuple[str, int]]:
    return [(n.info.name, n.state) for n in reply.nodes]


def test_registrations_within_a_heartbeat_period_are_one_version(
    directory: DirectoryProcess, stub_for: Callable[..., Stub]
) -> None:
    stub = stub_for(directory)
    first = register(stub, "n0").versions.nodes
    assert [register(stub, f"n{i}", port=7000 + 10 * i).versions.nodes for i in range(1, 5)] == [first] * 4
    whole = stub.ListNodes(dpb.ListNodesRequest())
    assert not whole.delta and [n.info.name for n in whole.nodes] == ["n0", "n1", "n2", "n3", "n4"]

    deadline = time.monotonic() + TIMEOUT_SECONDS
    while (version := heartbeat(stub, "n0").versions.nodes) == first:
        assert time.monotonic() < deadline, "the registrations were never published"
        time.sleep(0.1)
    assert version == first + 1
    delta = stub.ListNodes(dpb.ListNodesRequest(since_version=first))
    assert delta.delta and delta.versions.nodes == version
    assert listed(delta) == [(f"n{i}", jpb.NODE_UP) for i in range(1, 5)] and not delta.removed
    assert not stub.ListNodes(dpb.ListNodesRequest(since_version=version)).nodes


def test_a_daemon_sees_a_node_join_and_leave_through_deltas_and_a_restarted_one_gets_the_whole_list(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub]
) -> None:
    directory = start_directory("--lease-seconds", "1", "--heartbeat-seconds", "0.2")
    stub = stub_for(directory)

    async def nothing() -> None:
        pass

    async def until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while not condition():
            assert time.monotonic() < deadline, f"{what}: not so after {TIMEOUT_SECONDS:.0f} s"
            await asyncio.sleep(0.05)

    async def daemon(run: Callable[[DirectoryLink], Awaitable[None]]) -> None:
        link = DirectoryLink(
            directory.address, lambda: jpb.NodeInfo(name="d0", tcp_address="127.0.0.1:7300"), lambda: (0, 0), nothing
        )
        link.identity_key = bytes(32)
        task = asyncio.create_task(link.run())
        try:
            await until(link.registered.is_set, "d0 registered")
            await run(link)
        finally:
            task.cancel()
            await link.close()

    async def join_and_leave(link: DirectoryLink) -> None:
        register(stub, "n1")
        await until(lambda: "n1" in link.nodes, "d0 lists n1")
        await until(lambda: link.is_down("n1"), "d0 lists n1 down once its lease ended")
        assert link.nodes["d0"].state == jpb.NODE_UP

    asyncio.run(daemon(join_and_leave))
    lists = node_lists(directory)
    assert lists["full"] == 1 and lists["delta"] >= 2, lists

    async def restarted(link: DirectoryLink) -> None:
        assert link.is_down("n1") and "d0" in link.nodes

    asyncio.run(daemon(restarted))
    assert node_lists(directory)["full"] == 2


def test_a_version_of_the_directory_before_its_restart_gets_the_whole_list(
    start_directory: Callable[..., DirectoryProcess], stub_for: Callable[..., Stub]
) -> None:
    first = start_directory()
    stub = stub_for(first)
    register(stub, "n0")
    held = stub.ListNodes(dpb.ListNodesRequest()).versions.nodes
    first.kill()

    stub = stub_for(start_directory())
    register(stub, "n1")
    reply = stub.ListNodes(dpb.ListNodesRequest(since_version=held))
    assert not reply.delta and reply.versions.nodes > held
    assert listed(reply) == [("n0", jpb.NODE_UP), ("n1", jpb.NODE_UP)]
