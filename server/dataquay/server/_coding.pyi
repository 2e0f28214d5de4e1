"""UberShuffle's greedy of dataquay.server.node.exchange.coding, in C (_coding.c)."""

import numpy as np

def greedy(
    keys: np.ndarray,
    table_start: np.ndarray,
    group_decoder: np.ndarray,
    group_count: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    parent: np.ndarray,
    member: np.ndarray,
    child: np.ndarray,
    out: np.ndarray,
    /,
) -> None: ...
