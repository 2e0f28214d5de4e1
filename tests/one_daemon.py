"""What the tests of a client against one real daemon share: the daemon's
Cache RPCs, the bytes the synthetic datasets hold, and which tier served a read."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
from polling import wait_until

import dataquay.client as dq
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess


@contextmanager
def cache_stub(daemon: DaemonProcess) -> Iterator[cache_pb2_grpc.CacheStub]:
    with grpc.insecure_channel(grpc_target(daemon.address), options=channel_options()) as channel:
        yield cache_pb2_grpc.CacheStub(channel)


def add(daemon: DaemonProcess, name: str, root: Path, *, replace: bool = False) -> pb.DatasetInfo:
    with cache_stub(daemon) as stub:
        return stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root), replace=replace))


def stage(daemon: DaemonProcess, name: str) -> pb.StageProgress:
    with cache_stub(daemon) as stub:
        *_, last = stub.Stage(pb.StageRequest(dataset=name))
    assert last.finished and not last.error and not last.cache_full
    return last


def reply_samples(chunks: Iterable[pb.ReadChunk]) -> Iterator[pb.Sample]:
    """The samples of a Read's reply as they arrive, a sample sent in pieces
    joined into one (its pieces checked for order and length)."""
    parts: list[bytes] = []
    for chunk in chunks:
        if not chunk.HasField("piece"):
            assert not parts, "a sample's pieces were cut short"
            yield from chunk.samples
            continue
        piece = chunk.piece
        assert piece.offset == sum(map(len, parts)) and piece.data, "a piece out of order"
        parts.append(piece.data)
        if piece.offset + len(piece.data) == piece.length:
            yield pb.Sample(id=piece.id, tier=piece.tier, checksum=piece.checksum, data=b"".join(parts))
            parts = []
    assert not parts, "the reply ended inside a sample's pieces"


def cached_samples(daemon: DaemonProcess, name: str) -> int:
    with cache_stub(daemon) as stub:
        return stub.GetDataset(pb.GetDatasetRequest(name=name)).cached_samples


def daemon_stats(daemon: DaemonProcess) -> pb.StatsReply:
    with cache_stub(daemon) as stub:
        return stub.Stats(pb.StatsRequest())


def files_bytes(seed: int, ids: Sequence[int], sizes: Sequence[int]) -> list[bytes]:
    """What make_files_dataset wrote for ``ids``."""
    return [synthetic.sample_bytes(seed, i, sizes[i % len(sizes)]) for i in ids]


def tiers_read(client: dq.Client, read: Callable[[], list[bytes]]) -> tuple[list[bytes], dict[str, int]]:
    """What ``read`` returned and how many samples each tier served it."""
    before = client.stats().samples
    out = read()
    after = client.stats().samples
    return out, {tier: after[tier] - before[tier] for tier in after}


def read_locally(client: dq.Client, ds: dq.Dataset, ids: Sequence[int]) -> list[bytes]:
    """``ds.get_batch(ids)`` once every sample of it is a local hit.

    A client that looked for a dataset's sub-database before the daemon made
    it looks again only after about a second.
    """
    out: list[bytes] = []

    def all_local() -> bool:
        nonlocal out
        out, tiers = tiers_read(client, lambda: ds.get_batch(ids))
        return tiers["local"] == len(ids)

    wait_until(all_local, f"staged samples of {ds.name!r} came from the local cache")
    return out
