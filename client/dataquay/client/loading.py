"""What every framework adapter shares: a worker's share of a rank's epoch,
and reads that decode, label, and skip or retry a sample that fails.

Framework-free, so the PyTorch, grain and tf.data adapters behave the same
and the logic is tested without any of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dataquay.client.dataset import Dataset
from dataquay.client.decoders import SampleDecoder, sample_decoder
from dataquay.client.errors import CorruptValueError, PfsReadError
from dataquay.client.stats import ReadStats

#: What ``on_error`` may say of a sample that cannot be read or decoded.
ON_ERROR = ("raise", "skip", "retry")
#: Seconds before the first retry of a failed read; each further one waits twice as long.
RETRY_BACKOFF_SECONDS = 0.05
#: Errors of a read that ``on_error`` applies to: the sample's file, not the service.
_READ_ERRORS = (PfsReadError, CorruptValueError)
#: Errors of a decoder that ``on_error`` applies to (a corrupt image is an OSError to Pillow).
_DECODE_ERRORS = (OSError, ValueError)


def worker_chunks(ids: np.ndarray, batch_size: int, worker: int, workers: int) -> list[np.ndarray]:
    """Worker ``worker``'s batches of ``ids``: batches ``worker``, ``worker +
    workers``, ... of ``batch_size`` ids each (the last may be shorter).

    A DataLoader takes one batch from each worker in turn, so its batches
    come out in the rank's order, and every worker has at most one batch
    more than another.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is not in 0..{workers - 1}")
    starts = range(worker * batch_size, len(ids), workers * batch_size)
    return [ids[start : start + batch_size] for start in starts]


class SampleReader:
    """Reads samples of a dataset and decodes them, as an adapter's ``decode``,
    ``with_labels`` and ``on_error`` say.

    Picklable (DataLoader and grain workers): the decoder is resolved in
    each process on first use.

    Args:
        dataset: an open dataquay dataset.
        decode: a name of :data:`dataquay.client.decoders.DECODERS`, a
            callable of a sample's bytes, or None for the bytes.
        with_labels: give ``(sample, target)``, the target an int from
            :attr:`Dataset.targets` (-1: no label).
        on_error: ``raise`` fails on a sample that cannot be read or decoded;
            ``skip`` leaves it out (counted as ``skipped`` in
            :meth:`Client.stats`); ``retry`` reads it again up to
            ``retries`` times (each counted as ``retried``), then raises.
        retries: reads after the first, for ``on_error="retry"``.
        copy: False hands the decoder read-only memoryviews over the memory
            each batch was read into, not bytes (see ``Dataset.get_batch``):
            one copy less of what the daemon served, for decoders that take
            a buffer (``npy``, ``image``, ``np.frombuffer``). A decoded
            sample that keeps its view (``raw``, an array over it) keeps the
            batch's shared memory segment from other reads while it lives.

    Raises:
        ValueError: ``on_error`` is not one of ON_ERROR, or ``decode`` does
            not fit the dataset.
    """

    def __init__(
        self,
        dataset: Dataset,
        decode: str | Callable[[bytes], Any] | None = None,
        *,
        with_labels: bool = False,
        on_error: str = "raise",
        retries: int = 2,
        copy: bool = True,
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
        if retries < 0:
            raise ValueError(f"retries must not be negative, not {retries}")
        self.dataset = dataset
        self.decode = decode
        self.with_labels = with_labels
        self.on_error = on_error
        self.retries = retries
        self.copy = copy
        sample_decoder(decode, dataset.manifest)  # a name that does not fit fails here, not in a worker
        self._decoder: SampleDecoder | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decoder": None}

    def read(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples of ``ids`` in order, read in one batch; with
        ``on_error="skip"``, those that failed are left out."""
        try:
            batch: Sequence[bytes | memoryview] = self.dataset.get_batch(ids, copy=self.copy)
        except _READ_ERRORS:
            if self.on_error == "raise":
                raise
            # One sample failed the batch: read each alone to find it.
            return [sample for i in ids for sample in self._one_or_none(int(i))]
        return [sample for i, data in zip(ids, batch) for sample in self._decoded(int(i), data)]

    def one(self, sample_id: int) -> Any:
        """One sample, read alone. ``on_error="skip"`` cannot leave out what
        was asked for by index, so its failure raises, counted as skipped."""
        found = self._one_or_none(sample_id)
        if not found:
            raise PfsReadError(f"sample {sample_id} of dataset {self.dataset.name!r} could not be read or decoded")
        return found[0]

    def _one_or_none(self, sample_id: int) -> list[Any]:
        """``[sample]``, or ``[]`` where ``on_error="skip"`` left it out."""
        retries = self.retries if self.on_error == "retry" else 0
        for attempt in range(retries + 1):
            try:
                data = self.dataset[sample_id]
                break
            except _READ_ERRORS:
                if self.on_error == "skip":
                    self._stats().skipped()
                    return []
                if attempt == retries:
                    raise
                self._stats().retried()
                time.sleep(RETRY_BACKOFF_SECONDS * 2**attempt)
        return self._decoded(sample_id, data)

    def _decoded(self, sample_id: int, data: bytes | memoryview) -> list[Any]:
        if self._decoder is None:
            self._decoder = sample_decoder(self.decode, self.dataset.manifest)
        try:
            sample = self._decoder(sample_id, data)
        except _DECODE_ERRORS:
            if self.on_error != "skip":
                raise
            self._stats().skipped()
            return []
        if self.with_labels:
            return [(sample, int(self.dataset.targets[sample_id]))]
        return [sample]

    def _stats(self) -> ReadStats:
        return self.dataset.client.read_stats
