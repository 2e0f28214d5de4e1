"""The daemon-to-peer hop: how the samples a peer's cache holds get to this daemon.

Two transports carry one peer read, both behind :class:`PeerTransport`:

- :class:`BulkPeerTransport`: the bulk data path (:mod:`dataquay.server.node.peers.bulk`),
  payloads landing straight where they are wanted. It presents the node
  token in the bulk handshake (each side proves it holds it; no trainer
  holds it).
- :class:`GrpcPeerTransport`: a streamed ``Read(peer=True)`` on the peer's
  gRPC port, parsed by :class:`dataquay.client.wire.read_stream.ReadStream`. Its
  channel presents this node's credentials (the node token, which
  ``dataquay.server.auth`` accepts wherever the cluster token is accepted).

:func:`bulk_first` is the one rule for which runs first; what follows a
bulk failure (the peer's own word on its address, then gRPC) is in
:meth:`dataquay.server.node.peers.reads.Peers.fetch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np

from dataquay.client.errors import DataquayError, PieceError
from dataquay.client.wire.read_stream import ReadStream
from dataquay.client.wire.status_codes import code_of_number
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.node.peers.bulk.client import BulkClient, BulkRefusedError, BulkTimeoutError, Landing


class PeerReadFailed(DataquayError):
    """The peer failed the read (refused, too slow, a reply that makes no
    sense): it counts against the peer, and its samples come from elsewhere."""

    def __init__(self, code: str, message: str, bad_checksums: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        #: The gRPC status name the failure amounts to, for logs.
        self.code = code
        self.message = message
        #: Payloads that arrived with a bad checksum before the read failed.
        self.bad_checksums = bad_checksums


@dataclass
class PeerRead:
    """What one peer read brought: intact payloads by id, their bytes, and
    how many arrived with a bad checksum (dropped)."""

    samples: dict[int, tuple[bytes | memoryview, int]] = field(default_factory=dict)
    bytes: int = 0
    bad_checksums: int = 0


class PeerTransport(Protocol):
    """One way of reading from a peer the samples its own cache holds."""

    #: Short name, for tests and logs.
    name: str

    async def read(
        self,
        node: str,
        address: str,
        dataset: str,
        manifest_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        deadline: float,
        landing: Landing | None,
    ) -> PeerRead:
        """The samples of ``ids`` that the peer ``node`` at ``address`` holds,
        checked against their checksums, within ``deadline`` seconds.

        Raises:
            PeerReadFailed: the peer failed the read.
            BulkError: (bulk only) the bulk connection failed otherwise; gRPC may be asked.
        """
        ...


class BulkPeerTransport:
    """Peer reads over the bulk data path; presents the node token in its handshake."""

    name = "bulk"

    def __init__(self, bulk: BulkClient) -> None:
        self.bulk = bulk

    async def read(
        self,
        node: str,
        address: str,
        dataset: str,
        manifest_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        deadline: float,
        landing: Landing | None,
    ) -> PeerRead:
        try:
            read = await self.bulk.read(address, dataset, manifest_id, ids, lengths, deadline, landing)
        except BulkTimeoutError as exc:
            raise PeerReadFailed("DEADLINE_EXCEEDED", str(exc)) from None
        except BulkRefusedError as exc:
            raise PeerReadFailed(code_of_number(exc.code).name, str(exc)) from None
        return PeerRead(dict(read.samples), read.bytes, read.bad_checksums)


class GrpcPeerTransport:
    """Peer reads as a streamed gRPC ``Read(peer=True)``; the channel
    (``stub``) presents this node's credentials."""

    name = "grpc"

    def __init__(self, stub: Callable[[str, str], cache_pb2_grpc.CacheStub]) -> None:
        self._stub = stub

    async def read(
        self,
        node: str,
        address: str,
        dataset: str,
        manifest_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        deadline: float,
        landing: Landing | None,
    ) -> PeerRead:
        request = pb.ReadRequest(dataset=dataset, ids=ids.tolist(), manifest_id=manifest_id, peer=True)
        out = PeerRead()
        stream = ReadStream(f"peer {node}", lengths, dataset=dataset)
        call = self._stub(node, address).Read(request, timeout=deadline)
        try:
            async for chunk in call:
                for sample_id, data, digest, _, missing, _, intact in stream.take(chunk):
                    if missing:
                        continue
                    if not intact:
                        out.bad_checksums += 1
                        continue
                    out.samples[sample_id] = (data, digest)
                    out.bytes += len(data)
            stream.end()
        except grpc.aio.AioRpcError as exc:
            raise PeerReadFailed(exc.code().name, exc.details() or "", out.bad_checksums) from None
        except PieceError as exc:
            call.cancel()
            raise PeerReadFailed("DATA_LOSS", str(exc), out.bad_checksums) from None
        return out


def bulk_first(bulk_address: str, bulk_on: bool, usable: bool) -> bool:
    """Whether a peer read goes over the bulk path first, else gRPC only:
    bulk where the peer has a bulk listener (``bulk_address``; a peer whose
    bulk path is off lists none), this daemon's bulk path is on (``bulk_on``:
    it has a bulk client), and that listener has not failed lately
    (``usable``: see :data:`dataquay.server.node.peers.reads.BULK_RETRY_SECONDS`)."""
    return bool(bulk_address) and bulk_on and usable
