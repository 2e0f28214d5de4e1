"""One rank of a job that trains at its own pace, run as its own process by
the tests and benchmarks: no barrier between ranks, as a real job's ranks
run between their collectives. Prints one JSON line per epoch: the ids it read, their
checksums, and its samples by tier. The two ranks of a node take turns at
being slower (half as long again per batch): one enters each epoch while the
other still reads the one before, and neither drifts an epoch ahead. With
READ_AHEAD batches read ahead, the client reads the next epoch's first batches
while this one's last are trained on: they count in the epoch that read them.
With WAIT_EXCHANGE seconds, each set_epoch may wait that long for the
exchange into its epoch (``Dataset.sampler(wait_for_exchange=...)``); each
line then also says how long it waited.

Usage: python -m dataquay.server.tools.free_rank DATASET EPOCHS BATCH SECONDS_PER_BATCH READ_AHEAD [WAIT_EXCHANGE]
(rank and job from the environment, as :meth:`LocalCluster.rank_env` sets them).
"""

from __future__ import annotations

import json
import os
import sys
import time

import dataquay.client as dq
from dataquay.client.wire.records import checksum


def command(
    dataset: str, epochs: int, batch: int, seconds: float, read_ahead: int, wait_exchange: float = 0.0
) -> list[str]:
    """The command line that runs one such rank."""
    return [
        sys.executable,
        "-m",
        "dataquay.server.tools.free_rank",
        dataset,
        str(epochs),
        str(batch),
        str(seconds),
        str(read_ahead),
        str(wait_exchange),
    ]


def main() -> None:
    dataset, epochs, batch, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    read_ahead = int(sys.argv[5])
    wait_exchange = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    client = dq.connect(timeout=30)
    try:
        ds = client.dataset(dataset)
        sampler = ds.sampler(wait_for_exchange=wait_exchange)
        local_rank = int(os.environ["LOCAL_RANK"])
        for epoch in range(epochs):
            waited = client.stats().exchange_wait_seconds
            sampler.set_epoch(epoch)
            waited = client.stats().exchange_wait_seconds - waited
            pace = seconds * (1.5 if (epoch + local_rank) % 2 else 1.0)
            ids = sampler.indices().tolist()
            before = client.stats().samples
            sums: list[int] = []
            for samples in ds.batches(sampler, batch, read_ahead=read_ahead):
                sums += [checksum(s) for s in samples]
                time.sleep(pace)
            after = client.stats().samples
            tiers = {t: after[t] - before[t] for t in after}
            line = {"epoch": epoch, "ids": ids, "checksums": sums, "samples": tiers, "exchange_wait": waited}
            print(json.dumps(line), flush=True)
    finally:
        client.close()


if __name__ == "__main__":
    main()
