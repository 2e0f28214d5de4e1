"""The two readings of ``partial``'s Q.

dataquay's q is the fraction of its samples a node *draws* into the epoch's
pool; the pool is dealt back over all M nodes, so on average 1/M of a node's
picks return to it and q(1 - 1/M) of its samples *leave* it. The partial-local
shuffling paper (Nguyen et al., IPDPS 2022) counts the samples that leave: each worker sends
Q x N/M. q = 1 is a uniform global reshuffle, in which 1 - 1/M leave.
"""

from __future__ import annotations


def leaving_fraction(q: float, num_nodes: int) -> float:
    """The fraction of its samples that leaves a node per epoch (Nguyen et al.'s Q)
    when it draws ``q`` into the pool, on average."""
    return q * (1.0 - 1.0 / num_nodes)


def drawn_fraction(q_leaving: float, num_nodes: int) -> float:
    """The q to draw so that ``q_leaving`` of each node's samples leave it per
    epoch (the inverse of :func:`leaving_fraction`).

    Raises:
        ValueError: ``q_leaving`` outside (0, 1 - 1/M]: even a full reshuffle
            keeps 1/M of a node's samples where they are.
    """
    most = leaving_fraction(1.0, num_nodes)
    if not 0.0 < q_leaving <= most:
        raise ValueError(
            f"q_leaving must be in (0, {most:g}] with {num_nodes} node{'s' if num_nodes != 1 else ''} "
            f"(a full reshuffle keeps 1/{num_nodes} of each node's samples), not {q_leaving:g}"
        )
    return min(1.0, q_leaving / most)
