"""connect() to a missing or refusing socket fails at once, naming the cause."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from dataquay.client import DaemonUnavailableError, connect


def test_missing_socket_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAQUAY_DIRECTORY", raising=False)
    path = tmp_path / "missing.sock"
    start = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=f"no socket at {path}"):
        connect(str(path), timeout=10.0)
    assert time.monotonic() - start < 3.0


def test_refused_socket_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATAQUAY_DIRECTORY", raising=False)
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nothing listens: a dead daemon's socket
    start = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match=f"connection refused at {path}"):
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
