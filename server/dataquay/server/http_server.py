"""The one HTTP server of the daemon's /metrics and the directory's /sd,
/metrics and /healthz: GET only, one answer per connection, on the event loop.

Not prometheus_client's ``start_http_server``: that serves each connection on
a thread for as long as the client keeps it open, so idle connections (a
slowloris) could each hold a thread forever. Here:

* a connection that sends no whole request head within
  :data:`IDLE_TIMEOUT_SECONDS`, or does not take its answer within as long,
  is closed;
* beyond :data:`MAX_CONNECTIONS` at once, new connections are closed
  unanswered; a scrape needs one, for well under a second;
* a request head over :data:`MAX_HEAD_BYTES` is answered 431 and closed once
  what the client still sends is read out (to a bound), so that closing does
  not reset the connection before the client reads the refusal.

Handlers run on the event loop and read its state directly, so no lock or
snapshot is needed; each answer is small and built in about a millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from dataquay.server.errors import StartupError

#: Largest request head accepted; the endpoints take no body.
MAX_HEAD_BYTES = 16 << 10
#: A connection silent this long (no request, or a stalled one), or not
#: taking its answer, is closed.
IDLE_TIMEOUT_SECONDS = 10.0
#: Connections served at once; more are closed unanswered.
MAX_CONNECTIONS = 16
#: What is read and dropped after refusing an oversized head.
LINGER_BYTES = 1 << 20
LINGER_SECONDS = 1.0

#: An answer: status, content type, body, and any more headers.
Answer = tuple[int, str, bytes, dict[str, str]]
#: Answers a GET of one path, given the request's headers (names in lower case).
Handler = Callable[[Mapping[str, str]], Answer]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def text(status: int, body: str) -> Answer:
    """A plain text answer."""
    return status, "text/plain", body.encode(), {}


def metrics_handler(registry: CollectorRegistry) -> Handler:
    """Answers a scrape of ``registry`` in the format and encoding Prometheus asks for."""

    def answer(headers: Mapping[str, str]) -> Answer:
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(registry)
        if "gzip" in headers.get("accept-encoding", ""):
            return 200, content_type, gzip.compress(body), {"Content-Encoding": "gzip"}
        return 200, content_type, body, {}

    return answer


class HttpServer:
    """Serves ``routes`` (path -> handler) on the running event loop.

    Args:
        routes: a handler per path; a query string is ignored.
        what: what is served, for the start-up error ("metrics").
    """

    def __init__(self, routes: Mapping[str, Handler], what: str) -> None:
        self._routes = {path.encode(): handler for path, handler in routes.items()}
        paths = list(routes)
        self._not_found = (
            "not found: try " + (f"{', '.join(paths[:-1])} or {paths[-1]}" if len(paths) > 1 else paths[0]) + "\n"
        )
        self._what = what
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port``; returns the port bound.

        Raises:
            StartupError: ``host:port`` cannot be bound.
        """
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        except OSError as exc:
            raise StartupError(f"cannot serve {self._what} on {host}:{port}: {exc.strerror or exc}") from exc
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stops listening and closes the connections being served, so that
        closing never waits out a silent client's idle timeout."""
        if self._server is not None:
            self._server.close()
            for writer in self._open:
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open.add(writer)
        try:
            await self._answer(reader, writer)
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            self._open.discard(writer)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT_SECONDS)
        except asyncio.LimitOverrunError:
            await _send(writer, text(431, f"request head over {MAX_HEAD_BYTES} bytes\n"))
            await _drop_rest(reader)
            return
        await _send(writer, self._route(head))

    def _route(self, head: bytes) -> Answer:
        line, _, rest = head.partition(b"\r\n")
        parts = line.split()
        if len(parts) != 3:
            return text(400, "bad request line\n")
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return text(405, "only GET\n")
        handler = self._routes.get(target)
        if handler is None:
            return text(404, self._not_found)
        return handler(_headers(rest))


def _headers(lines: bytes) -> dict[str, str]:
    """The request's headers, names in lower case; lines without a colon are skipped."""
    out = {}
    for line in lines.decode("latin-1").split("\r\n"):
        name, colon, value = line.partition(":")
        if colon:
            out[name.strip().lower()] = value.strip()
    return out


async def _send(writer: asyncio.StreamWriter, answer: Answer) -> None:
    status, content_type, body, more = answer
    headers = "".join(f"{name}: {value}\r\n" for name, value in more.items())
    writer.write(
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n{headers}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT_SECONDS)


async def _drop_rest(reader: asyncio.StreamReader) -> None:
    """Reads what the client still sends, up to a bound: closing a socket with
    unread input resets it, and the client would lose the answer."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            dropped = 0
            while dropped < LINGER_BYTES and (chunk := await reader.read(64 << 10)):
                dropped += len(chunk)
