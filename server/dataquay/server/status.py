"""Domain errors as gRPC status codes: the one table both services answer with.

Only the servicers use this module; everything below them raises the errors of
:mod:`dataquay.server.errors` and never sees a status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from dataquay.server.errors import (
    BatchTooLargeError,
    DataquayError,
    DatasetExistsError,
    DirectoryUnavailableError,
    InvalidRequestError,
    ManifestError,
    PfsReadError,
    SampleIdError,
    UnknownDatasetError,
    UnknownJobError,
)

_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (UnknownDatasetError, grpc.StatusCode.NOT_FOUND),
    (UnknownJobError, grpc.StatusCode.NOT_FOUND),
    (SampleIdError, grpc.StatusCode.INVALID_ARGUMENT),
    (BatchTooLargeError, grpc.StatusCode.INVALID_ARGUMENT),
    (ManifestError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DatasetExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (PfsReadError, grpc.StatusCode.DATA_LOSS),
    (DirectoryUnavailableError, grpc.StatusCode.UNAVAILABLE),
    # Everything else (a job's settings differ, no live nodes, no directory,
    # a replaced dataset) is a state the caller must change first.
    (DataquayError, grpc.StatusCode.FAILED_PRECONDITION),
)

#: Longest error message sent back: messages quote the caller's input, and
#: gRPC refuses a status whose details exceed its metadata limit (16 KiB).
MAX_DETAILS_CHARS = 2000


def status_for(exc: Exception) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


@asynccontextmanager
async def status_on_error(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Ends the call with the domain error's status code and its own message."""
    try:
        yield
    except DataquayError as exc:
        message = str(exc)
        if len(message) > MAX_DETAILS_CHARS:
            message = message[: MAX_DETAILS_CHARS - 3] + "..."
        await context.abort(status_for(exc), message)
