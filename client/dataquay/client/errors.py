"""Errors a dataquay user can act on.

Every dataquay exception derives from :class:`DataquayError`, so one ``except``
clause catches them all; subclasses say which part failed and why.
"""

from __future__ import annotations


class DataquayError(Exception):
    """Root of every error raised by dataquay."""


class ManifestError(DataquayError):
    """A manifest is malformed, or a dataset root cannot be turned into one."""


class UnknownDatasetError(DataquayError, LookupError):
    """A dataset name that no registry knows."""


class SampleIdError(DataquayError, IndexError):
    """A sample id outside 0..N-1 of its dataset."""


class PfsReadError(DataquayError, OSError):
    """A sample could not be read from the parallel file system."""


class CorruptValueError(DataquayError):
    """A cached value whose checksum does not match its bytes."""


class PieceError(DataquayError):
    """The pieces of a sample sent in pieces do not add up to it: out of
    order, interleaved with other samples, or longer or shorter than the
    manifest says the sample is."""


class SampleTooLargeError(ManifestError):
    """A sample larger than the server's --max-sample-size: refused when its
    dataset is registered, and when it is read from a manifest registered
    under a larger limit."""


class DaemonUnavailableError(DataquayError, ConnectionError):
    """The local daemon cannot be reached."""


class UnknownJobError(DataquayError, LookupError):
    """A job id that the directory does not know."""


class JobMismatchError(DataquayError):
    """A job that does not fit what a rank brings: a setting that differs from the
    job's (the message names it), or a dataset replaced since the job began."""


class JobActiveError(DataquayError):
    """A drop of a job on condition that it is idle, refused because the job was
    active more recently: a rank joined or reported an epoch since it was listed."""


class InvalidRequestError(DataquayError, ValueError):
    """A request whose arguments cannot be served: a job's settings no job can
    have, an epoch out of range, an exchange offer out of order."""


class EpochTooFarError(InvalidRequestError):
    """An epoch too far past the job's current one in a mode whose owners
    move: its owners step from the current epoch's one epoch at a time, which
    would stall every daemon of the job (usually a global step passed for an
    epoch)."""


class BatchTooLargeError(DataquayError, ValueError):
    """A request with more ids than the daemon's --max-batch."""


class DatasetExistsError(DataquayError):
    """A dataset name that is already registered (use --replace)."""


class NodeNameTakenError(DataquayError):
    """A node name a live node of another identity holds: two daemons must
    not answer for one name, or peers would read from whichever came last."""


class RootNotAllowedError(DataquayError, PermissionError):
    """A dataset root outside the server's --dataset-roots: the operator, not
    a token holder, decides which directories the server reads for callers."""


class UserNotAllowedError(DataquayError, PermissionError):
    """A call the calling user may not make on a daemon that keeps its users
    apart (--users apart): the message names the rule, never another user's data."""


class DatasetReplacedError(DataquayError):
    """A read for a version of a dataset that was replaced since it was opened."""


class DirectoryUnavailableError(DataquayError, ConnectionError):
    """The directory does not answer and the daemon has no copy of what was asked."""


class NoLiveNodesError(DataquayError):
    """A job that would run on all live nodes while none is up."""


class StandaloneError(DataquayError):
    """A cluster operation (jobs, peers) asked of a daemon that has no directory."""


class CacheFullError(DataquayError):
    """A node's cache has no room for what it was asked to keep (an exchange
    that found no room in time): worth another try once the node freed some."""


class CacheQuotaError(DataquayError):
    """Staging would pass a cache quota of the caller's user or group (the
    message names it): drop or evict a dataset charged to it first."""


class ExchangeRefusedError(DataquayError):
    """An exchange offer a node must not accept: ids it does not own in the
    offer's epoch, or a dataset version the job does not use."""


class SegmentRefusedError(DataquayError):
    """A shared-memory segment the daemon would not map: not a sealed memfd
    of the size announced, a wrong token, or too many segments at once (the
    message says which). The client then hands payloads over through /dev/shm."""
