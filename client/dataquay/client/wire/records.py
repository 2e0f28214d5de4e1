"""Byte layouts shared by the daemon, its peers and the client.

Cache value (one LMDB value per sample)::

    [xxh3-64 of payload, 8 bytes little-endian][payload]

Cache key: the sample id as 8 bytes big-endian, so LMDB's key order is id order
and staging in id order appends.

Grouped tar sample (all members of one shard that share a basename, stored as
one value)::

    b"DQS1" [u32 count] then per member: [u16 len][name utf-8][u64 len][data]

All integers little-endian. ``name`` is the member's extension (``"jpg"``,
``"cls"``), as WebDataset keys them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import xxhash

from dataquay.client.wire import record_loops

CHECKSUM_BYTES = 8
_CHECKSUM = struct.Struct("<Q")
_GROUP_MAGIC = b"DQS1"
_GROUP_COUNT = struct.Struct("<I")
_NAME_LEN = struct.Struct("<H")
_DATA_LEN = struct.Struct("<Q")

checksum = xxhash.xxh3_64_intdigest


def sample_key(sample_id: int) -> bytes:
    """LMDB key of a sample id."""
    return sample_id.to_bytes(8, "big")


def encode_value(payload: bytes | memoryview, digest: int | None = None) -> bytes:
    """Cache value for ``payload``: its checksum (``digest`` if known), then the bytes.

    Large payloads are copied and hashed without the GIL.
    """
    return record_loops.encode_value(payload, digest)


def stored_checksum(value: bytes | memoryview) -> int:
    """The checksum a cache value carries in its header."""
    return int(_CHECKSUM.unpack_from(value)[0])


def decode_value(value: bytes | memoryview, verify: bool = True) -> memoryview | None:
    """Payload of a cache value, or None when ``verify`` finds it corrupt."""
    view = memoryview(value)
    payload = view[CHECKSUM_BYTES:]
    if verify and (len(view) < CHECKSUM_BYTES or _CHECKSUM.unpack_from(view)[0] != checksum(payload)):
        return None
    return payload


def frame_members(members: Iterable[tuple[str, bytes | memoryview]]) -> bytes:
    """One value holding several named members (a grouped tar sample)."""
    members = list(members)
    parts: list[bytes | memoryview] = [_GROUP_MAGIC, _GROUP_COUNT.pack(len(members))]
    for name, data in members:
        raw = name.encode()
        parts += [_NAME_LEN.pack(len(raw)), raw, _DATA_LEN.pack(len(data)), data]
    return b"".join(parts)


def unframe_members(value: bytes | memoryview) -> dict[str, memoryview]:
    """Members of a grouped sample by name; the inverse of :func:`frame_members`."""
    view = memoryview(value)
    if bytes(view[:4]) != _GROUP_MAGIC:
        raise ValueError("not a grouped sample (missing DQS1 header)")
    (count,) = _GROUP_COUNT.unpack_from(view, 4)
    pos = 8
    out: dict[str, memoryview] = {}
    for _ in range(count):
        (name_len,) = _NAME_LEN.unpack_from(view, pos)
        pos += _NAME_LEN.size
        name = bytes(view[pos : pos + name_len]).decode()
        pos += name_len
        (data_len,) = _DATA_LEN.unpack_from(view, pos)
        pos += _DATA_LEN.size
        if pos + data_len > len(view):
            raise ValueError(f"grouped sample truncated in member {name!r}")
        out[name] = view[pos : pos + data_len]
        pos += data_len
    return out
