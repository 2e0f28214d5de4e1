"""The binary manifest: where every sample of a dataset lives on the PFS.

A manifest maps sample ids 0..N-1 to (file, offset, length). It is built once,
when a dataset is registered, and read by the daemon (to stage and to serve
misses) and by the client (to fall back to the PFS when the daemon is gone).
It stays compact so that millions of samples cost tens of bytes each::

    b"DQMANIF1"  [u32 header length][header, JSON]
    then 8-byte aligned arrays, at the offsets the header lists:
      sample_path    u32[N]   index into the path table
      sample_offset  u64[N]   byte offset inside that file
      sample_length  u64[N]   bytes
      sample_label   i32[N]   index into the label table, -1 for none
      path_offsets   u64[P+1] into path_blob (UTF-8 paths relative to root)
      path_blob      bytes
      label_offsets  u64[L+1] into label_blob
      label_blob     bytes
      path_size      i64[P]   each file's size when the manifest was built
      path_mtime_ns  i64[P]   each file's st_mtime_ns then

All integers little-endian. Paths are relative, use "/" and never contain "..".

The header's ``version`` names this layout; a reader refuses any other. The
reader compares the per-file size and mtime with each file it opens, so a
file that changed after registration is refused, never served as a prefix or
a mix of old and new bytes. -1 in either array means "not recorded" (a
manifest written by hand) and that file is not checked.
"""

from __future__ import annotations

import array
import io
import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash
from numpy.lib import format as npy_format

from dataquay.client.errors import ManifestError

MAGIC = b"DQMANIF1"
VERSION = 2
FORMATS = ("files", "tar", "npy")
_HEADER_LEN = struct.Struct("<I")
_ARRAYS: tuple[tuple[str, str], ...] = (
    ("sample_path", "<u4"),
    ("sample_offset", "<u8"),
    ("sample_length", "<u8"),
    ("sample_label", "<i4"),
    ("path_offsets", "<u8"),
    ("path_blob", "u1"),
    ("label_offsets", "<u8"),
    ("label_blob", "u1"),
    ("path_size", "<i8"),
    ("path_mtime_ns", "<i8"),
)


def _align8(n: int) -> int:
    return (n + 7) & ~7


def check_relative_path(rel: str) -> str:
    """``rel`` if it is a plain relative path that cannot leave its root.

    A component that is empty, ``.`` or ``..`` is found as a substring of the
    path wrapped in slashes: readers check every path they open, so this
    costs a few substring searches, not a split.
    """
    if not rel or rel[0] == "/" or "\\" in rel or "\0" in rel:
        raise ManifestError(f"path {rel!r} is not a plain relative path")
    wrapped = f"/{rel}/"
    if "//" in wrapped or "/./" in wrapped or "/../" in wrapped:
        raise ManifestError(f"path {rel!r} leaves or re-enters its root")
    return rel


def _text(raw: np.ndarray, what: str, index: int) -> str:
    """Entry ``index`` of a path or label table as text."""
    try:
        return raw.tobytes().decode()
    except UnicodeDecodeError:
        raise ManifestError(f"manifest {what} {index} is not UTF-8 text") from None


@dataclass(frozen=True)
class SampleLocation:
    """Where one sample's bytes are: ``length`` bytes at ``offset`` of ``path``."""

    path: str
    offset: int
    length: int


