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
