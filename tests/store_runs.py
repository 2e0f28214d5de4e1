"""Runs a test against a real store with its writer, outside any daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from dataquay.server.node.cache.store import Store


def with_store(path: Path, capacity: int, test: Callable[[Store], Awaitable[None]]) -> None:
    """Opens a store of ``capacity`` bytes at ``path`` with dataset "ds" and
    its writer running, awaits ``test(store)``, and closes it whatever happens."""

    async def run() -> None:
        store = Store(path, capacity)
        store.open()
        await store.open_dataset("ds")
        writer = asyncio.get_running_loop().create_task(store.run_writer())
        try:
            await test(store)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            store.close()

    asyncio.run(run())
