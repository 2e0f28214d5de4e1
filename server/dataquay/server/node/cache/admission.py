"""What may enter this node's cache: the rule every write of cache values passes.

A value's checksum proves only that whoever sent it computed one: a party
that may open an exchange stream could otherwise fill this cache with bytes
of its choosing for ids this node serves next epoch, and its ranks would
train on them. So a value is admitted only with the payload length the
manifest lists for its id, and a value an exchange delivers only from the
node the job's plan says gives that id in that epoch: its owner the epoch
before (what :mod:`dataquay.server.node.exchange.sender` gives away). Pure: numpy in, numpy out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Reason codes, one per value: admitted, or why not.
ADMITTED = 0
LENGTH = 1
ORIGIN = 2
#: The metric label of each refusal reason.
REASONS = {LENGTH: "length", ORIGIN: "origin"}


@dataclass(frozen=True)
class Origin:
    """Who may hand this node which ids in one exchange: a stream's sender
    gives an id only if it held it the epoch before and this node holds it
    in the offer's epoch (the owner, unless the job lists it absent then).

    Attributes:
        sender: the sender's index in the job's nodes, -1 when it is not one of them.
        receiver: this node's index in the job's nodes.
        before: holder index per sample id in the epoch before the offer's (None: no such epoch).
        after: holder index per sample id in the offer's epoch.
    """

    sender: int
    receiver: int
    before: np.ndarray | None
    after: np.ndarray


def refusals(
    ids: np.ndarray, payload_lengths: np.ndarray, manifest_lengths: np.ndarray, origin: Origin | None = None
) -> np.ndarray:
    """The reason code of each value (ADMITTED where it may be committed).

    Args:
        ids: sample ids, each within the manifest.
        payload_lengths: each value's payload length (its checksum not counted).
        manifest_lengths: the manifest's ``sample_length`` per id.
        origin: for values an exchange delivers, who sent them; None for
            values this node read itself (PFS, a peer it asked).
    """
    ids = np.asarray(ids, dtype=np.int64)
    reasons = np.full(len(ids), ADMITTED, dtype=np.int8)
    reasons[np.asarray(payload_lengths, dtype=np.int64) != manifest_lengths[ids]] = LENGTH
    if origin is not None:
        reasons[~gives(ids, origin)] = ORIGIN
    return reasons


def gives(ids: np.ndarray, origin: Origin) -> np.ndarray:
    """Whether ``origin.sender`` gives each of ``ids`` to ``origin.receiver``."""
    ids = np.asarray(ids, dtype=np.int64)
    if origin.before is None or origin.sender < 0 or origin.sender == origin.receiver:
        return np.zeros(len(ids), dtype=bool)
    return (origin.before[ids] == origin.sender) & (origin.after[ids] == origin.receiver)
