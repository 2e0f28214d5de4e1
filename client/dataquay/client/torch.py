"""PyTorch adapters: a map-style Dataset and a Sampler over dataquay's, an
iterable dataset that deals a rank's epoch to DataLoader workers by itself,
and an iterable over a coordinated prep group's batches.

Optional: the rest of dataquay never imports torch. DataLoader workers are
safe with either start method: forked workers open their own connection and
LMDB handle on first use, and spawned ones receive a pickled dataset that
reconnects lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

try:
    import torch.utils.data
except ImportError as exc:
    raise ImportError("dataquay.client.torch needs PyTorch: pip install torch, or the [torch] extra") from exc

from dataquay.client.coordinated import CoordinatedLoader
from dataquay.client.dataset import Dataset
from dataquay.client.loading import SampleReader, worker_chunks
from dataquay.client.sampler import Sampler


class TorchDataset(torch.utils.data.Dataset):
    """A dataquay :class:`Dataset` as a map-style torch dataset.

    Args:
        dataset: an open dataquay dataset.
        transform: applied to each sample's bytes (decode, augment); the
            samples are returned as bytes without one.
        with_ids: call ``transform(sample_id, data)`` instead, for decoders
            that need to know the sample (its label in the manifest, its
            place in an npy array: ``dataset.manifest.record_dtype`` and
            ``record_shape`` give the rest).

    DataLoader fetches a whole batch through ``__getitems__`` (torch 2.1+),
    so the batch's misses go to the daemon in one request.
    """

    def __init__(
        self, dataset: Dataset, transform: Callable[..., Any] | None = None, *, with_ids: bool = False
    ) -> None:
        self.dataset = dataset
        self.transform = transform
        self.with_ids = with_ids

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        if self.transform is None:
            return sample
        return self.transform(index % len(self), sample) if self.with_ids else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        samples = self.dataset.get_batch(indices)
        if self.transform is None:
            return samples
        if self.with_ids:
            return [self.transform(int(i), sample) for i, sample in zip(indices, samples)]
        return [self.transform(sample) for sample in samples]


class TorchSampler(torch.utils.data.Sampler):
    """A dataquay :class:`Sampler` (from :meth:`Dataset.sampler`) as a torch sampler.

    Call :meth:`set_epoch` before each epoch, as with DistributedSampler.
    Its :meth:`state_dict` and :meth:`load_state_dict` are the wrapped
    sampler's, so torchdata's StatefulDataLoader, which calls them when a
    sampler has them, checkpoints and resumes the dataquay cursor at the
    batch it last yielded. A plain DataLoader has taken ids ahead of what it
    yielded: save ``state_dict(consumed=...)`` with the ids trained on.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self, consumed: int | None = None) -> dict[str, int | str]:
        """The wrapped sampler's cursor; with a plain DataLoader pass ``consumed``
        (see :meth:`Sampler.state_dict`), or it is the loader's read-ahead early."""
        return self.sampler.state_dict(consumed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class IterableDataset(torch.utils.data.IterableDataset):
    """A rank's epoch as batches, dealt to DataLoader workers by the dataset itself.

    Pass it to ``DataLoader(ds, batch_size=None, num_workers=W)``: each
    worker reads batches ``w, w + W, ...`` of the rank's order, and the
    DataLoader, taking one from each worker in turn, yields the rank's
    batches in order. The sampler pads (or drops) each rank's share to one
    length, and a batch stays a step even when ``on_error="skip"`` leaves
    samples out of it, so every rank takes the same number of steps (a
    batch whose every sample was skipped is yielded empty).

    Call :meth:`set_epoch` before each epoch, in the training process and
    with workers that are not persistent (each epoch's workers start from
    the dataset as it is then). Resume is exact: torchdata's
    StatefulDataLoader saves each worker's :meth:`state_dict` and gives it
    back to that worker; with a plain DataLoader save
    ``ds.state_dict(consumed=...)``, the samples of the epoch trained on, and
    :meth:`load_state_dict` it before the next ``iter(loader)``.

    Args:
        dataset: an open dataquay dataset.
        batch_size: samples per batch (per rank).
        sampler: this rank's ids (:meth:`Dataset.sampler`); default one over
            the whole dataset with ``seed`` and the launcher's rank and world size.
        decode, with_labels, on_error, retries, copy: as :class:`SampleReader`
            (``copy=False``: the decoder gets views, and the collate's
            stacking is the one copy of what the daemon served).
        collate: turns a batch's list of samples into what a step takes;
            default torch's ``default_collate``, None for the list.
        seed: the shuffle seed of the default sampler.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        decode: str | Callable[[bytes], Any] | None = None,
        with_labels: bool = False,
        on_error: str = "raise",
        retries: int = 2,
        copy: bool = True,
        collate: Callable[[list[Any]], Any] | None = torch.utils.data.default_collate,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.reader = SampleReader(
            dataset, decode, with_labels=with_labels, on_error=on_error, retries=retries, copy=copy
        )
        self.batch_size = batch_size
        self.sampler = dataset.sampler(seed=seed) if sampler is None else sampler
        self.collate = collate
        # This process's pass: the sampler's state where it began and the ids
        # of this worker's share it handed out since; skip: ids to pass over
        # in the next one (a restored worker's).
        self._pass_start: dict[str, Any] | None = None
        self._consumed = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches of a whole epoch of this rank, as the DataLoader yields them."""
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self._pass_start = {**self.sampler.state_dict(), "workers": workers, "batch_size": self.batch_size}
        ids = self.sampler.remaining()
        mine = worker_chunks(ids, self.batch_size, worker, workers)
        skip, self._skip, self._consumed = self._skip, 0, 0
        for chunk in mine:
            if skip >= len(chunk):
                skip -= len(chunk)
                self._consumed += len(chunk)
                continue
            samples = self.reader.read(chunk[skip:])
            self._consumed += len(chunk)
            skip = 0
            yield samples if self.collate is None or not samples else self.collate(samples)
        if info is None:
            self.sampler.position = 0

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where to resume.

        In a worker (torchdata's StatefulDataLoader asks there): where its
        pass began and how many of its ids it handed out. In the training
        process with a plain DataLoader, pass ``consumed``, the samples of
        this rank's epoch trained on (batches x ``batch_size``): the
        DataLoader's workers read ahead of what it yielded.
        """
        if consumed is not None or self._pass_start is None:
            return {"sampler": self.sampler.state_dict(consumed)}
        return {"sampler": self._pass_start, "worker_consumed": self._consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes from :meth:`state_dict`: the next pass starts where it says.

        Raises:
            ValueError: the state is not this dataset's, or was saved by a
                worker of a loader with another number of workers or batch size.
        """
        if "sampler" not in state:
            raise ValueError("dataset state has no 'sampler'; pass a dict from state_dict()")
        saved = dict(state["sampler"])
        if "worker_consumed" in state:
            info = torch.utils.data.get_worker_info()
            workers = 1 if info is None else info.num_workers
            for field, mine in (("batch_size", self.batch_size), ("workers", workers)):
                if saved.get(field) != mine:
                    raise ValueError(f"dataset state was saved with {field}={saved.get(field)!r}, not {mine}")
            self._skip = int(state["worker_consumed"])
        self.sampler.load_state_dict(saved)


class TorchCoordinated(torch.utils.data.IterableDataset):
    """A :class:`CoordinatedLoader` as an iterable of batches of tensors.

    Pass it to ``DataLoader(..., batch_size=None)``: the batches come whole
    from the group. Keep ``num_workers=0``: the loader preps in a thread of its
    own, and a worker process iterating it would join the group as another member.
    The tensors share memory with the arrays copied out of the group's segment.
    """

    def __init__(self, loader: CoordinatedLoader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("a coordinated loader runs in the training process: use DataLoader(..., num_workers=0)")
        for batch in self.loader:
            if isinstance(batch, tuple):
                yield tuple(torch.from_numpy(field) for field in batch)
            else:
                yield torch.from_numpy(batch)

    def __len__(self) -> int:
        return len(self.loader)
