"""The wide-job benchmark's own run, small: a job over many nodes, all but
two lost, is read whole from those two daemons' caches (local and peer
hits), each call measured beside a two-node job's."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import wide_job

    monkeypatch.setattr(wide_job, "ROUNDS", 1)
    monkeypatch.setattr(wide_job, "PASSES", 8)  # enough calls to span CPU clock ticks
    yield wide_job
    sys.modules.pop("wide_job", None)


@pytest.mark.long
def test_a_job_whose_other_nodes_are_lost_reads_every_sample_from_the_two_caches(
    bench: ModuleType, tmp_path: Path
) -> None:
    rows = bench.run(tmp_path, 16)  # it asserts that every read was a hit, about half from the peer
    by = {r["job"]: r for r in rows}
    assert (by["pair"]["nodes"], by["wide"]["nodes"]) == (2, 16)
    assert by["pair"]["calls"] == by["wide"]["calls"] == 8 * bench.SAMPLES // bench.BATCH
    assert by["pair"]["ratio"] == 1.0
