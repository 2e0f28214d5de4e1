"""The batches of a coordinated prep group's epoch: a pure function of
(N, batch size, seed, epoch), so every member computes the same order without
asking anyone, and a member that must go on alone (dropped, or its daemon
gone) preps exactly the batches the group would have handed it.
"""

from __future__ import annotations

import numpy as np

from dataquay.client.placement.orders import epoch_permutation


def batch_count(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch; the last is shorter unless ``drop_last`` drops it."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    return num_samples // batch_size if drop_last else -(-num_samples // batch_size)


def batch_ids(num_samples: int, batch_size: int, seed: int, epoch: int, index: int) -> np.ndarray:
    """The sample ids of batch ``index`` of ``epoch`` (int64): a slice of the epoch's seeded permutation."""
    order = epoch_permutation(num_samples, seed, epoch)
    return order[index * batch_size : (index + 1) * batch_size]


def epoch_batches(num_samples: int, batch_size: int, seed: int, epoch: int, drop_last: bool) -> list[np.ndarray]:
    """Every batch of ``epoch``, in the order all members consume them."""
    order = epoch_permutation(num_samples, seed, epoch)
    count = batch_count(num_samples, batch_size, drop_last)
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(count)]