class Manifest:
    """A read-only view of a manifest's bytes (no copies of the arrays)."""

    def __init__(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if bytes(view[: len(MAGIC)]) != MAGIC:
            raise ManifestError("not a dataquay manifest (bad magic)")
        try:
            (header_len,) = _HEADER_LEN.unpack_from(view, len(MAGIC))
            body = len(MAGIC) + _HEADER_LEN.size
            self.header: dict[str, Any] = json.loads(bytes(view[body : body + header_len]))
            version = self.header["version"]
            if version != VERSION:
                raise ManifestError(f"manifest version {version!r} is not one this dataquay reads ({VERSION})")
            arrays = {}
            for name, dtype in _ARRAYS:
                offset, count = self.header["arrays"][name]
                item = np.dtype(dtype).itemsize
                if offset < 0 or offset + count * item > len(view):
                    raise ManifestError(f"manifest array {name} runs past the end")
                arrays[name] = np.frombuffer(view, dtype=dtype, count=count, offset=offset)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError, struct.error) as exc:
            raise ManifestError(f"malformed manifest header: {exc}") from exc
        self._data = view
        self._arrays = arrays
        self.sample_path: np.ndarray = arrays["sample_path"]
        self.sample_offset: np.ndarray = arrays["sample_offset"]
        self.sample_length: np.ndarray = arrays["sample_length"]
        self.sample_label: np.ndarray = arrays["sample_label"]
        self._path_offsets: np.ndarray = arrays["path_offsets"]
        self._path_blob = arrays["path_blob"]
        self._path_text = self._path_blob.data
        self._label_offsets: np.ndarray = arrays["label_offsets"]
        self._label_blob = arrays["label_blob"]
        self.path_size: np.ndarray = arrays["path_size"]
        self.path_mtime_ns: np.ndarray = arrays["path_mtime_ns"]
        self._validate()
        self.manifest_id = xxhash.xxh3_128_hexdigest(view)

    def content_id(self) -> str:
        """A hash of what the manifest says of its samples, not of when it was built.

        Each registration of a root builds a manifest with a new
        ``manifest_id``; registering unchanged files again gives one with the
        same ``content_id``, which is how a daemon knows its cache of the
        earlier registration still holds the right bytes.
        """
        digest = xxhash.xxh3_128()
        described = {key: value for key, value in self.header.items() if key not in ("created", "arrays")}
        digest.update(json.dumps(described, sort_keys=True).encode())
        for name in sorted(self._arrays):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(self._arrays[name]).data)
        return digest.hexdigest()

    def _validate(self) -> None:
        n = self.num_samples
        if not (len(self.sample_offset) == len(self.sample_length) == len(self.sample_label) == n):
            raise ManifestError("manifest sample arrays differ in length")
        for key in ("root", "format"):
            if not isinstance(self.header.get(key), str):
                raise ManifestError(f"manifest header has no {key}")
        if self.format not in FORMATS:
            raise ManifestError(f"unknown manifest format {self.format!r}")
        for offsets, blob, what in (
            (self._path_offsets, self._path_blob, "path"),
            (self._label_offsets, self._label_blob, "label"),
        ):
            if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(blob):
                raise ManifestError(f"manifest {what} table is inconsistent")
            if np.any(np.diff(offsets.astype(np.int64)) < 0):
                raise ManifestError(f"manifest {what} table is not ordered")
        if not (len(self.path_size) == len(self.path_mtime_ns) == self.num_paths):
            raise ManifestError("manifest file size or mtime table differs in length from the path table")
        if n and int(self.sample_path.max()) >= self.num_paths:
            raise ManifestError("manifest sample refers to a path that does not exist")
        if n and int(self.sample_label.max()) >= self.num_labels:
            raise ManifestError("manifest sample refers to a label that does not exist")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        """Reads a manifest file."""
        try:
            return cls(Path(path).read_bytes())
        except OSError as exc:
            raise ManifestError(f"cannot read manifest {path}: {exc.strerror}") from exc

    @property
    def data(self) -> memoryview:
        """The manifest's bytes, as stored and sent."""
        return self._data

    @property
    def num_samples(self) -> int:
        return len(self.sample_path)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def root(self) -> str:
        return str(self.header["root"])

    @property
    def format(self) -> str:
        return str(self.header["format"])

    @property
    def tar_grouped(self) -> bool:
        """tar only: a sample is every member sharing a basename, framed together."""
        return bool(self.header.get("tar_grouped", False))

    @property
    def record_dtype(self) -> np.dtype | None:
        """npy only: the dtype of one record, for ``np.frombuffer(sample, dtype)``; else None."""
        descr = self.header.get("npy_dtype")
        return None if descr is None else npy_format.descr_to_dtype(descr)

    @property
    def record_shape(self) -> tuple[int, ...] | None:
        """npy only: the shape of one record (the arrays' shape without axis 0); else None."""
        shape = self.header.get("npy_shape")
        return None if shape is None else tuple(int(n) for n in shape)

    @property
    def num_paths(self) -> int:
        return len(self._path_offsets) - 1

    @property
    def num_labels(self) -> int:
        return len(self._label_offsets) - 1

    @property
    def total_bytes(self) -> int:
        return int(self.sample_length.sum())

    def path(self, index: int) -> str:
        """Relative path number ``index`` of the path table, checked to stay inside root."""
        start, end = self._path_offsets[index : index + 2].tolist()
        try:
            text = str(self._path_text[start:end], "utf-8")
        except UnicodeDecodeError:
            raise ManifestError(f"manifest path {index} is not UTF-8 text") from None
        return check_relative_path(text)

    def label(self, sample_id: int) -> str | None:
        """The sample's label string (files: its folder), or None."""
        index = int(self.sample_label[sample_id])
        return None if index < 0 else self.label_name(index)

    def classes(self) -> list[str]:
        """The label names, sorted, as torchvision's ImageFolder lists its
        classes: a sample's target (:meth:`targets`) indexes this list."""
        return sorted(self.label_name(index) for index in range(self.num_labels))

    def targets(self) -> np.ndarray:
        """Every sample's class as an index into :meth:`classes` (int64), -1
        for a sample without a label."""
        names = [self.label_name(index) for index in range(self.num_labels)]
        rank = {name: i for i, name in enumerate(sorted(names))}
        by_label = np.array([rank[name] for name in names] + [-1], dtype=np.int64)
        return by_label[self.sample_label]  # -1 picks the appended -1

    def label_name(self, index: int) -> str:
        """Entry ``index`` of the label table."""
        start, end = int(self._label_offsets[index]), int(self._label_offsets[index + 1])
        return _text(self._label_blob[start:end], "label", index)

    def shard_groups(self) -> np.ndarray:
        """The group of every sample for the ``shard`` partition (int32).

        A group is what a node should read from the PFS whole: tar and npy
        samples group by their file (shard), files samples by their label
        (class folder). A files sample without a label is a group of its own,
        numbered after the labels so that it shares a group with nothing.
        """
        if self.format != "files":
            return self.sample_path.astype(np.int32)
        labels = self.sample_label.astype(np.int32)
        return np.where(labels >= 0, labels, self.num_labels + self.sample_path.astype(np.int32))

    def location(self, sample_id: int) -> SampleLocation:
        return SampleLocation(
            self.path(int(self.sample_path[sample_id])),
            int(self.sample_offset[sample_id]),
            int(self.sample_length[sample_id]),
        )

    def size_stats(self) -> dict[str, float]:
        """min, max, mean and median sample size in bytes (zeros when empty)."""
        if not self.num_samples:
            return {"min": 0, "max": 0, "mean": 0.0, "median": 0}
        lengths = self.sample_length
        return {
            "min": int(lengths.min()),
            "max": int(lengths.max()),
            "mean": float(lengths.mean()),
            "median": int(np.median(lengths)),
        }


