"""The directory's state document checked field by field before any record
is built from it.

A state file edited by hand, or written by a buggy tool, holds what JSON
allows: a string where a count belongs, a list for an object, null. Built
into records as it is, such a value fails later, in some call, as a
TypeError far from its cause; checked here, the directory refuses to start
with the field's path and what it should be, and leaves the file as it is.

The expected type of each field is read from the record's own annotations
(:mod:`.records`, :class:`~dataquay.client.job_settings.JobSettings`), so a
field added to a record is checked without a change here. A field without a
default is required; one with a default may be missing (documents of older
versions lack it). Integers are counts, ids or epochs: none is negative.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from dataquay.client.job_settings import JobSettings
from dataquay.server.directory.records import Job, Node, Versions
from dataquay.server.errors import StateFileError

#: Characters of a bad value that a message shows.
SHOWN_CHARS = 40
#: The largest integer a field holds: each goes into an unsigned 64-bit protobuf field.
MAX_INT = 2**64 - 1


def check_state(doc: object, state_format: int) -> None:
    """Refuses a document :meth:`~.state.DirectoryState.from_json` could not
    build a working state from.

    Raises:
        StateFileError: the first bad field: its path (``jobs[0].epoch``), its
            value and what was expected.
    """
    if not isinstance(doc, dict):
        raise StateFileError(f"the document is {_shown(doc)}, expected an object")
    for key in ("format", "versions", "nodes", "jobs"):
        if key not in doc:
            raise StateFileError(f"{key} is missing")
    if type(doc["format"]) is not int or doc["format"] != state_format:
        raise StateFileError(f"format is {_shown(doc['format'])}, expected {state_format}")
    _record(doc["versions"], Versions, "versions")
    for key, record in (("nodes", Node), ("jobs", Job)):
        items = doc[key]
        if not isinstance(items, list):
            raise StateFileError(f"{key} is {_shown(items)}, expected a list")
        for index, item in enumerate(items):
            _record(item, record, f"{key}[{index}]")
    for index, job in enumerate(doc["jobs"]):
        try:
            JobSettings(**job["spec"]).check()
        except ValueError as exc:
            raise StateFileError(f"jobs[{index}].spec: {exc}") from None


def _record(value: object, record: type, path: str) -> None:
    """Checks ``value`` as the JSON object of a ``record`` dataclass."""
    if not isinstance(value, dict):
        raise StateFileError(f"{path} is {_shown(value)}, expected an object")
    types = typing.get_type_hints(record)
    names = {f.name for f in fields(record)}
    for key in value:
        if key not in names:
            raise StateFileError(f"{path}.{key} is not a field of {record.__name__}")
    for f in fields(record):
        if f.name in value:
            _value(value[f.name], types[f.name], f"{path}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise StateFileError(f"{path}.{f.name} is missing")


def _value(value: object, expected: Any, path: str) -> None:
    """Checks ``value`` as a field annotated ``expected``; a type this module
    does not know is left to the record's constructor."""
    if isinstance(expected, type) and is_dataclass(expected):
        _record(value, expected, path)
    elif expected is bool:
        _expect(type(value) is bool, value, "true or false", path)
    elif expected is int:
        _expect(type(value) is int and value >= 0, value, "an integer >= 0", path)
        _expect(typing.cast(int, value) <= MAX_INT, value, "an integer below 2^64", path)
    elif expected is float:
        finite = type(value) is int or (isinstance(value, float) and math.isfinite(value))
        _expect(finite, value, "a number", path)
    elif expected is str:
        _expect(isinstance(value, str), value, "a string", path)
    elif typing.get_origin(expected) is tuple:
        item = typing.get_args(expected)[0]
        if isinstance(item, type) and is_dataclass(item):
            _expect(isinstance(value, list), value, "a list", path)
            for index, record in enumerate(typing.cast(list[object], value)):
                _record(record, item, f"{path}[{index}]")
        else:
            _expect(
                isinstance(value, list) and all(isinstance(v, str) for v in value), value, "a list of strings", path
            )


def _expect(ok: bool, value: object, what: str, path: str) -> None:
    if not ok:
        raise StateFileError(f"{path} is {_shown(value)}, expected {what}")


def _shown(value: object) -> str:
    """``value`` as JSON, cut to :data:`SHOWN_CHARS`: a message stays one short line."""
    text = json.dumps(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
