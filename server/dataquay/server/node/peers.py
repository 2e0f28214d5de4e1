"""Batched reads from the daemons that own samples: one stream per peer per batch.

A peer is asked only for what its own cache holds (``ReadRequest.peer``); it
flags the rest as missing, and the asking daemon reads those from the PFS.
Every payload's checksum is checked on arrival. A peer that fails or misses
its deadline is set aside (suspect) and its samples come from the PFS until a
back-off passes; the back-off doubles with each failure in a row, so a dead
node costs one timeout per back-off period, not one per batch. A peer that
registered again since it failed (a restarted daemon) is trusted at once.
The fetches from one peer share a byte budget (FETCHED_BYTES_PER_PEER): a
fetch waits for its bytes before it asks, so that however many calls need
the same peer, what they have asked for and not yet received stays bounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from dataquay.client.channels import batch_deadline, channel_options
from dataquay.client.records import checksum
from dataquay.client.security import Credentials
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.limits import FETCHED_BYTES_PER_PEER, ByteBudgets

log = logging.getLogger("dataquay.peers")

#: First and longest time a failed peer is set aside.
BACKOFF_SECONDS = (1.0, 30.0)


@dataclass
class PeerHealth:
    """What this daemon saw of one peer."""

    node: str
    failures: int = 0
    failures_in_a_row: int = 0
    suspect_until: float = 0.0
    failed_at: float = 0.0
    #: When the peer's daemon registered with the directory, as last seen.
    registered: float = 0.0
    samples: int = 0
    bytes: int = 0
    bad_checksums: int = 0

    @property
    def suspect(self) -> bool:
        return time.monotonic() < self.suspect_until


class Peers:
    """Channels to the other daemons and their health, keyed by node name."""

    def __init__(self, timeout: float, credentials: Credentials = Credentials()) -> None:
        self.timeout = timeout
        self.credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, cache_pb2_grpc.CacheStub] = {}
        self._addresses: dict[str, str] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._health: dict[str, PeerHealth] = {}
        self._fetching = ByteBudgets(FETCHED_BYTES_PER_PEER)

    def health(self) -> list[PeerHealth]:
        return [self._health[node] for node in sorted(self._health)]

    async def fetch(
        self, node: str, address: str, dataset: str, manifest_id: str, ids: Sequence[int], nbytes: int,
        registered: float = 0.0,
    ) -> dict[int, tuple[bytes, int]]:
        """The samples of ``ids`` (``nbytes`` in all) that ``node`` holds: id -> (payload, checksum).

        ``registered`` is when the directory says the peer's daemon
        registered. Never raises for a peer's failure: what did not arrive
        intact is simply absent from the result, for the caller to read elsewhere.
        """
        health = self._health.setdefault(node, PeerHealth(node))
        if registered > health.registered:
            health.registered = registered
            health.suspect_until = 0.0
        if health.suspect or not address:
            return {}
        budget = self._fetching.get(node)
        await budget.take(nbytes)
        try:
            return await self._fetch(health, address, dataset, manifest_id, ids, nbytes)
        finally:
            budget.give(nbytes)

    async def _fetch(
        self, health: PeerHealth, address: str, dataset: str, manifest_id: str, ids: Sequence[int], nbytes: int
    ) -> dict[int, tuple[bytes, int]]:
        node = health.node
        request = pb.ReadRequest(dataset=dataset, ids=ids, manifest_id=manifest_id, peer=True)
        out: dict[int, tuple[bytes, int]] = {}
        received = 0
        deadline = batch_deadline(self.timeout, nbytes)
        started = time.monotonic()
        try:
            stub = self.stub(node, address)
            async for chunk in stub.Read(request, timeout=deadline):
                for sample in chunk.samples:
                    if sample.missing:
                        continue
                    if checksum(sample.data) != sample.checksum:
                        health.bad_checksums += 1
                        continue
                    out[sample.id] = (sample.data, sample.checksum)
                    received += len(sample.data)
        except grpc.aio.AioRpcError as exc:
            self._failed(health, address, exc, started)
            return {}
        if health.failures_in_a_row:
            log.info("peer answers again", extra={"fields": {"peer": node, "address": address}})
            health.failures_in_a_row = 0
        health.samples += len(out)
        health.bytes += received
        return out

    def _failed(self, health: PeerHealth, address: str, exc: grpc.aio.AioRpcError, started: float) -> None:
        health.failures += 1
        if started < health.failed_at:
            return  # in flight when an earlier call failed: the same outage
        health.failed_at = time.monotonic()
        health.failures_in_a_row += 1
        first, longest = BACKOFF_SECONDS
        backoff = min(first * 2 ** (health.failures_in_a_row - 1), longest)
        health.suspect_until = time.monotonic() + backoff
        log.warning(
            "peer read failed; its samples come from the PFS for a while",
            extra={"fields": {"peer": health.node, "address": address, "code": exc.code().name,
                              "error": exc.details(), "retry_in_s": backoff}},
        )

    def stub(self, node: str, address: str) -> cache_pb2_grpc.CacheStub:
        # A channel reconnects by itself when its peer comes back. It is never
        # closed while in use: closing cancels every call in flight on it.
        if node in self._addresses and self._addresses[node] != address:
            self._retired.append(self._channels.pop(node))  # restarted on another port
        channel = self._channels.get(node)
        if channel is None:
            channel = self.credentials.aio_channel(address, channel_options())
            self._channels[node] = channel
            self._stubs[node] = cache_pb2_grpc.CacheStub(channel)
            self._addresses[node] = address
        return self._stubs[node]

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()
