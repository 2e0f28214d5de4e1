"""A thread pool whose threads never hold up the process's exit."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonThreadPool(Executor):
    """A fixed pool of daemon threads that shutdown never joins unless asked.

    ``ThreadPoolExecutor`` joins its threads at interpreter exit whatever
    ``shutdown`` was told, so one thread stuck in a PFS read would hold the
    daemon's exit forever; these threads simply end with the process.
    """

    def __init__(
        self, threads: int, name: str, initializer: Callable[..., object] | None = None, initargs: tuple[Any, ...] = ()
    ) -> None:
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._initializer, self._initargs = initializer, initargs
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer(*self._initargs)
        while (item := self._work.get()) is not None:
            future, call = item
            del item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the waiter
                future.set_exception(exc)
            del future, call
