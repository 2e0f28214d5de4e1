"""Fixtures: real daemons in child processes, real files as the PFS."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dataquay.server.launch import DaemonProcess


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Starts daemons under tmp_path; every one is stopped after the test."""
    started: list[DaemonProcess] = []

    def start(*extra_args: str, name: str = "node0") -> DaemonProcess:
        daemon = DaemonProcess(tmp_path / name, tuple(extra_args)).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon()
