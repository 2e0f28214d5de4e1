"""Where the directory's state lives: the interface, and the embedded store (a state file).

The state machine (:mod:`.state`) is the same for every store; a store loads
it at start, writes what changed, and says whether this process does the
periodic work (job expiry). Two stores:

- embedded (the default): ``directory.json`` under the state dir, one
  directory process per cluster (this module);
- etcd (``--store etcd://HOST:PORT,...``): the records in etcd v3, shared by
  several directory processes serving at once (:mod:`.etcd_store`).

The embedded store writes the whole state (temporary file, fsync, then
rename, so a crash leaves the old or the new state, never half of one)
before the call that changed it returns. One background task writes: it
takes a snapshot on the loop (a copy of the job table and the nodes' fields)
and serialises and writes it in a thread, so that heartbeats are answered
while a large state is written; the calls that change the state while a
write runs share the next one, so a thousand daemons registering at once cost
tens of writes, not a thousand. Heartbeats are not written; a node that comes
back up by heartbeating is written at the next lease check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dataquay.server.config import DirectoryConfig
from dataquay.server.directory.state import DirectoryState, StateSnapshot
from dataquay.server.dirs import private_opener
from dataquay.server.errors import StartupError
from dataquay.server.registry import Registered
from dataquay.server.task_group import TaskGroup

log = logging.getLogger("dataquay.directory")

STATE_FILE = "directory.json"
#: How long a change waits for others to share its write.
GROUP_WRITE_SECONDS = 0.005


class DirectoryStore(Protocol):
    """What the directory server asks of the place its state lives."""

    #: Whether this process does the cluster's periodic work (job expiry).
    leader: bool

    async def open(self) -> DirectoryState:
        """The state to serve from; the registry under the state dir is loaded.

        Raises:
            StartupError: the stored state cannot be read or used.
        """

    def start(self, tasks: TaskGroup) -> None:
        """Starts the background work (writing, following other replicas)."""

    def changed(self) -> None:
        """Says the state may have changed: written at the next write."""

    async def persist(self) -> None:
        """Returns once the state as of now is stored.

        Raises:
            DirectoryUnavailableError: the store does not answer.
        """

    def renewed(self, name: str) -> None:
        """A heartbeat renewed the node's lease."""

    async def dataset_added(self, entry: Registered) -> None:
        """A dataset was registered (or replaced) here; its manifest is in the registry."""

    async def dataset_dropped(self, name: str) -> None:
        """A dataset was dropped here."""

    async def close(self) -> None:
        """Writes a last time and stops the background work's connections."""


class EmbeddedStore:
    """The state file under the state dir; see the module docstring."""

    def __init__(self, config: DirectoryConfig, state: Callable[[], DirectoryState]) -> None:
        self.config = config
        self.leader = True
        self._state = state
        #: The revision on disk; only the thread that writes moves it, under the lock.
        self._saved_revision = 0
        self._write_lock = threading.Lock()
        self._dirty = asyncio.Event()
        #: Resolved once a write that began after it was made is done.
        self._next_write: asyncio.Future[None] | None = None

    @property
    def state_path(self) -> Path:
        return Path(self.config.state_dir) / STATE_FILE

    async def open(self) -> DirectoryState:
        config = self.config
        fresh = DirectoryState(config.lease_seconds, config.heartbeat_seconds)
        try:
            doc = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return fresh
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read the directory's state {self.state_path}: {exc}") from exc
        try:
            return DirectoryState.from_json(
                doc, config.lease_seconds, time.monotonic(), config.heartbeat_seconds, wall=time.time()
            )
        except ValueError as exc:
            raise StartupError(
                f"cannot use the directory's state {self.state_path}: {exc}; move it away to start empty"
            ) from exc

    def start(self, tasks: TaskGroup) -> None:
        tasks.spawn(self._write_state(), "state-writer")

    def changed(self) -> None:
        if self._state().revision != self._saved_revision:
            self._dirty.set()

    def renewed(self, name: str) -> None:
        """Heartbeats are not written."""

    async def dataset_added(self, entry: Registered) -> None:
        await self.persist()

    async def dataset_dropped(self, name: str) -> None:
        await self.persist()

    async def persist(self) -> None:
        """Returns once the state as of now is on disk, sharing the write with
        every call that changes the state before the write begins."""
        if self._next_write is None:
            self._next_write = asyncio.get_running_loop().create_future()
        waiter = self._next_write
        self._dirty.set()
        await asyncio.shield(waiter)

    async def _write_state(self) -> None:
        """Writes the state whenever it changed, one write at a time, off the loop.

        The snapshot is taken right after the waiters are taken, with no await
        between, so that every waiter's change is in what is written.
        """
        loop = asyncio.get_running_loop()
        while True:
            await self._dirty.wait()
            await asyncio.sleep(GROUP_WRITE_SECONDS)
            self._dirty.clear()
            waiter, self._next_write = self._next_write, None
            try:
                await loop.run_in_executor(None, self._write, self._state().snapshot())
            finally:
                if waiter is not None:
                    waiter.set_result(None)

    def _write(self, snapshot: StateSnapshot) -> None:
        """Writes ``snapshot`` unless a newer one is on disk; runs in a thread.
        A failed write is logged and retried by the next lease check."""
        with self._write_lock:
            if snapshot.revision <= self._saved_revision:
                return
            tmp = self.state_path.with_suffix(".tmp")
            try:
                with open(tmp, "w", opener=private_opener) as out:
                    out.write(json.dumps(snapshot.to_json()))
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.state_path)
            except OSError as exc:
                log.error(
                    "cannot write the directory's state",
                    extra={"fields": {"path": str(self.state_path), "error": str(exc)}},
                )
                return
            self._saved_revision = snapshot.revision

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._write, self._state().snapshot())
