"""The directory's HTTP endpoints: Prometheus service discovery, its own
metrics, and a health probe.

* ``GET /sd``: the JSON that Prometheus' ``http_sd_configs`` reads, one target
  group per registered node's metrics endpoint, up or down::

      [{"targets": ["10.0.0.7:9470"],
        "labels": {"dataquay_node": "node7", "dataquay_state": "up"}}]

  ``dataquay_node`` and ``dataquay_state`` are ordinary labels, so Prometheus
  attaches them to every series scraped from that daemon and dashboards group
  by node with no relabeling rule (the daemon's own ``instance`` label is an
  address, which changes when a node is moved). A node whose lease ran out
  stays listed, with ``dataquay_state="down"``: Prometheus keeps scraping it,
  its ``up`` turns 0 and an alert can fire, where a target that vanished
  would only leave a stale series. A node comes back as ``"up"`` when it
  heartbeats again.
* ``GET /metrics``: Prometheus text of the directory itself.
* ``GET /healthz``: 200 while serving, 503 once shutdown began.

The handler runs on the server's event loop and reads its state directly, so
no lock or snapshot is needed; every answer is small and built in well under a
millisecond for a thousand nodes. Connections close after one answer; a
request head over 16 KiB is answered 431 and closed once read out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dataquay.server.directory.records import Node
from dataquay.server.errors import StartupError

#: Largest request head accepted; the endpoints take no body.
MAX_HEAD_BYTES = 16 << 10
#: Time a client gets to send its request head.
HEAD_TIMEOUT_SECONDS = 10.0
#: What is read and dropped after refusing an oversized head, so that closing
#: does not reset the connection before the client reads the refusal.
LINGER_BYTES = 1 << 20
LINGER_SECONDS = 1.0

_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 503: "Service Unavailable",
}


def sd_targets(nodes: list[Node]) -> list[dict[str, object]]:
    """The http_sd_configs document for ``nodes`` (every registered one)."""
    return [
        {
            "targets": [n.info.metrics_address],
            "labels": {"dataquay_node": n.info.name, "dataquay_state": "up" if n.up else "down"},
        }
        for n in nodes
        if n.info.metrics_address
    ]


class HttpEndpoints:
    """Serves /sd, /metrics and /healthz on the running event loop.

    Args:
        nodes: every registered node, read at each /sd request.
        metrics: the registry /metrics exports.
        serving: False once shutdown began (/healthz answers 503).
    """

    def __init__(
        self, nodes: Callable[[], list[Node]], metrics: CollectorRegistry, serving: Callable[[], bool]
    ) -> None:
        self._nodes = nodes
        self._metrics = metrics
        self._serving = serving
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port``; returns the port bound."""
        try:
            self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEAD_BYTES)
        except OSError as exc:
            raise StartupError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from exc
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_SECONDS)
            except asyncio.LimitOverrunError:
                await _send(writer, 431, "text/plain", f"request head over {MAX_HEAD_BYTES} bytes\n".encode())
                await _drop_rest(reader)
                return
            await _send(writer, *self._answer(head))
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            return 400, "text/plain", b"bad request line\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return 405, "text/plain", b"only GET\n"
        if target == b"/sd":
            return 200, "application/json", json.dumps(sd_targets(self._nodes())).encode()
        if target == b"/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._metrics)
        if target == b"/healthz":
            return (200, "text/plain", b"ok\n") if self._serving() else (503, "text/plain", b"stopping\n")
        return 404, "text/plain", b"not found: try /sd, /metrics or /healthz\n"


async def _send(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes) -> None:
    writer.write(
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )
    await writer.drain()


async def _drop_rest(reader: asyncio.StreamReader) -> None:
    """Reads what the client still sends, up to a bound: closing a socket with
    unread input resets it, and the client would lose the answer."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            dropped = 0
            while dropped < LINGER_BYTES and (chunk := await reader.read(64 << 10)):
                dropped += len(chunk)
