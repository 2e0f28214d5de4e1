"""Prepped batches in shared memory: one segment per batch under /dev/shm.

A member of a prep group writes the arrays its prep made into a segment of its
own and names it to the daemon; every member copies the arrays out and the
daemon frees the segment once all have. The names
(``dataquay-prep-<daemon pid>-<writer pid>-<token>``) tie a segment to the
daemon that keeps its group, not to its writer, unlike the read segments of
:mod:`dataquay.client.shm`: a batch stays usable after its writer died, and
the segments of a daemon that died are removed by the next one of the user
(:func:`remove_orphans`).

Layout: a fixed header (magic, JSON length, xxh3-64 of the rest), the JSON
description of the fields (dtype, shape, offset), then each field's bytes at
a 64-byte aligned offset. A reader checks the checksum before it trusts
anything, so a segment that was cut short or overwritten is refused, never
turned into a wrong batch.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from dataquay.client.errors import DataquayError
from dataquay.client.shm import SHM_DIR, process_alive

PREFIX = "dataquay-prep-"
NAME = re.compile(r"^dataquay-prep-(\d{1,10})-\d{1,10}-[0-9a-f]{12}$")
_MAGIC = b"DQPREP01"
_HEADER = struct.Struct("<8sQQ")  # magic, JSON length, xxh3-64 of everything after the header
_ALIGN = 64

#: What prep makes of one sample, and what a batch is: one array, or a tuple of them.
Batch = np.ndarray | tuple[np.ndarray, ...]


class PreppedBatchError(DataquayError):
    """A prepped batch's segment that is gone or fails its checksum."""


def daemon_pid(name: str) -> int | None:
    """The daemon whose group segment ``name`` belongs to, or None if it is no prepped batch's name."""
    match = NAME.match(name)
    return int(match.group(1)) if match else None


def collate(prepped: Sequence[Any]) -> Batch:
    """Stacks what prep returned for each sample of a batch: an array (or a
    scalar) each, or a tuple of them each; a tuple of stacked fields then."""
    if not prepped:
        raise ValueError("a batch needs at least one sample")
    if isinstance(prepped[0], tuple):
        return tuple(np.stack([np.asarray(p[f]) for p in prepped]) for f in range(len(prepped[0])))
    return np.stack([np.asarray(p) for p in prepped])


def write(batch: Batch, daemon_pid: int) -> tuple[str, int]:
    """Writes ``batch`` into a new segment for the group kept by daemon
    ``daemon_pid``; its name and size in bytes."""
    fields = batch if isinstance(batch, tuple) else (batch,)
    arrays = [np.ascontiguousarray(a) for a in fields]
    offsets, offset = [], 0
    for array in arrays:
        offsets.append(offset)
        offset = _aligned(offset + array.nbytes)
    described = [{"dtype": a.dtype.str, "shape": list(a.shape), "offset": o} for a, o in zip(arrays, offsets)]
    meta = json.dumps({"tuple": isinstance(batch, tuple), "fields": described}).encode()
    body_at = _aligned(_HEADER.size + len(meta))
    size = body_at + offset
    name = f"{PREFIX}{daemon_pid}-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as view:
            view[_HEADER.size : _HEADER.size + len(meta)] = meta
            for array, at in zip(arrays, offsets):
                start = body_at + at
                view[start : start + array.nbytes] = array.reshape(-1).view(np.uint8).data
            digest = xxhash.xxh3_64_intdigest(memoryview(view)[_HEADER.size : size])
            view[: _HEADER.size] = _HEADER.pack(_MAGIC, len(meta), digest)
    except BaseException:
        os.unlink(SHM_DIR / name)
        raise
    finally:
        os.close(fd)
    return name, size


def read(name: str) -> Batch:
    """Copies the batch out of segment ``name`` (it may be freed right after).

    Raises:
        PreppedBatchError: the segment is gone, or not a whole prepped batch.
    """
    if not NAME.match(name):
        raise PreppedBatchError(f"{name!r} is not a prepped batch's segment")
    try:
        with open(SHM_DIR / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as view:
                return _decode(memoryview(view), name)
    except (OSError, ValueError) as exc:
        raise PreppedBatchError(f"prepped batch {name} cannot be read: {exc}") from exc


def unlink(names: Sequence[str]) -> list[str]:
    """Removes the segments ``names``; those this process may not remove (another user's)."""
    refused = []
    for name in names:
        if not NAME.match(name):
            continue
        try:
            os.unlink(SHM_DIR / name)
        except FileNotFoundError:
            continue
        except OSError:
            refused.append(name)
    return refused


def remove_orphans() -> None:
    """Unlinks this user's prepped batches whose daemon has exited."""
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return
    uid = os.getuid()
    for entry in entries:
        pid = daemon_pid(entry.name)
        try:
            if pid is None or process_alive(pid) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            os.unlink(entry.path)
        except OSError:
            continue  # gone meanwhile


def _decode(view: memoryview, name: str) -> Batch:
    try:
        magic, meta_len, digest = _HEADER.unpack_from(view)
        if magic != _MAGIC or xxhash.xxh3_64_intdigest(view[_HEADER.size :]) != digest:
            raise PreppedBatchError(f"prepped batch {name} fails its checksum")
        meta = json.loads(bytes(view[_HEADER.size : _HEADER.size + meta_len]))
        body_at = _aligned(_HEADER.size + meta_len)
        arrays = []
        for field in meta["fields"]:
            dtype, shape = np.dtype(field["dtype"]), tuple(field["shape"])
            start = body_at + field["offset"]
            count = int(np.prod(shape, dtype=np.int64))
            arrays.append(np.frombuffer(view, dtype, count, start).reshape(shape).copy())
    finally:
        view.release()
    return tuple(arrays) if meta["tuple"] else arrays[0]


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN
