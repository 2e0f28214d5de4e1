"""One member of a coordinated prep group, run as its own process by the tests.

Writes one JSON line per batch it consumed (epoch, index, the sample keys its
prep saw, a digest of the batch's bytes), then one line with its totals.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np

import dataquay.client as dq

#: Values per sample the prep keeps.
PREP_VALUES = 256


def prep(sample: bytes) -> tuple[np.ndarray, np.ndarray]:
    """A stand-in for decode and augment: the sample's first 8 bytes as its key, and a float view of it."""
    key = np.frombuffer(sample[:8], "<u8")[0]
    pixels = np.frombuffer(sample, np.uint8)[:PREP_VALUES].astype(np.float32)
    return key, np.sqrt(pixels) * 2 + 1


def digest(batch: tuple[np.ndarray, ...]) -> str:
    h = hashlib.sha256()
    for field in batch:
        h.update(field.dtype.str.encode() + str(field.shape).encode() + field.tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("addr", "dataset", "group", "out"):
        parser.add_argument(f"--{name}", required=True)
    for name, default in (("jobs", 1), ("batch-size", 4), ("seed", 0), ("epochs", 1), ("workers", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--memory", type=int, default=1 << 30)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--step", type=float, default=0.0, help="seconds of simulated training per batch")
    args = parser.parse_args()
    with dq.connect(args.addr, timeout=10) as client, open(args.out, "a") as out:
        ds = client.dataset(args.dataset)
        with ds.coordinated(
            group=args.group,
            jobs=args.jobs,
            prep=prep,
            batch_size=args.batch_size,
            seed=args.seed,
            memory_bytes=args.memory,
            timeout=args.timeout,
            workers=args.workers,
        ) as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                for index, batch in enumerate(loader):
                    keys, _ = batch
                    line = {"epoch": epoch, "index": index, "keys": [int(k) for k in keys], "digest": digest(batch)}
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                    time.sleep(args.step)
            out.write(json.dumps({"done": True, "prepped_here": loader.prepped_here}) + "\n")


if __name__ == "__main__":
    main()
