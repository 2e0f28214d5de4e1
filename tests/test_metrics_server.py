"""The daemon's /metrics server holds up against clients that connect and say
nothing: idle connections are closed and their number is bounded."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from dataquay.server.node.metrics import MAX_CONNECTIONS
from dataquay.server.tools.processes import DaemonProcess


def metrics_connections(daemon: DaemonProcess, count: int) -> list[socket.socket]:
    """``count`` TCP connections to the daemon's metrics port that send nothing."""
    assert daemon.ready is not None
    return [socket.create_connection((daemon.host, int(daemon.ready["metrics_port"])), timeout=60)
            for _ in range(count)]


def test_idle_metrics_connections_are_closed_and_scrapes_go_on_meanwhile(daemon: DaemonProcess) -> None:
    idle = metrics_connections(daemon, MAX_CONNECTIONS // 2)
    try:
        with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
            assert response.status == 200 and b"dataquay_cache_entries" in response.read()
        for connection in idle:
            assert connection.recv(1) == b""  # closed by the daemon; never closed, recv times out
    finally:
        for connection in idle:
            connection.close()


def test_metrics_connections_beyond_the_limit_are_closed_at_once(daemon: DaemonProcess) -> None:
    idle = metrics_connections(daemon, MAX_CONNECTIONS + 1)
    try:
        assert idle[-1].recv(1) == b""
        idle[0].setblocking(False)
        with pytest.raises(BlockingIOError):
            idle[0].recv(1)  # still open: its idle timeout has not run out
    finally:
        for connection in idle:
            connection.close()
