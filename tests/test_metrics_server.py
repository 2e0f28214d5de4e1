"""The HTTP server of the daemon's /metrics and the directory's endpoints holds
up against clients that connect and say nothing (idle connections are closed,
their number is bounded) and against oversized request heads (431, read out)."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from dataquay.server.http_server import MAX_CONNECTIONS, MAX_HEAD_BYTES
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess


def metrics_connections(daemon: DaemonProcess, count: int) -> list[socket.socket]:
    """``count`` TCP connections to the daemon's metrics port that send nothing."""
    assert daemon.ready is not None
    return [
        socket.create_connection((daemon.host, int(daemon.ready["metrics_port"])), timeout=60) for _ in range(count)
    ]


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


def assert_the_one_beyond_the_limit_closed(idle: list[socket.socket]) -> None:
    """The last of ``idle`` (one past the limit) closed at once, the first still open."""
    try:
        assert idle[-1].recv(1) == b""
        idle[0].setblocking(False)
        with pytest.raises(BlockingIOError):
            idle[0].recv(1)  # still open: its idle timeout has not run out
    finally:
        for connection in idle:
            connection.close()


def test_metrics_connections_beyond_the_limit_are_closed_at_once(daemon: DaemonProcess) -> None:
    assert_the_one_beyond_the_limit_closed(metrics_connections(daemon, MAX_CONNECTIONS + 1))


def test_daemon_answers_a_metrics_head_over_the_limit_with_431_and_serves_on(daemon: DaemonProcess) -> None:
    assert daemon.ready is not None
    port = int(daemon.ready["metrics_port"])
    # Under the 64 KiB line limit of http.server, over the 16 KiB head limit.
    head = b"GET /metrics HTTP/1.1\r\nX-Filler: " + b"y" * (MAX_HEAD_BYTES + 4096) + b"\r\n\r\n"
    with socket.create_connection((daemon.host, port), timeout=10) as connection:
        connection.sendall(head)
        answer = connection.recv(1024)
    assert answer.split()[1] == b"431"
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        assert response.status == 200


def test_directory_http_connections_beyond_the_limit_are_closed_at_once(directory: DirectoryProcess) -> None:
    port = int(directory.http_url.rpartition(":")[2])
    assert_the_one_beyond_the_limit_closed(
        [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(MAX_CONNECTIONS + 1)]
    )
