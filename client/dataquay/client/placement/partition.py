"""A job's initial partition: which node's cache holds each sample in epoch 0.

Cut once per job from its seed; the modes say how ownership moves from there.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from dataquay.client.placement.orders import INITIAL_GROUPS_KEY, INITIAL_SAMPLES_KEY, keyed_generator


def check_groups(groups: np.ndarray | None, num_samples: int) -> np.ndarray:
    """``groups`` as an index array, if it names a group for each of ``num_samples`` samples.

    Raises:
        ValueError: ``groups`` is missing, of another length, not integers,
            or holds a negative group id.
    """
    if groups is None:
        raise ValueError("the shard partition needs the group of every sample (Manifest.shard_groups())")
    groups = np.asarray(groups)
    if groups.ndim != 1 or len(groups) != num_samples:
        raise ValueError(f"groups must name one group per sample: {num_samples} ids, not shape {groups.shape}")
    if groups.dtype.kind not in "iu":
        raise ValueError(f"group ids must be integers, not {groups.dtype}")
    if len(groups) and groups.min() < 0:
        raise ValueError(f"group ids must not be negative, not {int(groups.min())}")
    return groups.astype(np.intp, copy=False)


def _sample_blocks(num_samples: int, num_nodes: int, seed: int, groups: np.ndarray | None) -> np.ndarray:
    """A seeded permutation cut into ``num_nodes`` blocks whose sizes differ by at most 1."""
    order = keyed_generator(seed, INITIAL_SAMPLES_KEY).permutation(num_samples)
    bounds = np.arange(num_nodes + 1, dtype=np.int64) * num_samples // num_nodes
    owner = np.empty(num_samples, dtype=np.int32)
    owner[order] = np.repeat(np.arange(num_nodes, dtype=np.int32), np.diff(bounds))
    return owner


def _whole_groups(num_samples: int, num_nodes: int, seed: int, groups: np.ndarray | None) -> np.ndarray:
    """Whole groups dealt to the least loaded node, largest first.

    Dealing largest first keeps the loads within one group of each other (and
    usually much closer); the seeded order of the groups breaks ties between
    groups of one size, so each seed gives each node other shards.
    """
    groups = check_groups(groups, num_samples)
    sizes = np.bincount(groups)
    shuffled = keyed_generator(seed, INITIAL_GROUPS_KEY).permutation(np.flatnonzero(sizes))
    dealt = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    loads = [(0, node) for node in range(num_nodes)]  # sorted, so already a heap
    takers = []
    for size in sizes[dealt].tolist():
        load, node = loads[0]
        takers.append(node)
        heapq.heapreplace(loads, (load + size, node))
    node_of_group = np.zeros(len(sizes), dtype=np.int32)
    node_of_group[dealt] = takers
    return node_of_group[groups]


_PARTITIONERS: dict[str, Callable[[int, int, int, np.ndarray | None], np.ndarray]] = {
    "sample": _sample_blocks,
    "shard": _whole_groups,
}
#: How a dataset is cut into the nodes' initial shares: single samples, or
#: whole groups (a tar shard, an npy file, a class folder) that never split,
#: so that each node reads only its own files from the PFS.
PARTITIONS = tuple(_PARTITIONERS)


def initial_owners(
    num_samples: int,
    num_nodes: int,
    seed: int,
    partition: str = "sample",
    groups: np.ndarray | None = None,
) -> np.ndarray:
    """The node (0..num_nodes-1) that owns each sample in epoch 0 (int32).

    ``sample`` cuts a seeded permutation into balanced blocks: node m owns
    block m. ``shard`` deals whole groups (``groups[i]`` is sample i's group:
    its tar shard, npy file or folder) so that node loads stay within one group
    of each other; it keeps each node's PFS reads to files of its own.

    Raises:
        ValueError: a negative size, fewer than one node, an unknown
            partition, or ``groups`` missing or of the wrong length for ``shard``.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must not be negative, not {num_samples}")
    if num_nodes < 1:
        raise ValueError(f"a job needs at least one node, not {num_nodes}")
    partitioner = _PARTITIONERS.get(partition)
    if partitioner is None:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, not {partition!r}")
    return partitioner(num_samples, num_nodes, seed, groups)
