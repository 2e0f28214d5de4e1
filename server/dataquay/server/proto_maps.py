"""Domain objects as the API describes them, for both gRPC services: the
daemon's and the directory's answers to dataset calls are one shape."""

from __future__ import annotations

from dataquay.client.wire.tiers import SERVED_TIERS
from dataquay.protos import cache_pb2 as pb
from dataquay.server.registry import Registered

FORMAT_TO_PROTO = {"files": pb.FORMAT_FILES, "tar": pb.FORMAT_TAR, "npy": pb.FORMAT_NPY}
FORMAT_FROM_PROTO = {v: k for k, v in FORMAT_TO_PROTO.items()}
#: Each tier a daemon serves from by name, and its value on the wire.
TIER_TO_PROTO = {name: tier for tier, name in SERVED_TIERS.items()}


def dataset_info(entry: Registered, cached_samples: int = 0, cached_bytes: int = 0) -> pb.DatasetInfo:
    """A registry entry as the API describes it (the directory caches nothing: zeros)."""
    manifest, record = entry.manifest, entry.record
    stats = manifest.size_stats()
    return pb.DatasetInfo(
        name=record.name,
        root=record.root,
        format=FORMAT_TO_PROTO[record.format],
        num_samples=manifest.num_samples,
        total_bytes=manifest.total_bytes,
        sample_size=pb.SampleSizeStats(
            min=int(stats["min"]), max=int(stats["max"]), mean=stats["mean"], median=int(stats["median"])
        ),
        manifest_id=record.manifest_id,
        cache_db=record.cache_db,
        manifest_bytes=len(manifest.data),
        cached_samples=cached_samples,
        cached_bytes=cached_bytes,
        created_unix=record.created,
        record_dtype=str(manifest.record_dtype) if manifest.record_dtype is not None else "",
        record_shape=manifest.record_shape or (),
    )
