"""The loops of dataquay.server.node.exchange.coding's planner, in C (coding-c/)."""

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
def packet_rows(
    tables: np.ndarray, decoders: np.ndarray, sizes: np.ndarray, parts: np.ndarray, start: np.ndarray, /
) -> int: ...
def pick_bits(
    holders: np.ndarray, start: np.ndarray, samples: np.ndarray, spread: np.ndarray, out: np.ndarray, /
) -> None: ...
def table_hashes(
    holders: np.ndarray, samples: np.ndarray, decoders: np.ndarray, lookup: np.ndarray, out: np.ndarray, /
) -> None: ...
def set_numbers(
    holders: np.ndarray,
    samples: np.ndarray,
    decoders: np.ndarray,
    out: np.ndarray,
    keys: np.ndarray,
    order: np.ndarray,
    /,
) -> int: ...
def dag_edges(
    keys: np.ndarray, table_start: np.ndarray, group_decoder: np.ndarray, group_count: np.ndarray, /
) -> bytearray: ...
