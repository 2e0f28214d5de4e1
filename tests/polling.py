"""Waiting for a condition instead of for the clock.

A test that sleeps a fixed time and then asserts on progress passes or fails
with the machine's load. Tests here wait for the state they mean, with a
timeout generous enough that it only runs out when the state never comes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Long enough for a loaded 2-core machine, short of pytest's per-test timeout.
TIMEOUT_SECONDS = 60.0


def wait_until(
    condition: Callable[[], object], what: str, timeout: float = TIMEOUT_SECONDS, poll: float = 0.05
) -> float:
    """Calls ``condition`` every ``poll`` seconds until it returns something
    true; returns the seconds that took (recovery times are reported from it).

    Raises:
        AssertionError: ``what`` did not happen within ``timeout`` seconds.
    """
    started = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - started
        assert elapsed < timeout, f"{what}: not so after {timeout:.0f} s"
        time.sleep(poll)
    return time.monotonic() - started
