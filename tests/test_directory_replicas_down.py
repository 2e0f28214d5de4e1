"""A daemon given several directory replicas, none of them up: it serves its
trainers from what it knows, tries each replica once a round with a growing
pause between rounds (not in a tight loop that floods its log and burns a
core), and registers as soon as one of them starts; and a call cut off by
another's move to the next replica."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import grpc
from polling import wait_until

from dataquay.client.wire.channels import channel_options
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.node.cluster.directory_link import DirectoryLink
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_a_daemon_waits_out_every_replica_down_quietly_and_registers_when_one_starts(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    replicas = ",".join(f"127.0.0.1:{port}" for port in ports)
    daemon = DaemonProcess(tmp_path / "node", ("--directory", replicas, "--node-name", "n0")).start()
    try:
        time.sleep(3)
        log = daemon.log_path.read_text()
        # One round said, the later ones quiet: a tight loop wrote thousands of lines here.
        assert log.count("moving to the next") <= 1 and log.count("directory unreachable") == 1, log[-2000:]
        directory = DirectoryProcess(tmp_path / "directory", ("--listen", f"127.0.0.1:{ports[1]}")).start()
        try:
            with grpc.insecure_channel(directory.address, options=channel_options()) as channel:
                stub = directory_pb2_grpc.DirectoryStub(channel)

                def listed_up() -> bool:
                    nodes = stub.ListNodes(dpb.ListNodesRequest()).nodes
                    return [(n.info.name, n.state) for n in nodes] == [("n0", jpb.NODE_UP)]

                wait_until(listed_up, "the daemon registers with the replica that started", timeout=30)
        finally:
            directory.stop()
    finally:
        daemon.stop()


def test_calls_in_flight_when_another_fails_over_are_made_again_on_the_next_replica(tmp_path: Path) -> None:
    """Moving to the next replica closes the old channel, and grpc ends the calls
    still on it as if their tasks were cancelled: the link makes them again."""
    directory = DirectoryProcess(tmp_path / "directory").start()
    node = jpb.NodeInfo(name="n0", tcp_address="127.0.0.1:1", pid=1, version="t")

    async def run() -> list[int]:
        async def nothing() -> None:
            return None

        # The same replica twice: a failover moves to a fresh channel to it.
        link = DirectoryLink(f"{directory.address},{directory.address}", lambda: node, lambda: (0, 0), nothing)
        try:
            calls = [asyncio.create_task(link.datasets()) for _ in range(32)]
            await asyncio.sleep(0)  # the calls start on the first channel
            assert await link._fail_over(link.stub)
            return [len(listed) for listed in await asyncio.gather(*calls)]
        finally:
            await link.close()

    try:
        assert asyncio.run(run()) == [0] * 32
    finally:
        directory.stop()
