"""Batched reads from the daemons that own samples: one stream per peer per batch.

A peer is asked only for what its own cache holds (``ReadRequest.peer``), or
its staging is about to bring (it reads those at once); it flags the rest as
missing, and the asking daemon reads those from the PFS.
Every payload's checksum is checked on arrival. A peer that fails or misses
its deadline is set aside (suspect) and its samples come from the PFS until a
back-off passes; the back-off doubles with each failure in a row, so a dead
node costs one timeout per back-off period, not one per batch. A peer that
registered again since it failed (a restarted daemon) is trusted at once.
A sample larger than a message arrives in pieces, joined by the one parser
of a Read's reply (:mod:`dataquay.client.wire.read_stream`); pieces
that do not add up to the sample the manifest describes count as a failure.
The fetches from one peer share a byte budget (FETCHED_BYTES_PER_PEER): a
fetch waits for its bytes before it asks, so that however many calls need
the same peer, what they have asked for and not yet received stays bounded.

A peer that advertises a bulk address is read over the bulk data path,
each payload received where a ``landing`` places it; a peer without one (its
bulk path off), or one whose bulk connection fails for any reason but its
deadline, is read over gRPC, and its bulk address is left alone for
BULK_RETRY_SECONDS, unless the peer itself (its InfoReply) names another: a
restarted peer listens on a new port before the directory's listing says so
here. A bulk read that misses its deadline or is refused counts as the
peer's failure, as a gRPC one does. The two transports and the rule that
picks between them are :mod:`dataquay.server.node.peers.transports`; this
module keeps the peers' channels, health and byte budgets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import numpy as np

from dataquay.client.wire.channels import batch_deadline, channel_options
from dataquay.client.wire.security import Credentials
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.limits import FETCHED_BYTES_PER_PEER, ByteBudgets
from dataquay.server.node.cache.admission import ADMITTED, refusals
from dataquay.server.node.peers.bulk.client import BulkClient, Landing
from dataquay.server.node.peers.bulk.frames import BulkError
from dataquay.server.node.peers.transports import (
    BulkPeerTransport,
    GrpcPeerTransport,
    PeerReadFailed,
    PeerTransport,
    bulk_first,
)

log = logging.getLogger("dataquay.peers")

#: First and longest time a failed peer is set aside.
BACKOFF_SECONDS = (1.0, 30.0)
#: How long a bulk address that failed is left for gRPC.
BULK_RETRY_SECONDS = 30.0


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

    @property
    def troubled(self) -> bool:
        """Whether it ever failed a read or sent a bad checksum."""
        return self.suspect or bool(self.failures or self.bad_checksums)


def listed_peers(peers: Iterable[PeerHealth], most: int) -> list[PeerHealth]:
    """The peers a status names, by node: every troubled one, then the
    busiest others, ``most`` in all (more where more are troubled). A node
    of a job over thousands reads from every other, and a cluster's status
    asks every node."""
    troubled: list[PeerHealth] = []
    healthy: list[PeerHealth] = []
    for peer in peers:
        (troubled if peer.troubled else healthy).append(peer)
    healthy.sort(key=lambda peer: peer.samples, reverse=True)
    return sorted(troubled + healthy[: max(0, most - len(troubled))], key=lambda peer: peer.node)


class Peers:
    """Channels to the other daemons and their health, keyed by node name."""

    def __init__(
        self, timeout: float, credentials: Credentials = Credentials(), bulk: BulkClient | None = None
    ) -> None:
        self.timeout = timeout
        self.credentials = credentials
        self.bulk = bulk
        self.bulk_samples = 0
        self.bulk_bytes = 0
        #: Bulk reads that failed and went over gRPC instead.
        self.bulk_fallbacks = 0
        #: Whole samples a peer sent in another length than the manifest's (read again elsewhere).
        self.refused_lengths = 0
        self._bulk_off_until: dict[str, float] = {}
        #: node -> (bulk address the directory lists, the one the peer named since).
        self._said: dict[str, tuple[str, str]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, cache_pb2_grpc.CacheStub] = {}
        self._addresses: dict[str, str] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._health: dict[str, PeerHealth] = {}
        self._fetching = ByteBudgets(FETCHED_BYTES_PER_PEER)
        self._bulk = BulkPeerTransport(bulk) if bulk is not None else None
        self._grpc = GrpcPeerTransport(self.stub)

    def health(self) -> list[PeerHealth]:
        return [self._health[node] for node in sorted(self._health)]

    async def fetch(
        self,
        node: str,
        address: str,
        dataset: str,
        manifest_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        registered: float = 0.0,
        bulk_address: str = "",
        landing: Landing | None = None,
    ) -> dict[int, tuple[bytes | memoryview, int]]:
        """The samples of ``ids`` that ``node`` holds: id -> (payload, checksum).

        ``lengths`` are the payload lengths of the dataset's samples (by id),
        as the manifest has them. ``registered`` is when the directory says
        the peer's daemon registered; ``bulk_address`` where its bulk listener
        is ("" for none). ``landing`` places each payload that comes over the bulk
        path (the result holds them too). Never raises for a
        peer's failure: what did not arrive intact is simply absent from the
        result, for the caller to read elsewhere.
        """
        health = self._health.setdefault(node, PeerHealth(node))
        if registered > health.registered:
            health.registered = registered
            health.suspect_until = 0.0
        if health.suspect or not address:
            return {}
        nbytes = int(lengths[ids].sum())
        budget = self._fetching.get(node)
        await budget.take(nbytes)
        deadline = batch_deadline(self.timeout, nbytes)
        try:
            bulk_address = self.bulk_address(node, bulk_address)
            bulk = self._bulk
            if bulk_first(bulk_address, bulk is not None, self.bulk_usable(bulk_address)):
                assert bulk is not None  # the bulk path is on
                fresh = ""
                try:
                    return await self._read(
                        bulk, health, bulk_address, dataset, manifest_id, ids, lengths, deadline, landing
                    )
                except BulkError as exc:
                    fresh = await self.rediscovered(node, address, bulk_address)
                    if not fresh:
                        self.bulk_failed(bulk_address, node, exc)
                if fresh:
                    try:
                        return await self._read(
                            bulk, health, fresh, dataset, manifest_id, ids, lengths, deadline, landing
                        )
                    except BulkError as exc:
                        self.bulk_failed(fresh, node, exc)
            return await self._read(self._grpc, health, address, dataset, manifest_id, ids, lengths, deadline, None)
        finally:
            budget.give(nbytes)

    async def _read(
        self,
        transport: PeerTransport,
        health: PeerHealth,
        address: str,
        dataset: str,
        manifest_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        deadline: float,
        landing: Landing | None,
    ) -> dict[int, tuple[bytes | memoryview, int]]:
        """The samples by ``transport``, its failure counted against the peer;
        a BulkError (bulk only) is left for the caller to fall back on gRPC."""
        started = time.monotonic()
        try:
            read = await transport.read(health.node, address, dataset, manifest_id, ids, lengths, deadline, landing)
        except PeerReadFailed as exc:
            health.bad_checksums += exc.bad_checksums
            self._failed(health, address, exc.code, exc.message, started)
            return {}
        health.bad_checksums += read.bad_checksums
        samples = self._admitted(health.node, read.samples, lengths)
        self._answered(health, address, len(samples), read.bytes)
        if transport is self._bulk:
            self.bulk_samples += len(samples)
            self.bulk_bytes += read.bytes
        return samples

    def _admitted(
        self, node: str, samples: dict[int, tuple[bytes | memoryview, int]], lengths: np.ndarray
    ) -> dict[int, tuple[bytes | memoryview, int]]:
        """The samples a peer sent in the manifest's length (see :mod:`dataquay.server.node.cache.admission`);
        one of another length is read elsewhere, as a corrupt one is."""
        ids = np.fromiter(samples, dtype=np.int64, count=len(samples))
        sizes = np.fromiter((len(data) for data, _ in samples.values()), dtype=np.int64, count=len(samples))
        refused = refusals(ids, sizes, lengths) != ADMITTED
        if not refused.any():
            return samples
        self.refused_lengths += int(refused.sum())
        log.warning(
            "a peer sent samples in another length than the manifest's; reading them elsewhere",
            extra={"fields": {"peer": node, "samples": int(refused.sum())}},
        )
        return {i: samples[i] for i in ids[~refused].tolist()}

    @staticmethod
    def _answered(health: PeerHealth, address: str, samples: int, nbytes: int) -> None:
        if health.failures_in_a_row:
            log.info("peer answers again", extra={"fields": {"peer": health.node, "address": address}})
            health.failures_in_a_row = 0
        health.samples += samples
        health.bytes += nbytes

    def bulk_address(self, node: str, listed: str) -> str:
        """Where ``node``'s bulk listener is: as the directory lists it, or as
        the peer named it since (while the listing still says ``listed``)."""
        said = self._said.get(node)
        return said[1] if said is not None and said[0] == listed else listed

    async def rediscovered(self, node: str, address: str, failed: str) -> str:
        """The bulk address ``node`` names itself (its InfoReply) when that is
        not ``failed``; "" when it names none or the same, or does not answer."""
        try:
            info = await self.stub(node, address).Info(pb.InfoRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError:
            return ""
        if not info.bulk_address or info.bulk_address == failed:
            return ""
        previous = self._said.get(node)
        listed = previous[0] if previous is not None and previous[1] == failed else failed
        self._said[node] = (listed, info.bulk_address)
        return info.bulk_address

    def bulk_usable(self, address: str) -> bool:
        """Whether the bulk listener at ``address`` has not failed lately."""
        return time.monotonic() >= self._bulk_off_until.get(address, 0.0)

    def bulk_failed(self, address: str, node: str, error: Exception) -> None:
        """Leaves the bulk listener at ``address`` for gRPC for BULK_RETRY_SECONDS."""
        self.bulk_fallbacks += 1
        self._bulk_off_until[address] = time.monotonic() + BULK_RETRY_SECONDS
        log.warning(
            "bulk connection to a peer failed; using gRPC with it for a while",
            extra={"fields": {"peer": node, "address": address, "error": str(error), "retry_in_s": BULK_RETRY_SECONDS}},
        )

    def _failed(self, health: PeerHealth, address: str, code: str, error: str, started: float) -> None:
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
            extra={
                "fields": {"peer": health.node, "address": address, "code": code, "error": error, "retry_in_s": backoff}
            },
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
        if self.bulk is not None:
            self.bulk.close()
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()
