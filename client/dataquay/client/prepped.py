"""Prepped batches in shared memory: one segment per batch under /dev/shm.

A member of a prep group writes the arrays its prep made into a segment of its
own and names it to the daemon; every member copies the arrays out and the
daemon frees the segment once all have. The names
(``dataquay-prep-<daemon pid>-<writer pid>-<token>``) tie a segment to the
daemon that keeps its group, not to its writer, unlike the read segments of
:mod:`dataquay.client.wire.shm`: a batch stays usable after its writer died, and
the segments of a daemon that died are removed by the next one of the user
(:func:`remove_orphans`).

Layout: a fixed header (magic, JSON length, xxh3-64 of the JSON and the
fields' bytes), the JSON description of the fields (dtype, shape, offset),
then each field's bytes at a 64-byte aligned offset. A reader checks the
checksum before it hands anything out, so a segment that was cut short or
overwritten is refused, never turned into a wrong batch. Both sides use
``pwrite`` and ``preadv``, never a mapping: a full /dev/shm or a segment
truncated under a reader is then an error, not a SIGBUS (the daemon's
writes into read segments avoid mappings for the same reason).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from dataquay.client.errors import DataquayError
from dataquay.client.wire.shm import SHM_DIR, remove_orphaned

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
    ``daemon_pid``; its name and size in bytes.

    Raises:
        PreppedBatchError: /dev/shm has no room for it (or cannot be written).
    """
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
    digest = xxhash.xxh3_64(meta)
    for array in arrays:
        digest.update(_bytes_of(array))
    name = f"{PREFIX}{daemon_pid}-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PreppedBatchError(f"cannot create a prepped batch under {SHM_DIR}: {exc}") from exc
    try:
        os.posix_fallocate(fd, 0, size)  # no room is an error here, never a SIGBUS later
        _write_all(fd, _HEADER.pack(_MAGIC, len(meta), digest.intdigest()) + meta, 0)
        for array, at in zip(arrays, offsets):
            _write_all(fd, _bytes_of(array), body_at + at)
    except OSError as exc:
        os.unlink(SHM_DIR / name)
        raise PreppedBatchError(
            f"cannot write a prepped batch of {size} bytes under {SHM_DIR}: {exc}; a smaller memory_bytes leaves room"
        ) from exc
    finally:
        os.close(fd)
    return name, size


def read(name: str) -> Batch:
    """Copies the batch out of segment ``name`` (it may be freed right after).

    Reads with ``preadv`` straight into the arrays it returns: one copy, and
    no mapping that a segment truncated meanwhile could turn into a SIGBUS.

    Raises:
        PreppedBatchError: the segment is gone, or not a whole prepped batch.
    """
    if not NAME.match(name):
        raise PreppedBatchError(f"{name!r} is not a prepped batch's segment")
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise PreppedBatchError(f"prepped batch {name} cannot be read: {exc}") from exc
    try:
        magic, meta_len, digest = _HEADER.unpack(os.pread(fd, _HEADER.size, 0).ljust(_HEADER.size, b"\0"))
        meta_bytes = os.pread(fd, meta_len, _HEADER.size) if magic == _MAGIC else b""
        if len(meta_bytes) != meta_len or magic != _MAGIC:
            raise PreppedBatchError(f"prepped batch {name} is cut short or not one")
        meta = json.loads(meta_bytes)
        body_at = _aligned(_HEADER.size + meta_len)
        check = xxhash.xxh3_64(meta_bytes)
        arrays = []
        for field in meta["fields"]:
            array = np.empty(tuple(field["shape"]), np.dtype(field["dtype"]))
            _read_all(fd, _bytes_of(array), body_at + field["offset"])
            check.update(_bytes_of(array))
            arrays.append(array)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PreppedBatchError(f"prepped batch {name} cannot be read: {exc}") from exc
    finally:
        os.close(fd)
    if check.intdigest() != digest:
        raise PreppedBatchError(f"prepped batch {name} fails its checksum")
    return tuple(arrays) if meta["tuple"] else arrays[0]


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
    remove_orphaned(daemon_pid)


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a view into it (reads land in the array)."""
    return array.reshape(-1).view(np.uint8).data


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _read_all(fd: int, into: memoryview, offset: int) -> None:
    while into:
        done = os.preadv(fd, [into], offset)
        if done == 0:
            raise PreppedBatchError("a prepped batch is cut short")
        into, offset = into[done:], offset + done


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN
