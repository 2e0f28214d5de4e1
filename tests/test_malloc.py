"""The allocator settings the daemon and training processes take: each
applies in a process of its own, and the environment can turn them off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TUNE = "from dataquay.client.malloc import tune_malloc; print(tune_malloc({}))"


def _tuned(arguments: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", TUNE.format(arguments)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_thresholds_and_one_arena_are_taken() -> None:
    assert _tuned("") == "True"
    assert _tuned("arenas=1") == "True"


def test_the_environment_leaves_the_allocator_alone() -> None:
    assert _tuned("arenas=1", DATAQUAY_TUNE_MALLOC="0") == "False"
