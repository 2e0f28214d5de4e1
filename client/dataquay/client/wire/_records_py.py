"""The loops of ``_records.c`` in Python, for an install where the extension
could not be built (no C compiler): the same keys, values and errors, at
half to three quarters of the compiled rate (bench/record_loops.py)."""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer

_KEY = struct.Struct(">Q")
_CHECKSUM = struct.Struct("<Q")
_HEADER = _CHECKSUM.size
_digest = xxhash.xxh3_64_intdigest


def sample_keys(ids: Sequence[int], /) -> list[bytes]:
    """LMDB keys of a sequence of int ids.

    Raises:
        TypeError: an item is not an integer.
        OverflowError: an item is outside 0..2**64-1.
    """
    pack = _KEY.pack
    keys = []
    for item in ids:
        value = operator.index(item)
        if not 0 <= value < 1 << 64:
            raise OverflowError(f"sample id {value} is not in 0..2**64-1")
        keys.append(pack(value))
    return keys


def payload_copies(values: Sequence[Buffer | None], verify: bool, /) -> tuple[list[bytes | None], int, int]:
    """Payloads of cache values (None for a key not found), how many were
    absent and how many corrupt (shorter than the header, or with ``verify``
    a checksum that differs)."""
    out: list[bytes | None] = []
    absent = corrupt = 0
    for value in values:
        if value is None:
            absent += 1
            out.append(None)
            continue
        view = memoryview(value)
        payload = bytes(view[_HEADER:]) if len(view) >= _HEADER else None
        if payload is None or (verify and _CHECKSUM.unpack_from(view)[0] != _digest(payload)):
            corrupt += 1
            payload = None
        out.append(payload)
    return out, absent, corrupt


def encode_value(payload: Buffer, digest: int | None = None, /) -> bytes:
    """The cache value of a payload: its xxh3-64 (``digest``, when the caller
    has it) little-endian, then the payload."""
    data = bytes(payload)
    return (_digest(data) if digest is None else digest).to_bytes(_HEADER, "little") + data


def values_intact(values: Sequence[Buffer], /) -> list[bool]:
    """Whether each cache value's payload matches the xxh3 in its header (a
    value shorter than its header does not)."""
    views = [memoryview(value) for value in values]
    return [len(v) >= _HEADER and _CHECKSUM.unpack_from(v)[0] == _digest(v[_HEADER:]) for v in views]


def payloads_into(values: Sequence[Buffer], target: Buffer, offsets: Sequence[int], /) -> list[bool]:
    """Copies each cache value's payload into ``target`` at ``offsets[i]``:
    whether each is intact there (a value shorter than its header is not
    copied and is not).

    Raises:
        ValueError: a payload would end past ``target`` (nothing is copied).
        BufferError: ``target`` is read-only.
    """
    views = [memoryview(value) for value in values]
    into = memoryview(target).cast("B")
    if into.readonly:
        raise BufferError("Object is not writable.")
    if len(views) != len(offsets):
        raise ValueError(f"payloads_into(): {len(views)} values but {len(offsets)} offsets")
    for k, (view, offset) in enumerate(zip(views, offsets)):
        size = max(len(view) - _HEADER, 0)
        if not 0 <= offset <= len(into) - size:
            ends = f"payload {k} of {size} bytes at offset {offset} ends past the target's {len(into)} bytes"
            raise ValueError(f"payloads_into(): {ends}")
    intact = []
    for view, offset in zip(views, offsets):
        if len(view) < _HEADER:
            intact.append(False)
            continue
        copy = into[offset : offset + len(view) - _HEADER]
        copy[:] = view[_HEADER:]
        intact.append(_CHECKSUM.unpack_from(view)[0] == _digest(copy))
    return intact
