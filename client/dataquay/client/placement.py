"""Who reads what, computed: pure functions of (seed, epoch, sizes), no I/O.

Every process of a job computes the same orders from the same arguments, so no
party ever has to ask another where a sample goes.
"""

from __future__ import annotations

import numpy as np


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded order of 0..num_samples-1 for ``epoch`` (int64)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)
