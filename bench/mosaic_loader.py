"""Mosaic StreamingDataset's side of bench/peer_loader.py.

It runs in Mosaic's own virtual environment (bench/.venv-mosaic, made by
peer_loader.py: Mosaic pins numpy and pulls in torch, neither of which may
go into dataquay's), so it imports nothing of dataquay's but the token bucket,
which needs only the standard library.

    python mosaic_loader.py pack ROOT REMOTE SHARD_BYTES    # the files as MDS shards
    python mosaic_loader.py versions NAME...                # one JSON line: {name: version}
    python mosaic_loader.py clean                           # shared memory a killed run left
    python mosaic_loader.py rank REMOTE LOCAL RANK EPOCHS RATE CACHE_LIMIT BATCH COMPUTE

``rank`` prints one JSON line: a list with, per epoch, the wall time, the data
wait, the bytes handed to the trainer and the bytes copied from the "remote"
(the PFS).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

_RATELIMIT = Path(__file__).resolve().parents[1] / "server" / "dataquay" / "server" / "ratelimit.py"


def _token_bucket(rate: float) -> Any:
    spec = importlib.util.spec_from_file_location("ratelimit", _RATELIMIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TokenBucket(rate)


def pack(root: str, remote: str, shard_bytes: str) -> None:
    """Every file under ``root``, in id order, as one MDS sample each."""
    from streaming import MDSWriter

    files = sorted(Path(root).rglob("*.bin"), key=lambda p: p.name)
    with MDSWriter(out=remote, columns={"data": "bytes"}, size_limit=int(shard_bytes)) as writer:
        for path in files:
            writer.write({"data": path.read_bytes()})


def versions(*names: str) -> None:
    from importlib.metadata import version

    print(json.dumps({name: version(name) for name in names}))


def clean() -> None:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()


def run_rank(
    remote: str,
    local: str,
    rank_text: str,
    epochs_text: str,
    rate: str,
    cache_limit: str,
    batch_text: str,
    compute: str,
) -> None:
    """One trainer rank's epochs."""
    rank, epochs, batch = int(rank_text), int(epochs_text), int(batch_text)
    import streaming.base.shared.prefix as mosaic_prefix
    import streaming.base.storage.download as download
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    bucket = _token_bucket(float(rate))
    copied = [0]
    copy = shutil.copy

    def capped_copy(src: str, dst: str, *args: Any, **kwargs: Any) -> Any:
        size = os.path.getsize(src)
        bucket.acquire(size)
        copied[0] += size
        return copy(src, dst, *args, **kwargs)

    # Mosaic copies a shard from a local "remote" with shutil.copy: capped there, it reads the PFS
    # at the same rate as every other system.
    download.shutil.copy = capped_copy
    # Each rank stands for a node of its own, but they share this host's /dev/shm, where Mosaic's
    # local leaders would all pick the same free prefix: each rank takes its own.
    find_prefix = mosaic_prefix._check_and_find_retrying

    def own_prefix(*args: Any, **kwargs: Any) -> int:
        return int(find_prefix(*args, **kwargs)) + rank

    mosaic_prefix._check_and_find_retrying = own_prefix
    dataset = StreamingDataset(
        remote=remote, local=local, batch_size=batch, shuffle=True, shuffle_seed=7, cache_limit=int(cache_limit)
    )
    loader = DataLoader(dataset, batch_size=batch, num_workers=0, collate_fn=lambda b: b)
    out = []
    for _ in range(epochs):
        before = copied[0]
        wait = 0.0
        nbytes = 0
        started = fetched = time.perf_counter()
        for samples in loader:
            wait += time.perf_counter() - fetched
            nbytes += sum(len(s["data"]) for s in samples)
            time.sleep(float(compute))
            fetched = time.perf_counter()
        wall = time.perf_counter() - started
        out.append({"wall": wall, "wait": wait, "bytes": nbytes, "pfs_bytes": copied[0] - before})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    {"pack": pack, "versions": versions, "clean": clean, "rank": run_rank}[sys.argv[1]](*sys.argv[2:])
