"""The bulk exchange of ``bench/experiments/wire.py``, round after round on one pair of
daemons: for A/B checks of the exchange's own cost and for profiling it.

Each round is ``bench/experiments/wire.py``'s: node-1 is wiped and restarted, a fresh
``partial`` job with Q = 1 starts, node-0 ships node-1 what it owns in
epoch 1. A round prints its rate (payload bytes over the daemon's own
elapsed time), how long the receiver took to acknowledge its first chunk
(the fixed start of a stream: offer, answer, first commit) and each
daemon's CPU seconds per GB; the sender's pid is
printed once it is up, and it stays the same for every round (attach
``perf record -p`` or ``py-spy`` to it). The medians over the rounds go to
``bench/results/exchange_rounds.json``.
There is no raw stream here: the ratios to it are ``bench/experiments/wire.py``'s.

``BENCH_SIZES`` (one of 110KiB, 1MiB; 110KiB by default),
``BENCH_EXCHANGE_MIB`` (the dataset, 2048 by default: 540 MB a round),
``BENCH_ROUNDS`` (5), ``BENCH_DAEMON_ARGS`` (extra ``serve`` flags for both
daemons, e.g. ``--prefetch-memory 0``), ``BENCH_BASELINE_SOURCE`` (run
the daemons from that source tree, as ``bench/experiments/wire.py`` does) and
``BENCH_GROWN=1`` (each round into the cache file the round before grew,
emptied: see ``exchange_pair.py``; a first, untimed round grows it).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import MiB, progress, report
from exchange_pair import exchange_round, staged_sender, started_pair
from wire import SIZES

from dataquay.client.malloc import tune_malloc
from dataquay.server.tools.synthetic import make_files_dataset

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
DATASET_BYTES = int(os.environ.get("BENCH_EXCHANGE_MIB", "2048")) * MiB
DAEMON_ARGS = tuple(os.environ.get("BENCH_DAEMON_ARGS", "").split())
SOURCE = os.environ.get("BENCH_BASELINE_SOURCE", "")
GROWN = os.environ.get("BENCH_GROWN", "") == "1"


def rounds(base: Path, label: str, size: int) -> dict[str, object]:
    root = base / "pfs" / label
    make_files_dataset(root, DATASET_BYTES // size, sizes=(size,))
    local = started_pair(base / "pair", DAEMON_ARGS, SOURCE)
    rates, sender, receiver, first = [], [], [], []
    moved = 0
    try:
        n0, manifest = staged_sender(local, label, root, "exchange rounds")
        assert local.daemons[0].process is not None
        progress(f"exchange rounds {label}: the sender is pid {local.daemons[0].process.pid}")
        for round_ in range(ROUNDS + GROWN):
            done = exchange_round(local, n0, label, manifest, round_, "rounds", GROWN)
            if GROWN and not round_:
                continue  # the round that grew the file
            moved = len(done.given) * size
            gigabytes = moved / 1e9
            rates.append(done.rate / 1e9)
            sender.append(done.sender_cpu / gigabytes)
            receiver.append(done.receiver_cpu / gigabytes)
            first.append(done.first_delivery * 1e3)
            progress(
                f"round {len(rates)} of {ROUNDS}: {rates[-1]:.2f} GB/s, first delivery after "
                f"{first[-1]:.1f} ms, sender {sender[-1]:.2f} and receiver {receiver[-1]:.2f} CPU s/GB"
            )
    finally:
        local.down()
    return {
        "size": label,
        "exchange_GBps": statistics.median(rates),
        "first_delivery_ms": statistics.median(first),
        "sender_cpu_s_per_GB": statistics.median(sender),
        "receiver_cpu_s_per_GB": statistics.median(receiver),
        "rounds_GBps": rates,
        "rounds_first_delivery_ms": first,
        "rounds_sender_cpu_s_per_GB": sender,
        "rounds_receiver_cpu_s_per_GB": receiver,
        "daemon_args": list(DAEMON_ARGS),
        "source": SOURCE,
        "round_bytes": moved,
        "grown": GROWN,
    }


def main() -> None:
    tune_malloc()
    label = os.environ.get("BENCH_SIZES", "110KiB")
    with tempfile.TemporaryDirectory(prefix="dq-bench-exchange-rounds-") as tmp:
        row = rounds(Path(tmp), label, SIZES[label])
    report(
        "exchange_rounds",
        [row],
        ["size", "exchange_GBps", "first_delivery_ms", "sender_cpu_s_per_GB", "receiver_cpu_s_per_GB"],
    )


if __name__ == "__main__":
    main()
