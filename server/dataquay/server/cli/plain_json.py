"""Protobuf replies as plain JSON for ``--json``: every field present (zeros
too), 64-bit integers as numbers, enum values as lowercase words without
their type's prefix (``TIER_CACHE`` is ``"cache"``), bytes as hex, an unset
optional setting as null. protobuf's own JSON mapping writes int64 as
strings and leaves zeros out, which scripts that sum or compare the figures
then trip on. :func:`schema` writes the same rules down, message by message,
for the reference page of ``status --json``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

_INTEGERS = frozenset(
    {
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _enum_word(enum: EnumDescriptor, number: int) -> str | int:
    """An enum value without the prefix all its type's values share
    (``TIER_CACHE`` is ``"cache"``, ``NODE_UP`` ``"up"``), lowercase."""
    value = enum.values_by_number.get(number)
    if value is None:
        return number
    words = [v.name.split("_") for v in enum.values]
    shared = 0
    while len(words) > 1 and all(len(w) > shared + 1 and w[shared] == words[0][shared] for w in words):
        shared += 1
    return "_".join(value.name.split("_")[shared:]).lower()


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
        elif _optional_scalar(field) and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def _optional_scalar(field: FieldDescriptor) -> bool:
    """A setting that may be unset (``optional``), told apart from its zero."""
    return field.has_presence and field.type != FieldDescriptor.TYPE_MESSAGE


def _type(field: FieldDescriptor) -> str:
    """A field's JSON type in words, as :func:`plain` writes it."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return f"object ([{field.message_type.name}](#{field.message_type.name.lower()}))"
    if field.type == FieldDescriptor.TYPE_ENUM:
        words = [_enum_word(field.enum_type, v.number) for v in field.enum_type.values]
        return "one of " + ", ".join(f'`"{w}"`' for w in words)
    if field.type in _INTEGERS:
        return "integer"
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return "number"
    if field.type == FieldDescriptor.TYPE_BOOL:
        return "boolean"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return "string (hex)"
    return "string"


def _field_type(field: FieldDescriptor) -> str:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
        return f"object: keys {_type(key)} as text, values {_type(value)}"
    if field.is_repeated:
        return f"array of {_type(field)}"
    return _type(field) + (", or null when unset" if _optional_scalar(field) else "")


def schema(*roots: Descriptor) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(message name, [(key, JSON type)]) for ``roots`` and every message
    they hold, each once, in the order first met."""
    seen: set[str] = set()
    queue = list(roots)
    while queue:
        message = queue.pop(0)
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        yield message.name, [(f.name, _field_type(f)) for f in message.fields]
        for f in message.fields:
            entry = f.message_type
            if entry is not None and entry.GetOptions().map_entry:
                entry = entry.fields_by_name["value"].message_type
            if entry is not None:
                queue.append(entry)
