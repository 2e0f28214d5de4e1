"""A Unix clock the tests step in a server process: libfaketime preloaded,
reading an offset file at every clock call; the monotonic clock is left
alone, as a real NTP step leaves it."""

from __future__ import annotations

from pathlib import Path

import pytest

_LIBFAKETIME = next(
    (
        p
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/faketime/libfaketime.so.1"),
            Path("/usr/local/lib/faketime/libfaketime.so.1"),
        )
        if p.exists()
    ),
    None,
)
needs_faketime = pytest.mark.skipif(
    _LIBFAKETIME is None, reason="libfaketime is not installed (apt-get install faketime; `make tools` does)"
)


class SteppedClock:
    """The offset file libfaketime reads at every clock call of the process it is preloaded in."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.step(0)

    def step(self, seconds: int) -> None:
        """Sets the process's Unix time to the real one plus ``seconds``."""
        partial = self.path.with_suffix(".tmp")
        partial.write_text(f"{seconds:+d}\n")
        partial.replace(self.path)

    def prefix(self) -> tuple[str, ...]:
        """What a server's command line runs under to take this clock."""
        return (
            "env",
            f"LD_PRELOAD={_LIBFAKETIME}",
            f"FAKETIME_TIMESTAMP_FILE={self.path}",
            "FAKETIME_NO_CACHE=1",
            "FAKETIME_DONT_FAKE_MONOTONIC=1",
        )
