"""A directory.json damaged by hand or by a tool: the directory refuses to
start with one line naming the file, the field and what it should be, and
leaves the file as it was; an undamaged file still loads.

The attack is the file itself, written with values JSON allows and the
records do not (a string for a count, a list for an object, null, a
negative epoch, a missing key), and the real directory started on it.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dataquay.client.job_settings import JobSettings
from dataquay.server.directory.records import DatasetFacts, JoinRequest, NodeInfo
from dataquay.server.directory.state import DirectoryState, identity_of

LEASE = 10.0


def good_document() -> dict[str, Any]:
    """What a directory with one node (with an identity) and one job writes."""
    state = DirectoryState(LEASE)
    state.register(NodeInfo("n0", "10.0.0.1:7070", "10.0.0.1:9470", 1 << 30, 42, "1.0"), 1.0, identity_of(b"k" * 32))
    request = JoinRequest(JobSettings("j1", "imgs", mode="partial", q=0.5), frozenset({"dataset", "mode", "q"}))
    state.join(request, lambda name: DatasetFacts("m1", 100), now=2.0)
    state.report_epoch("j1", 3, now=3.0)
    return json.loads(json.dumps(state.to_json()))


def setting(path: str, value: object) -> Callable[[Any], Any]:
    """A corruption: the field at ``path`` (dots; list indexes as numbers) set to ``value``."""

    def corrupt(doc: Any) -> Any:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for key in parents:
            doc = doc[key]
        doc[last] = value

    return corrupt


def dropping(path: str) -> Callable[[Any], Any]:
    def corrupt(doc: Any) -> Any:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for key in parents:
            doc = doc[key]
        del doc[last]

    return corrupt


CORRUPTIONS: list[tuple[str, Callable[[Any], Any] | object, str]] = [
    ("string for a number", setting("jobs.0.epoch", "7"), 'jobs[0].epoch is "7", expected an integer >= 0'),
    (
        "string for a count",
        setting("nodes.0.info.cache_capacity", "1G"),
        'nodes[0].info.cache_capacity is "1G", expected an integer >= 0',
    ),
    ("list for an object", setting("nodes.0.info", []), "nodes[0].info is [], expected an object"),
    ("object for a list", setting("nodes", {}), "nodes is {}, expected a list"),
    ("null record", setting("versions", None), "versions is null, expected an object"),
    ("null time", setting("jobs.0.last_active", None), "jobs[0].last_active is null, expected a number"),
    (
        "not a finite time",
        setting("nodes.0.registered", math.inf),
        "nodes[0].registered is Infinity, expected a number",
    ),
    ("negative epoch", setting("jobs.0.epoch", -1), "jobs[0].epoch is -1, expected an integer >= 0"),
    ("negative version", setting("versions.jobs", -3), "versions.jobs is -3, expected an integer >= 0"),
    (
        "fraction for a count",
        setting("jobs.0.num_samples", 2.5),
        "jobs[0].num_samples is 2.5, expected an integer >= 0",
    ),
    (
        "beyond 64 bits",
        setting("nodes.0.session", 1 << 64),
        "nodes[0].session is 18446744073709551616, expected an integer below 2^64",
    ),
    ("bool as a string", setting("nodes.0.up", "yes"), 'nodes[0].up is "yes", expected true or false'),
    (
        "string for a node list",
        setting("jobs.0.spec.nodes", "n0"),
        'jobs[0].spec.nodes is "n0", expected a list of strings',
    ),
    ("a setting no job can have", setting("jobs.0.spec.mode", "bogus"), "jobs[0].spec: mode must be one of"),
    ("missing required key", dropping("nodes.0.info.tcp_address"), "nodes[0].info.tcp_address is missing"),
    ("missing record list", dropping("jobs"), "jobs is missing"),
    ("unknown field", setting("jobs.0.colour", "red"), "jobs[0].colour is not a field of Job"),
    ("format as a string", setting("format", "1"), 'format is "1", expected 1'),
    ("top level a list", [1, 2], "the document is [1, 2], expected an object"),
    ("top level a string", "directory", 'the document is "directory", expected an object'),
    ("top level null", None, "the document is null, expected an object"),
]


def corrupted(corruption: Callable[[Any], Any] | object) -> object:
    if not callable(corruption):
        return corruption
    doc = copy.deepcopy(good_document())
    corruption(doc)
    return doc


@pytest.mark.parametrize(("corruption", "message"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_a_damaged_state_document_is_refused_naming_the_field(corruption: object, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        DirectoryState.from_json(corrupted(corruption), LEASE, now=100.0)  # type: ignore[arg-type]
    assert str(refused.value).startswith(message), str(refused.value)


def test_the_good_document_loads_and_one_without_a_records_field_is_refused_naming_it() -> None:
    doc = good_document()
    restored = DirectoryState.from_json(doc, LEASE, now=100.0)
    assert restored.to_json()["nodes"] == doc["nodes"] and restored.get_job("j1").epoch == 3
    for records, name in [
        ("nodes", "beat_sequence"),
        ("nodes", "identity"),
        ("nodes", "session"),
        ("jobs", "started"),
        ("jobs", "last_active"),
    ]:
        damaged = good_document()
        del damaged[records][0][name]
        with pytest.raises(ValueError, match=rf"^{records}\[0\]\.{name} is missing$"):
            DirectoryState.from_json(damaged, LEASE, now=100.0)


def start_directory_on(state_dir: Path) -> subprocess.CompletedProcess[str]:
    """Runs `dataquay directory` on ``state_dir`` as an operator would; one
    that starts is stopped by the timeout, and the test fails."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "directory",
            "--state-dir",
            str(state_dir),
            "--listen",
            "127.0.0.1:0",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("corruption", "message"),
    [
        c[1:]
        for c in CORRUPTIONS
        if c[0]
        in (
            "string for a number",
            "list for an object",
            "null record",
            "negative epoch",
            "missing required key",
            "top level a list",
        )
    ],
    ids=[
        "string for a number",
        "list for an object",
        "null record",
        "negative epoch",
        "missing required key",
        "top level a list",
    ],
)
def test_the_directory_refuses_to_start_on_a_damaged_state_file_and_leaves_it_as_it_was(
    tmp_path: Path, corruption: object, message: str
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o750)
    path = state_dir / "directory.json"
    path.write_text(json.dumps(corrupted(corruption)))
    before = path.read_bytes()
    run = start_directory_on(state_dir)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"dataquay: error: cannot use the directory's state {path}: {message}; move it away to start empty"
    ]
    assert path.read_bytes() == before and not path.with_suffix(".tmp").exists()
