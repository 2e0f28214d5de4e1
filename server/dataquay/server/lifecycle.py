"""What the daemon and the directory share as servers (after dask's Server):
``async with`` starts and closes, signals only set a flag, and a ready file
tells a launcher what was bound once serving starts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from types import TracebackType
from typing import Any, Self


class ServerLifecycle:
    """Base of a server with idempotent ``start()`` and staged ``close()``.

    Subclasses implement both; ``serve_until_stopped`` waits for SIGTERM or
    SIGINT (or :meth:`request_stop`), after which the owner calls ``close()``.
    """

    log: logging.Logger

    def __init__(self) -> None:
        self._stop_requested = asyncio.Event()

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self, grace: float = 10.0) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def request_stop(self) -> None:
        """Asks ``serve_until_stopped`` to return; safe from a signal handler."""
        self._stop_requested.set()

    async def serve_until_stopped(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self._stop_requested.wait()
        self.log.info("stopping")


def write_ready_file(path: Path | None, fields: dict[str, Any]) -> None:
    """Writes ``fields`` as JSON to ``path`` (if given), atomically: a launcher
    polling for the file never reads half of it."""
    if path is None:
        return
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(fields))
    os.replace(tmp, path)
