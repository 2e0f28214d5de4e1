"""The event loop: uvloop where it is installed, plain asyncio otherwise;
and how the loop shares the GIL with the daemon's data threads."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

#: How long a thread may run Python while another waits for the GIL
#: (CPython's default is 5 ms). The daemon's data threads (the bulk path's,
#: the LMDB writer) let go of the GIL around every LMDB call and socket call,
#: 74 times for an 8 MiB exchange chunk of 110 KiB samples; each time, taking
#: it back could wait out the whole interval behind the event loop's Python.
GIL_SWITCH_SECONDS = 0.001


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for ``asyncio.Runner``; no global policy is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def share_gil() -> None:
    """Shortens the GIL's switch interval to :data:`GIL_SWITCH_SECONDS` for this process."""
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
