"""The event loop: uvloop where it is installed, plain asyncio otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for ``asyncio.Runner``; no global policy is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop
