"""Serving a batch of sample ids: cache first, the PFS for the rest.

A miss read from the PFS is handed to the store's writer without waiting, so
the reply never waits for an LMDB commit. A cached value whose checksum fails
is served from the PFS and rewritten (repaired) in the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from dataquay.client.channels import READ_CHUNK_BYTES
from dataquay.client.records import CHECKSUM_BYTES, stored_checksum
from dataquay.server.errors import BatchTooLargeError, DatasetReplacedError, SampleIdError
from dataquay.server.metrics import DaemonMetrics
from dataquay.server.pfs_pool import PfsPool
from dataquay.server.registry import Registered, Registry
from dataquay.server.store import PendingWrite, Store

T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """One sample of a reply."""

    sample_id: int
    tier: str
    data: bytes | memoryview
    checksum: int


class ReadService:
    """Resolves read requests against the node's tiers."""

    def __init__(
        self, registry: Registry, store: Store, pfs: PfsPool, metrics: DaemonMetrics, max_batch: int
    ) -> None:
        self.registry = registry
        self.store = store
        self.pfs = pfs
        self.metrics = metrics
        self.max_batch = max_batch

    def validate(self, dataset: str, ids: np.ndarray, manifest_id: str = "") -> Registered:
        """The dataset's entry; raises for an unknown or replaced dataset, a batch
        over the limit or an id out of range."""
        entry = self.registry.get(dataset)
        if manifest_id and manifest_id != entry.record.manifest_id:
            raise DatasetReplacedError(f"dataset {dataset!r} was replaced since it was opened; open it again")
        if len(ids) > self.max_batch:
            raise BatchTooLargeError(
                f"batch of {len(ids)} ids exceeds the limit of {self.max_batch} (--max-batch)"
            )
        n = entry.manifest.num_samples
        if len(ids) and int(ids.max()) >= n:
            bad = int(ids[ids >= n][0])
            raise SampleIdError(f"sample id {bad} out of range for dataset {dataset!r} (N={n})")
        return entry

    async def read(self, dataset: str, ids: np.ndarray, manifest_id: str = "") -> list[Served]:
        """The samples of ``ids`` in request order; raises PfsReadError if one is unreadable."""
        entry = self.validate(dataset, ids, manifest_id)
        db = entry.record.cache_db
        await self.store.open_dataset(db)
        cached, corrupt = self.store.get_many(db, ids.tolist())
        miss_positions = [i for i, hit in enumerate(cached) if hit is None]
        from_pfs: dict[int, tuple[memoryview, int]] = {}
        if miss_positions:
            miss_ids = np.unique(ids[miss_positions])
            values = await self.pfs.read(dataset, entry.manifest, miss_ids)
            repair = set(corrupt)
            name = db.encode()
            for sample_id, value in values.items():
                from_pfs[sample_id] = (memoryview(value)[CHECKSUM_BYTES:], stored_checksum(value))
                self.store.offer(PendingWrite(name, sample_id, value, sample_id in repair))
        out: list[Served] = []
        local_bytes = pfs_bytes = 0
        for sample_id, hit in zip(ids.tolist(), cached):
            if hit is None:
                payload, digest = from_pfs[sample_id]
                out.append(Served(sample_id, "pfs", payload, digest))
                pfs_bytes += len(payload)
            else:
                out.append(Served(sample_id, "local", *hit))
                local_bytes += len(hit[0])
        self.metrics.count_read("local", len(ids) - len(miss_positions), local_bytes)
        self.metrics.count_read("pfs", len(miss_positions), pfs_bytes)
        return out


def chunked(items: list[T], size_of: Callable[[T], int], limit: int = READ_CHUNK_BYTES) -> Iterator[list[T]]:
    """Splits a reply into messages of about ``limit`` bytes (at least one item each)."""
    chunk: list[T] = []
    size = 0
    for item in items:
        n = size_of(item)
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += n
    if chunk:
        yield chunk