class ManifestWriter:
    """Builds a manifest one sample at a time in about 30 bytes per sample.

    Samples get ids in the order they are added; the builder decides that order
    and documents it.
    """

    def __init__(self, root: str, fmt: str, **header: Any) -> None:
        if fmt not in FORMATS:
            raise ManifestError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
        self._header: dict[str, Any] = {"root": root, "format": fmt, **header}
        self._sample_path = array.array("I")
        self._sample_offset = array.array("Q")
        self._sample_length = array.array("Q")
        self._sample_label = array.array("i")
        self._path_offsets = array.array("Q", [0])
        self._path_blob = bytearray()
        self._label_offsets = array.array("Q", [0])
        self._label_blob = bytearray()
        self._path_size = array.array("q")
        self._path_mtime_ns = array.array("q")
        self._labels: dict[str, int] = {}

    def add_path(self, rel: str, size: int = -1, mtime_ns: int = -1) -> int:
        """Registers a file relative to the root; returns its index.

        ``size`` and ``mtime_ns`` are the file's as it was read to build the
        manifest: a reader refuses the file once either differs. -1 records
        nothing, and that file is never checked.
        """
        self._path_blob += check_relative_path(rel).encode()
        self._path_offsets.append(len(self._path_blob))
        self._path_size.append(size)
        self._path_mtime_ns.append(mtime_ns)
        return len(self._path_offsets) - 2

    def label_index(self, label: str) -> int:
        index = self._labels.get(label)
        if index is None:
            index = self._labels[label] = len(self._labels)
            self._label_blob += label.encode()
            self._label_offsets.append(len(self._label_blob))
        return index

    def add_sample(self, path_index: int, offset: int, length: int, label: str | None = None) -> int:
        """Appends a sample; returns its id."""
        self._sample_path.append(path_index)
        self._sample_offset.append(offset)
        self._sample_length.append(length)
        self._sample_label.append(-1 if label is None else self.label_index(label))
        return len(self._sample_path) - 1

    @property
    def num_samples(self) -> int:
        return len(self._sample_path)

    def sample_lengths(self) -> np.ndarray:
        """A copy of the payload length of every sample added so far."""
        return np.array(self._sample_length, dtype=np.uint64)

    def sample_path(self, sample_id: int) -> str:
        """The path (relative to the root) of a sample added so far."""
        index = self._sample_path[sample_id]
        return bytes(self._path_blob[self._path_offsets[index] : self._path_offsets[index + 1]]).decode()

    def _parts(self) -> Iterator[tuple[str, memoryview]]:
        for name, _ in _ARRAYS:
            yield name, memoryview(getattr(self, "_" + name)).cast("B")

    def write(self, out: BinaryIO) -> None:
        """Writes the manifest to a binary file object."""
        parts = list(self._parts())
        itemsizes = {name: np.dtype(dtype).itemsize for name, dtype in _ARRAYS}
        header = {**self._header, "version": VERSION, "num_samples": self.num_samples, "created": time.time()}
        # The header holds the array offsets, which depend on the header's own
        # length: lay out with a placeholder, then pad the header to that size.
        header["arrays"] = {name: [0, 0] for name, _ in parts}
        layout_len = len(json.dumps(header)) + 64 * len(parts)
        pos = _align8(len(MAGIC) + _HEADER_LEN.size + layout_len)
        for name, raw in parts:
            header["arrays"][name] = [pos, len(raw) // itemsizes[name]]
            pos = _align8(pos + len(raw))
        encoded = json.dumps(header).encode().ljust(layout_len)
        out.write(MAGIC + _HEADER_LEN.pack(len(encoded)) + encoded)
        written = len(MAGIC) + _HEADER_LEN.size + len(encoded)
        for name, raw in parts:
            start = header["arrays"][name][0]
            out.write(b"\0" * (start - written))
            out.write(raw)
            written = start + len(raw)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self.write(buf)
        return buf.getvalue()
