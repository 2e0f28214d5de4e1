"""Errors of the daemon and its CLI, rooted in :class:`DataquayError`.

Every error a call can end with is defined in the client's errors module, so
that the client, the CLI and a daemon relaying the directory's answer all raise
the class the servicer raised (see :mod:`dataquay.client.wire.status_codes`); they
are re-exported here. Only errors that never cross the wire are defined here.
"""

from __future__ import annotations

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

__all__ = [
    "BatchTooLargeError",
    "CacheFullError",
    "CacheQuotaError",
    "CacheWriterError",
    "ConfigError",
    "DataquayError",
    "DatasetExistsError",
    "DatasetReplacedError",
    "DirectoryUnavailableError",
    "EpochTooFarError",
    "ExchangeRefusedError",
    "InvalidRequestError",
    "JobActiveError",
    "JobMismatchError",
    "ManifestError",
    "NoLiveNodesError",
    "NodeNameTakenError",
    "PfsReadError",
    "RootNotAllowedError",
    "SampleIdError",
    "SampleTooLargeError",
    "StandaloneError",
    "StartupError",
    "StateFileError",
    "UnknownCallerError",
    "UnknownDatasetError",
    "UnknownJobError",
    "UserNotAllowedError",
]


class ConfigError(DataquayError, ValueError):
    """A flag, environment variable or config value that cannot be used."""


class UnknownCallerError(DataquayError):
    """A call on the unix socket of a daemon that keeps its users apart that
    carries no valid caller ticket, so the daemon cannot tell whose it is
    (ended with UNAUTHENTICATED by :class:`~dataquay.server.node.users.access.CallerCheck`)."""


class StartupError(DataquayError):
    """The daemon could not start (directory not writable, port taken, ...)."""


class StateFileError(DataquayError, ValueError):
    """A state file whose content the server cannot use (a field of the wrong type)."""


class CacheWriterError(DataquayError):
    """The cache's writer has stopped: what waits for it would wait forever."""
