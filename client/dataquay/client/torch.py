"""PyTorch adapters: a map-style Dataset and a Sampler over dataquay's, and an
iterable over a coordinated prep group's batches.

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
    raise ImportError("dataquay.client.torch needs PyTorch: pip install dataquay[torch]") from exc

from dataquay.client.coordinated import CoordinatedLoader
from dataquay.client.dataset import Dataset
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
            raise RuntimeError(
                "a coordinated loader runs in the training process: use DataLoader(..., num_workers=0)"
            )
        for batch in self.loader:
            if isinstance(batch, tuple):
                yield tuple(torch.from_numpy(field) for field in batch)
            else:
                yield torch.from_numpy(batch)

    def __len__(self) -> int:
        return len(self.loader)
