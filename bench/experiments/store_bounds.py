"""What any receiver of the exchange must do at least with what it takes:
put the values into a store. ``bench/experiments/wire.py`` measures these bounds in the
same rounds as the exchange, each writing the same values in its own
process, 64 values at a time:

- LMDB commit alone: into a fresh LMDB environment as the daemon's writer did
  before the cache file was allocated ahead (putmulti, a transaction per 64
  values, no sync).
- LMDB commit alone, writemap: the same into an environment opened with
  ``writemap=True`` over a file allocated ahead (``fallocate``), as the
  daemon's store does now (:mod:`dataquay.server.node.cache.file`).
- page cache, mmap / pwrite: what any store must do at least, put the bytes
  into the page cache of its file: a copy into a shared map of a file
  allocated ahead, value by value, and one ``pwritev`` per 64 values into
  such a file. No index, no checksum, no transaction.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from pathlib import Path

import lmdb
import numpy as np

from dataquay.client.wire.records import CHECKSUM_BYTES, encode_value

#: (key, stored value) pairs, a list per batch.
Values = list[list[tuple[bytes, bytes]]]


def stored_values(batches: list[np.ndarray], paths: list[str]) -> Values:
    """The batches' (key, stored value) pairs, as the receiver's writer gets them."""
    return [[(i.to_bytes(8, "big"), encode_value(Path(paths[i]).read_bytes())) for i in b.tolist()] for b in batches]


def payload_bytes(values: Values) -> int:
    """The payload bytes of ``values``, checksums left out."""
    return sum(len(v) - CHECKSUM_BYTES for batch in values for _, v in batch)


def allocated_cache(home: Path, size: int) -> lmdb.Environment:
    """An LMDB cache as the store opens it: ``writemap`` over a file allocated
    ahead. It starts with the least map, so that LMDB writes its meta pages,
    then the file is allocated and the map grown over it."""
    home.mkdir(parents=True)
    env = lmdb.open(str(home), map_size=64 << 10, writemap=True, sync=False, metasync=False, meminit=False, max_dbs=2)
    fd = os.open(home / "data.mdb", os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    env.set_mapsize(size)
    return env


def lmdb_commit(home: Path, values: Values, writemap: bool = False) -> float:
    """Bytes/s of committing the values to a fresh LMDB environment, a
    transaction per batch, as the daemon's writer does; ``writemap`` over a
    file allocated ahead, as the store opens it where it can."""
    total = sum(len(v) for batch in values for _, v in batch)
    map_size = 2 * total + (64 << 20)
    env = (
        allocated_cache(home, map_size)
        if writemap
        else lmdb.open(str(home), map_size=map_size, sync=False, metasync=False, meminit=False, max_dbs=2)
    )
    db = env.open_db(b"bench")
    started = time.perf_counter()
    for batch in values:
        with env.begin(write=True) as txn:
            txn.cursor(db).putmulti(batch, overwrite=False)
    elapsed = time.perf_counter() - started
    env.close()
    shutil.rmtree(home)
    return payload_bytes(values) / elapsed


def page_cache(home: Path, values: Values) -> tuple[float, float]:
    """Bytes/s of the least a store does: (a copy of each value into a shared
    map of a file allocated ahead, a pwritev of each batch into such a file)."""
    home.mkdir(parents=True, exist_ok=True)
    total = sum(len(v) for batch in values for _, v in batch)
    rates = []
    for name in ("mmap", "pwrite"):
        fd = os.open(home / name, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, total)
        started = time.perf_counter()
        offset = 0
        if name == "mmap":
            with mmap.mmap(fd, total) as mapped:
                for batch in values:
                    for _, value in batch:
                        mapped[offset : offset + len(value)] = value
                        offset += len(value)
                elapsed = time.perf_counter() - started
        else:
            for batch in values:
                offset += os.pwritev(fd, [value for _, value in batch], offset)
            elapsed = time.perf_counter() - started
        os.close(fd)
        rates.append(payload_bytes(values) / elapsed)
    shutil.rmtree(home)
    return rates[0], rates[1]
