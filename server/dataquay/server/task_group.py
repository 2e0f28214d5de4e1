"""Background work: tasks owned by one object and cancelled together at
shutdown, and the OS priority of background threads."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
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
        """Runs ``coro`` until it ends or the group closes; its failure is logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def spawn_awaited(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Like :meth:`spawn`, for a task whose result callers await: its failure
        is theirs to report, so it is not logged here too."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
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


#: Niceness of the cache writer: below request serving (0), above staging reads.
WRITER_NICENESS = 5
#: Niceness of staging reads. Reads from a warm cache or a fast PFS are pure
#: CPU and would outnumber the single writer they feed (eight threads to one);
#: reads from a slow PFS mostly wait and lose nothing by it.
STAGING_NICENESS = 19


def lower_thread_priority(niceness: int) -> None:
    """Thread initializer: lets request serving win the CPU over background work.

    Inserting costs more CPU than serving (about 0.5 GB/s per core in LMDB),
    so under load cache inserts and staging reads run when requests leave a
    core idle; their queues are bounded, and what the writer cannot take is
    read from the PFS again later.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except OSError:
        log.debug("cannot lower a background thread's priority")


def idle_thread_priority() -> None:
    """Thread initializer: the thread runs only on a core that nothing else wants.

    For caching behind the trainers (:mod:`dataquay.server.node.reads.behind`):
    the trainer already has the bytes, so caching them may wait as long as
    the node is busy; even at niceness 19 it would take a share of the CPU
    from the trainers. Linux's SCHED_IDLE; elsewhere the lowest niceness.
    """
    idle = getattr(os, "SCHED_IDLE", None)
    try:
        if idle is None:
            raise OSError("no SCHED_IDLE here")
        os.sched_setscheduler(threading.get_native_id(), idle, os.sched_param(0))
    except OSError:
        lower_thread_priority(STAGING_NICENESS)
