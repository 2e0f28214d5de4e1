"""Errors of the daemon and its CLI, rooted in :class:`DataquayError`.

The client's errors (unknown dataset or job, bad sample id, PFS read failure,
a job's settings that differ) are the same objects on both sides, so they are
re-exported here.
"""

from __future__ import annotations

from dataquay.client.errors import (
    DataquayError,
    JobMismatchError,
    ManifestError,
    PfsReadError,
    SampleIdError,
    UnknownDatasetError,
    UnknownJobError,
)

__all__ = [
    "BatchTooLargeError",
    "ConfigError",
    "DataquayError",
    "DatasetExistsError",
    "DatasetReplacedError",
    "DirectoryUnavailableError",
    "ExchangeRefusedError",
    "InvalidRequestError",
    "JobMismatchError",
    "ManifestError",
    "NoLiveNodesError",
    "PfsReadError",
    "SampleIdError",
    "StandaloneError",
    "StartupError",
    "UnknownDatasetError",
    "UnknownJobError",
]


class ConfigError(DataquayError, ValueError):
    """A flag, environment variable or config value that cannot be used."""


class StartupError(DataquayError):
    """The daemon could not start (directory not writable, port taken, ...)."""


class DatasetExistsError(DataquayError):
    """A dataset name that is already registered (use --replace)."""


class DatasetReplacedError(DataquayError):
    """A read for a version of a dataset that was replaced since it was opened."""


class BatchTooLargeError(DataquayError, ValueError):
    """A request with more ids than the daemon's --max-batch."""


class InvalidRequestError(DataquayError, ValueError):
    """A request whose arguments cannot be served (relayed from the directory)."""


class DirectoryUnavailableError(DataquayError, ConnectionError):
    """The directory does not answer and this node has no copy of what was asked."""


class ExchangeRefusedError(DataquayError):
    """An exchange offer this node must not accept: ids it does not own in the
    offer's epoch, or a dataset version the job does not use."""


class NoLiveNodesError(DataquayError):
    """A job that would run on all live nodes while none is up."""


class StandaloneError(DataquayError):
    """A cluster operation (jobs, peers) asked of a daemon that has no directory."""
