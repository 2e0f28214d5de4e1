"""Caches that keep spare copies, as UberShuffle (Chung et al., SysML 2018) models them:
what coded shuffling needs to gain.

After each exchange a node caches the samples it now owns plus, up to its
capacity, samples drawn at random from what it cached before (UberShuffle: C_i
becomes D_i plus s - |D_i| points of C_i \\ D_i). dataquay's daemons keep
given-away samples as spare copies below ``--spare-copies-fill`` and delete
them past it; a random choice of which stay is this model's simplification.
"""

from __future__ import annotations

import numpy as np


def balanced_owners(num_samples: int, num_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """A random assignment of every sample to a node, node loads within one of each other."""
    return rng.permutation(np.arange(num_samples, dtype=np.int64) % num_nodes)


def refill(previous: list[np.ndarray], owners: np.ndarray, capacity: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each node's cache after an exchange: its owned samples, then spares drawn from ``previous``.

    Args:
        previous: each node's cached ids before the exchange (any order).
        owners: the new owner of every sample.
        capacity: samples a cache holds; a node owning more keeps only what it owns.
        rng: the draw of which spares stay.
    """
    order = np.argsort(owners, kind="stable")
    bounds = np.searchsorted(owners[order], np.arange(len(previous) + 1))
    caches = []
    for node, cached in enumerate(previous):
        owned = order[bounds[node] : bounds[node + 1]]
        spares = np.setdiff1d(cached, owned, assume_unique=True)
        keep = rng.choice(spares, min(len(spares), max(0, capacity - len(owned))), replace=False)
        caches.append(np.concatenate([owned, keep]).astype(np.int64))
    return caches
