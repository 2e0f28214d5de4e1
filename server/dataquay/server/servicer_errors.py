"""How both servicers end a call on a domain error: with the status the
table of :mod:`dataquay.client.wire.status_codes` gives it.

Only the servicers use this module; everything below them raises the errors of
:mod:`dataquay.server.errors` and never sees a status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from dataquay.client.wire.status_codes import status_of
from dataquay.server.errors import DataquayError

#: Longest error message sent back: messages quote the caller's input, and
#: gRPC refuses a status whose details exceed its metadata limit (16 KiB).
MAX_DETAILS_CHARS = 2000


@asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Ends the call with the domain error's status code, its own message and its class's name."""
    try:
        yield
    except DataquayError as exc:
        message = str(exc)
        if len(message) > MAX_DETAILS_CHARS:
            message = message[: MAX_DETAILS_CHARS - 3] + "..."
        code, metadata = status_of(exc)
        await context.abort(code, message, trailing_metadata=metadata)
