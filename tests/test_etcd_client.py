"""The directory's etcd client when one of its calls moves to the next endpoint.

All of a replica's calls and streams share one channel, which the call that
moves on closes; grpc ends what was still on it with ``CancelledError``.
These tests hold the client to ending those as outages to ride out (a call
made again, a stream to open again), never as a cancelled task: the watch,
keep-alive and writer loops of the store would otherwise end for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataquay.protos import etcd_rpc_pb2 as epb
from dataquay.server.directory.etcd_client import EtcdClient, parse_endpoints, put
from dataquay.server.errors import DirectoryUnavailableError
from dataquay.server.tools.etcd_cluster import EtcdCluster, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (the etcd-server package; make tools)")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = EtcdCluster(Path(tmp_path_factory.mktemp("etcd")), members=1).start()
    yield parse_endpoints(cluster.store_url)[0]
    cluster.stop()


def test_calls_in_flight_when_another_moves_on_are_made_again_and_answer(endpoint: str) -> None:
    async def run() -> list[int]:
        client = EtcdClient([endpoint, endpoint])
        await client.txn(epb.TxnRequest(success=[put(b"k/a", b"1")]))
        calls = [asyncio.create_task(client.range_prefix(b"k/")) for _ in range(64)]
        await asyncio.sleep(0)  # the calls start on the channel
        await client.reconnect(client.channel())
        replies = await asyncio.gather(*calls)
        await client.close()
        return [len(reply.kvs) for reply in replies]

    assert asyncio.run(run()) == [1] * 64


def test_a_stream_whose_channel_another_call_closed_ends_as_an_outage(endpoint: str) -> None:
    async def run() -> BaseException | None:
        client = EtcdClient([endpoint, endpoint])
        channel = client.channel()
        created = asyncio.Event()

        async def follow() -> None:
            async for _reply in client.watch(channel, b"k/", 1):
                created.set()

        watching = asyncio.create_task(follow())
        await asyncio.wait_for(created.wait(), 10)
        await client.reconnect(channel)
        await asyncio.wait([watching], timeout=10)
        await client.close()
        assert watching.done() and not watching.cancelled()
        return watching.exception()

    ended = asyncio.run(run())
    assert isinstance(ended, DirectoryUnavailableError)
    assert "channel was closed" in str(ended)


def test_a_stream_whose_task_is_cancelled_is_cancelled(endpoint: str) -> None:
    async def run() -> bool:
        client = EtcdClient([endpoint])
        created = asyncio.Event()

        async def follow() -> None:
            async for _reply in client.watch(client.channel(), b"k/", 1):
                created.set()

        watching = asyncio.create_task(follow())
        await asyncio.wait_for(created.wait(), 10)
        watching.cancel()
        await asyncio.wait([watching], timeout=10)
        await client.close()
        return watching.cancelled()

    assert asyncio.run(run())
