"""Deterministic synthetic datasets, written as real files.

The demo, the tests and the benchmarks need datasets of a known shape and
known bytes without shipping any. Every generator here lays its samples out so
that the manifest built from the tree gives synthetic sample ``i`` the id
``i`` (zero-padded names, class folders in contiguous blocks), and the bytes of
sample ``i`` are a pure function of ``(seed, i)``: :func:`sample_bytes`. A
test can therefore check a served sample without reading the PFS again.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

_NPY_CHUNK_BYTES = 16 << 20


def sample_bytes(seed: int, sample_id: int, size: int) -> bytes:
    """The content of synthetic sample ``sample_id``: ``size`` pseudo-random bytes.

    Random rather than patterned so that compression or deduplication in any
    layer cannot flatter a benchmark.
    """
    return np.random.default_rng((seed, sample_id)).bytes(size)


def _size(sizes: Sequence[int], sample_id: int) -> int:
    """Size of sample ``sample_id``: ``sizes`` cycled, so any mix is exact."""
    return sizes[sample_id % len(sizes)]


def _class(sample_id: int, num_samples: int, classes: int) -> int:
    """Class of a sample: contiguous blocks of ids, so id order is class order."""
    return sample_id * classes // num_samples


def make_files_dataset(
    root: str | os.PathLike[str], num_samples: int, *, sizes: Sequence[int] = (4096,), classes: int = 10, seed: int = 0
) -> Path:
    """An ImageNet-style tree: ``root/class_NNN/IIIIIIII.bin``, one file a sample."""
    root = Path(root)
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(num_samples):
        path = root / f"class_{_class(i, num_samples, classes):03d}" / f"{i:08d}.bin"
        path.write_bytes(sample_bytes(seed, i, _size(sizes, i)))
    return root


def make_tar_dataset(
    root: str | os.PathLike[str],
    num_samples: int,
    *,
    samples_per_shard: int = 100,
    sizes: Sequence[int] = (4096,),
    classes: int = 10,
    seed: int = 0,
) -> Path:
    """WebDataset-style shards ``root/shard_NNNNNN.tar``.

    Sample ``i`` is the members ``IIIIIIII.bin`` (its bytes) and
    ``IIIIIIII.cls`` (its class as decimal text), in that order.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for shard, first in enumerate(range(0, num_samples, samples_per_shard)):
        with tarfile.open(root / f"shard_{shard:06d}.tar", "w") as tar:
            for i in range(first, min(first + samples_per_shard, num_samples)):
                label = str(_class(i, num_samples, classes)).encode()
                _add_member(tar, f"{i:08d}.bin", sample_bytes(seed, i, _size(sizes, i)))
                _add_member(tar, f"{i:08d}.cls", label)
    return root


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def make_npy_dataset(
    root: str | os.PathLike[str],
    num_records: int,
    *,
    record_shape: Sequence[int] = (64,),
    dtype: str = "float32",
    files: int = 2,
    seed: int = 0,
) -> Path:
    """Records split evenly over ``root/part_NNNNN.npy`` arrays (simulation frames).

    Values are drawn per file from a generator seeded by ``(seed, file)``,
    chunk by chunk so a large dataset never sits in memory at once: floats are
    standard normal, integers and booleans uniform over the type's range.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    kind = np.dtype(dtype)
    if kind.hasobject or kind.names is not None:
        raise ValueError(f"synthetic records need a plain numeric dtype, not {kind}")
    shape = tuple(record_shape)
    record_bytes = max(kind.itemsize * int(np.prod(shape, dtype=np.int64)), 1)
    chunk = max(_NPY_CHUNK_BYTES // record_bytes, 1)
    for index, count in enumerate(_split(num_records, files)):
        array = npy_format.open_memmap(root / f"part_{index:05d}.npy", mode="w+", dtype=kind, shape=(count, *shape))
        rng = np.random.default_rng((seed, index))
        for start in range(0, count, chunk):
            array[start : start + chunk] = _random(rng, (min(chunk, count - start), *shape), kind)
        array.flush()
        del array
    return root


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (k < extra) for k in range(parts)]


def _random(rng: np.random.Generator, shape: tuple[int, ...], kind: np.dtype) -> np.ndarray:
    if kind.kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(kind, copy=False)
    if kind.kind in "iu":
        info = np.iinfo(kind)
        return rng.integers(info.min, info.max, size=shape, dtype=kind, endpoint=True)
    if kind.kind == "b":
        return rng.integers(0, 2, size=shape, dtype=np.uint8).astype(bool)
    return np.frombuffer(rng.bytes(kind.itemsize * int(np.prod(shape))), dtype=kind).reshape(shape)
