"""Protobuf replies as plain JSON for ``--json``: every field present (zeros
too), 64-bit integers as numbers, enum values as lowercase words without
their type's prefix (``TIER_CACHE`` is ``"cache"``). protobuf's own JSON
mapping writes int64 as strings and leaves zeros out, which scripts that sum
or compare the figures then trip on."""

from __future__ import annotations

import re
from typing import Any

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message


def _enum_word(enum: EnumDescriptor, number: int) -> str | int:
    value = enum.values_by_number.get(number)
    if value is None:
        return number
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    name: str = value.name
    return (name[len(prefix) :] if name.startswith(prefix) else name).lower()


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return _enum_word(field.enum_type, value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


def plain(message: Message) -> dict[str, Any]:
    """``message`` as a dict of plain JSON values, keyed by the proto field names."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            value_field = entry.fields_by_name["value"]
            out[field.name] = {str(k): _value(value_field, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_value(field, item) for item in value]
        else:
            out[field.name] = _value(field, value)
    return out
