"""A dataset registered again after its files changed: which samples of the
new manifest are the old one's, byte for byte, and ids that stay put. Pure:
numpy in, numpy out.

A sample is known by what identifies its bytes on the PFS: its file's path,
size and mtime_ns (as the manifest recorded them when it was built), its
offset and its length. Two manifests that agree on all five for a sample
describe the same bytes, so the cache of the old version still holds the new
one's, and a change to 1% of the files restages 1% of the samples instead of
all of them. A file without a recorded size or mtime (-1) is never taken for
unchanged.

Ids: the new manifest lists the files the old one listed in the old order
(changed or not), and files that are new after them, so that appending a file
moves no id; a file removed takes its ids out and the ids after it move down.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dataquay.client.manifest import Manifest, ManifestWriter

#: Header keys a manifest's writer sets itself, not its builder.
_WRITTEN_KEYS = ("version", "num_samples", "created", "arrays", "root", "format")


def paths(manifest: Manifest) -> list[str]:
    return [manifest.path(i) for i in range(manifest.num_paths)]


def path_map(old: Manifest, new: Manifest, unchanged: bool) -> np.ndarray:
    """For each old path index, its index in ``new`` (-1: none); with
    ``unchanged`` only where size and mtime_ns agree and were recorded."""
    index = {p: i for i, p in enumerate(paths(new))}
    mapped = np.array([index.get(p, -1) for p in paths(old)], dtype=np.int64)
    if unchanged:
        found = mapped >= 0
        same = np.zeros(len(mapped), dtype=bool)
        at = mapped[found]
        same[found] = (
            (old.path_size[found] == new.path_size[at])
            & (old.path_mtime_ns[found] == new.path_mtime_ns[at])
            & (old.path_size[found] >= 0)
            & (old.path_mtime_ns[found] >= 0)
        )
        mapped[~same] = -1
    return mapped


def unchanged_samples(old: Manifest, new: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """(old ids, new ids) of the samples whose bytes are the same in both, in new id order."""
    if old.root != new.root or old.format != new.format:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    mapped = path_map(old, new, unchanged=True)
    old_path = mapped[old.sample_path.astype(np.int64)]
    kept = np.flatnonzero(old_path >= 0)
    old_keys = _keys(old_path[kept], old.sample_offset[kept], old.sample_length[kept])
    new_keys = _keys(new.sample_path.astype(np.int64), new.sample_offset, new.sample_length)
    _, old_at, new_at = np.intersect1d(old_keys, new_keys, assume_unique=False, return_indices=True)
    order = np.argsort(new_at, kind="stable")
    return kept[old_at[order]].astype(np.int64), new_at[order].astype(np.int64)


def _keys(path: np.ndarray, offset: np.ndarray, length: np.ndarray) -> np.ndarray:
    """One comparable value per sample: its (path, offset, length) as a record."""
    table = np.empty(len(path), dtype=[("p", ">i8"), ("o", ">u8"), ("n", ">u8")])
    table["p"], table["o"], table["n"] = path, offset, length
    return table.view(np.dtype((np.void, table.dtype.itemsize)))


def order_like(old: Manifest, new: Manifest) -> np.ndarray:
    """The new manifest's sample ids in the order that keeps the old files'
    order and puts new files after them (see the module's docstring)."""
    mapped = path_map(old, new, unchanged=False)
    first_old_id = np.full(new.num_paths, np.iinfo(np.int64).max, dtype=np.int64)
    seen = mapped[old.sample_path.astype(np.int64)]
    found = seen >= 0
    np.minimum.at(first_old_id, seen[found], np.flatnonzero(found))
    rank = first_old_id[new.sample_path.astype(np.int64)]
    return np.lexsort((np.arange(new.num_samples), rank))


def reordered(manifest: Manifest, order: np.ndarray) -> ManifestWriter:
    """A writer of ``manifest`` with its samples in ``order`` (its paths and labels as they were)."""
    extra: dict[str, Any] = {k: v for k, v in manifest.header.items() if k not in _WRITTEN_KEYS}
    writer = ManifestWriter(manifest.root, manifest.format, **extra)
    for index, path in enumerate(paths(manifest)):
        writer.add_path(path, int(manifest.path_size[index]), int(manifest.path_mtime_ns[index]))
    for sample_id in order.tolist():
        writer.add_sample(
            int(manifest.sample_path[sample_id]),
            int(manifest.sample_offset[sample_id]),
            int(manifest.sample_length[sample_id]),
            manifest.label(sample_id),
        )
    return writer


def built_like(previous: Manifest | None, built: ManifestWriter) -> ManifestWriter:
    """``built``, with ids that stay put where ``previous`` (the version it
    replaces, if any) had the same files."""
    if previous is None:
        return built
    manifest = Manifest(built.to_bytes())
    if previous.root != manifest.root or previous.format != manifest.format:
        return built
    order = order_like(previous, manifest)
    if np.array_equal(order, np.arange(manifest.num_samples)):
        return built
    return reordered(manifest, order)
