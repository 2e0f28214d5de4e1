"""Background tasks owned by one object and cancelled together at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("dataquay.tasks")

Spawn = Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]


class TaskGroup:
    """Like ``asyncio.TaskGroup`` for a server's lifetime: tasks are spawned from
    anywhere, a failing task is logged (not silently lost), and ``close()``
    cancels what is left and waits for it."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception(), extra={"fields": {"task": task.get_name()}})

    async def close(self, timeout: float = 5.0) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
