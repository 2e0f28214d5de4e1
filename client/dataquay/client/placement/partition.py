"""A job's initial partition: which node's cache holds each sample in epoch 0.

A function of the dataset and the names of the job's nodes, stable under a
change of the node set; the modes say how ownership moves from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dataquay.client.placement.orders import INITIAL_GROUPS_KEY, INITIAL_SAMPLES_KEY, keyed_generator
from dataquay.client.placement.rendezvous import CANONICAL_PARTITIONS, dataset_key, place


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


def canonical_partitions(
    num_samples: int, partition: str = "sample", groups: np.ndarray | None = None, dataset: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """The dataset's canonical partitions: (partition of each sample (intp), samples in each (int64)).

    They depend on the dataset alone, never on the nodes or the job's seed,
    so that every job on a dataset, on any node set, places the same units.
    ``sample`` deals the samples, ``shard`` whole groups (``groups[i]`` is
    sample i's group), over at most :data:`CANONICAL_PARTITIONS` partitions
    in a seeded order, so that partition sizes differ by at most one sample
    (``sample``) or one group's worth (``shard``).

    Raises:
        ValueError: an unknown partition, or ``groups`` missing or of the
            wrong length for ``shard``.
    """
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, not {partition!r}")
    key = dataset_key(dataset)
    if partition == "shard":
        groups = check_groups(groups, num_samples)
        unit_of_sample, num_units, draw = groups, int(groups.max(initial=-1)) + 1, INITIAL_GROUPS_KEY
    else:
        unit_of_sample, num_units, draw = np.arange(num_samples, dtype=np.intp), num_samples, INITIAL_SAMPLES_KEY
    num_partitions = min(num_units, CANONICAL_PARTITIONS)
    part_of_unit = np.empty(num_units, dtype=np.intp)
    part_of_unit[keyed_generator(key, draw).permutation(num_units)] = (
        np.arange(num_units, dtype=np.int64) * num_partitions // max(num_units, 1)
    )
    part_of_sample = part_of_unit[unit_of_sample]
    return part_of_sample, np.bincount(part_of_sample, minlength=num_partitions).astype(np.int64)


#: How a dataset is cut into canonical partitions: single samples, or whole
#: groups (a tar shard, an npy file, a class folder) that never split, so
#: that each node reads only its own files from the PFS.
PARTITIONS = ("sample", "shard")


def node_names(nodes: int | Sequence[str]) -> tuple[str, ...]:
    """The node names of ``nodes``: as given, or "0".."M-1" for a count M.

    Raises:
        ValueError: fewer than one node.
    """
    names = tuple(str(node) for node in range(nodes)) if isinstance(nodes, int) else tuple(nodes)
    if not names:
        raise ValueError(f"a job needs at least one node, not {nodes!r}")
    return names


def initial_owners(
    num_samples: int,
    nodes: int | Sequence[str],
    partition: str = "sample",
    groups: np.ndarray | None = None,
    dataset: str = "",
) -> np.ndarray:
    """The node (an index into ``nodes``) that holds each sample in epoch 0 (int32).

    The dataset's canonical partitions (:func:`canonical_partitions`) go to
    nodes by rendezvous hashing of their names with balanced shares
    (:func:`~dataquay.client.placement.rendezvous.place`): every node holds
    within one partition of N/M samples, and a node that leaves or joins
    moves the holder of about 1/M of the samples, not a reshuffle. Only the
    names matter: listing the same nodes in another order gives each sample
    the same node.

    Args:
        num_samples: ids are 0..num_samples-1.
        nodes: the node names, or their count M (names "0".."M-1").
        partition: a key of :data:`PARTITIONS`.
        groups: the group of every sample, for ``shard``.
        dataset: the dataset's name, which keys its partitions.

    Raises:
        ValueError: a negative size, no node, a node named twice, an unknown
            partition, or ``groups`` missing or of the wrong length for ``shard``.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must not be negative, not {num_samples}")
    names = node_names(nodes)
    part_of_sample, sizes = canonical_partitions(num_samples, partition, groups, dataset)
    if not num_samples:
        return np.empty(0, dtype=np.int32)
    return place(dataset_key(dataset), sizes, names)[part_of_sample]
