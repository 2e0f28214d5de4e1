"""Domain errors <-> gRPC status codes: the one table every hop reads, both ways.

A servicer ends a call on a domain error with the error's status code and
message, and names the error's class in the trailing metadata. Whoever gets
the status back (the client, the CLI, a daemon relaying the directory's
answer) raises the same class with the same message again, so an error keeps
its class over any number of hops. The codes are what any gRPC caller sees;
the class name is what tells apart the errors that share one (an unknown job
from an unknown dataset).

A status that names no class (from an interceptor, a limit, or a stand-in in
a test) stands for the most general class listed for its code.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from dataquay.client.errors import (
    BatchTooLargeError,
    CacheFullError,
    CacheQuotaError,
    DataquayError,
    DatasetExistsError,
    DatasetReplacedError,
    DirectoryUnavailableError,
    EpochTooFarError,
    ExchangeRefusedError,
    InvalidRequestError,
    JobActiveError,
    JobMismatchError,
    ManifestError,
    NodeNameTakenError,
    NoLiveNodesError,
    PfsReadError,
    RootNotAllowedError,
    SampleIdError,
    SampleTooLargeError,
    StandaloneError,
    UnknownDatasetError,
    UnknownJobError,
    UserNotAllowedError,
)

#: Each error a call can end with and its status code. An error takes the
#: first row it is an instance of, so subclasses come before their bases;
#: within a code, the most general class comes last.
ERROR_CODES: tuple[tuple[type[DataquayError], grpc.StatusCode], ...] = (
    (UnknownJobError, grpc.StatusCode.NOT_FOUND),
    (UnknownDatasetError, grpc.StatusCode.NOT_FOUND),
    (SampleIdError, grpc.StatusCode.INVALID_ARGUMENT),
    (BatchTooLargeError, grpc.StatusCode.INVALID_ARGUMENT),
    (SampleTooLargeError, grpc.StatusCode.INVALID_ARGUMENT),
    (ManifestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EpochTooFarError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NodeNameTakenError, grpc.StatusCode.ALREADY_EXISTS),
    (DatasetExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (RootNotAllowedError, grpc.StatusCode.PERMISSION_DENIED),
    (UserNotAllowedError, grpc.StatusCode.PERMISSION_DENIED),
    (PfsReadError, grpc.StatusCode.DATA_LOSS),
    (DirectoryUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (CacheFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CacheQuotaError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # A state the caller must change first: a job's settings differ, a job
    # active again, no live nodes, no directory, a replaced dataset, an
    # exchange out of turn.
    (JobMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (JobActiveError, grpc.StatusCode.FAILED_PRECONDITION),
    (NoLiveNodesError, grpc.StatusCode.FAILED_PRECONDITION),
    (DatasetReplacedError, grpc.StatusCode.FAILED_PRECONDITION),
    (ExchangeRefusedError, grpc.StatusCode.FAILED_PRECONDITION),
    (StandaloneError, grpc.StatusCode.FAILED_PRECONDITION),
    (DataquayError, grpc.StatusCode.FAILED_PRECONDITION),
)

#: Codes that say the other side did not answer (down, or too slow), not what it refused.
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

#: Trailing metadata key that carries the error's class name.
ERROR_KEY = "dataquay-error"

_BY_NAME = {kind.__name__: kind for kind, _ in ERROR_CODES}
# gRPC itself ends calls with RESOURCE_EXHAUSTED (message size, concurrency
# limits): only a status that names CacheFullError is one.
_BARE = {code: kind for kind, code in ERROR_CODES if code != grpc.StatusCode.RESOURCE_EXHAUSTED}


def status_of(error: DataquayError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code ``error`` ends a call with, and the trailing metadata naming its class."""
    kind, code = next((kind, code) for kind, code in ERROR_CODES if isinstance(error, kind))
    return code, ((ERROR_KEY, kind.__name__),)


def error_from_rpc(
    exc: grpc.RpcError, expected: Mapping[grpc.StatusCode, type[DataquayError]] | None = None
) -> DataquayError | None:
    """The domain error a failed call ended with, with the servicer's message.

    Args:
        exc: the failed call.
        expected: what a status that names no class means for this call, by
            code, where the table's general class would say less (NOT_FOUND
            of a job rather than of a dataset).

    Returns:
        The error the status names; else ``expected``'s or the table's class
        for its code; None for a code no domain error has (a transport
        failure, a refused token, a limit, a bug), which each hop words itself.
    """
    return error_from_status(exc.code(), exc.details() or "", _named(exc), expected)


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    name: str = "",
    expected: Mapping[grpc.StatusCode, type[DataquayError]] | None = None,
) -> DataquayError | None:
    """As :func:`error_from_rpc`, for a status given apart (a reply framed
    outside gRPC): its code, message and the class name it names, if any."""
    kind = _BY_NAME.get(name) or (expected or {}).get(code) or _BARE.get(code)
    return kind(details or code.name) if kind is not None else None


#: Each status code by the number it has on the wire.
CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def code_number(code: grpc.StatusCode) -> int:
    """The number ``code`` has on the wire, for replies framed outside gRPC (the bulk and segment sockets)."""
    return int(code.value[0])


def code_of_number(number: int) -> grpc.StatusCode:
    """The status code a number off the wire stands for; UNKNOWN for one gRPC has no code for."""
    return CODES_BY_VALUE.get(number, grpc.StatusCode.UNKNOWN)


def _named(exc: grpc.RpcError) -> str:
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if trailing is not None else None) or ():
        if key == ERROR_KEY:
            return str(value)
    return ""
