"""JAX through grain: a dataset as grain's random-access data source, and a
dataquay sampler's epochs as grain's sampler.

grain's DataLoader asks a sampler for record ``i`` of the whole run, hands
``i`` to worker ``i % worker_count`` and gets the record from the data
source there; its checkpoint is the next ``i``. So the order, the split over
ranks and the resume are the dataquay sampler's, and the workers only read.
The source pickles (grain's workers are processes of their own) and
reconnects to the daemon in each.

The source needs no grain import; the sampler imports grain for its
``RecordMetadata``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dataquay.client.dataset import Dataset
from dataquay.client.loading import SampleReader
from dataquay.client.sampler import Sampler


class GrainSource:
    """A dataquay dataset as grain's ``RandomAccessDataSource``:
    ``len(source)`` records, ``source[record_key]`` one decoded sample.

    Args:
        dataset: an open dataquay dataset.
        decode, with_labels, on_error, retries: as
            :class:`~dataquay.client.loading.SampleReader`; a record asked
            for by key cannot be left out, so ``on_error="skip"`` raises
            PfsReadError for it, counted as skipped.
    """

    def __init__(
        self,
        dataset: Dataset,
        decode: str | Callable[[bytes], Any] | None = None,
        *,
        with_labels: bool = False,
        on_error: str = "raise",
        retries: int = 2,
    ) -> None:
        self.reader = SampleReader(dataset, decode, with_labels=with_labels, on_error=on_error, retries=retries)

    def __len__(self) -> int:
        return len(self.reader.dataset)

    def __getitem__(self, record_key: int) -> Any:
        return self.reader.one(int(record_key))

    def __repr__(self) -> str:
        # grain names the source in its checkpoints by this text: stable across runs.
        return f"GrainSource({self.reader.dataset.name!r}, decode={self.reader.decode!r})"


class GrainSampler:
    """A dataquay :class:`Sampler`'s epochs as grain's ``Sampler``: record
    ``i`` of the run is id ``i % len(sampler)`` of epoch ``i // len(sampler)``
    of this rank's order.

    Give each rank's grain DataLoader its rank's sampler
    (``ds.sampler(rank=..., world_size=...)``), and no shard options: the
    sampler already splits the epoch over ranks, the same length each.

    Args:
        sampler: this rank's dataquay sampler; its seed, shuffle and world
            decide the order, its cursor is not moved.
        epochs: epochs in the run; None for endless.
        seed: the seed grain gives each record's random transforms.

    Raises:
        ImportError: grain is not installed.
    """

    def __init__(self, sampler: Sampler, epochs: int | None = None, *, seed: int = 0) -> None:
        from grain.python import RecordMetadata

        self._metadata = RecordMetadata
        self.sampler = sampler
        self.epochs = epochs
        self.seed = seed
        self._order: tuple[int, np.ndarray] | None = None

    def __getitem__(self, index: int) -> Any:
        length = len(self.sampler)
        epoch, position = divmod(int(index), length) if length else (0, 0)
        if index < 0 or not length or (self.epochs is not None and epoch >= self.epochs):
            raise IndexError(f"record {index} is past the {self.epochs} epochs of {length} records")
        order = self._order  # one read: grain's reader threads ask concurrently, across epochs
        if order is None or order[0] != epoch:
            order = self._order = (epoch, self.sampler.indices(epoch))
        rng = np.random.Generator(np.random.Philox(key=self.seed + index))
        return self._metadata(index=index, record_key=int(order[1][position]), rng=rng)

    def __repr__(self) -> str:
        return f"GrainSampler({self.sampler!r}, epochs={self.epochs})"
