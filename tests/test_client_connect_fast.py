"""connect() to a missing or refusing socket fails at once, naming the cause."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dataquay.client import DaemonUnavailableError, connect


def stale_socket(path: Path) -> None:
    """A dead daemon's socket: the file stays, nothing listens."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()


@pytest.mark.parametrize(
    ("leave", "cause"), [(lambda path: None, "no socket at"), (stale_socket, "connection refused at")]
)
def test_a_socket_nothing_answers_on_fails_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leave: Callable[[Path], None], cause: str
) -> None:
    monkeypatch.delenv("DATAQUAY_DIRECTORY", raising=False)
    path = tmp_path / "dataquay.sock"
    leave(path)
    start = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=f"{cause} {path}"):
        connect(str(path), timeout=10.0)
    assert time.monotonic() - start < 3.0


def test_slow_daemon_keeps_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAQUAY_DIRECTORY", raising=False)
    path = tmp_path / "slow.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    threading.Timer(0.3, lambda: (listener.bind(str(path)), listener.listen(8))).start()
    start = time.monotonic()
    try:
        with pytest.raises(DaemonUnavailableError):
            connect(str(path), timeout=3.0)
    finally:
        listener.close()
    assert time.monotonic() - start >= 2.5
