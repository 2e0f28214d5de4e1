"""Coded shuffling: transmissions and bytes of the uncoded, coded and UberShuffle exchanges.

UberShuffle's settings (Chung et al., SysML 2018): n nodes each caching a fraction ``alpha`` of q samples,
the dataset reassigned uniformly at random every epoch, and each cache after
the exchange holding its new share plus spares drawn at random from what it
held (:func:`dataquay.server.tools.spare_copies.refill`). Caches start random
and go through one exchange before the measured one, so the spares come from
the model, not from the start.

Per setting, from the planner (:mod:`dataquay.server.node.exchange.coding`):

- ``*_packets``: the seed's count (a sender that holds every sample);
- ``*_tx``: transmissions where no node holds all data (the planner's sender
  rule: a packet with no node caching every part costs a fetch too);
- ``*_GiB``: bytes of those transmissions with sample sizes drawn from a
  log-normal around 110 KiB (an ImageNet-like spread; a packet is as long as
  its longest part, and the planner pairs parts of like sizes);
- ``*_s``: the planner's time for that scheme (one run; at 256 nodes the
  median of ``REPEATS``), which runs once per epoch.

``--quick`` runs the seed's sizes up to 10^5 only.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from common import REPEATS, progress, report

from dataquay.server.node.exchange.coding import holder_bits, load, plan
from dataquay.server.tools.spare_copies import balanced_owners, refill

SEED_NODES = 20
SEED_FRACTIONS = (0.2, 0.14)
SEED_SAMPLES = (10**4, 68_000, 10**5, 3 * 10**5, 7 * 10**5)
#: Beyond the seed: larger clusters at the seed's fraction, and at the seed's
#: copies per sample (alpha * n = 4 and 2.8), which is what decides the gain.
BEYOND = [(nodes, fraction) for nodes in (64, 256) for fraction in (0.2, 4 / nodes, 2.8 / nodes)]
BEYOND_SAMPLES = (10**5, 7 * 10**5)
MEDIAN_BYTES, SIGMA = 110 * 1024, 0.5
SCHEMES = ("none", "coded", "uber")

COLUMNS = [
    "nodes",
    "alpha",
    "copies",
    "samples",
    "needed",
    "none_packets",
    "coded_packets",
    "uber_packets",
    "none_tx",
    "coded_tx",
    "uber_tx",
    "uber_tx_vs_none",
    "none_GiB",
    "coded_GiB",
    "uber_GiB",
    "coded_s",
    "uber_s",
]


def timed(run: object, repeats: int) -> tuple[object, float]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return result, statistics.median(times)


def row(nodes: int, alpha: float, samples: int, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    capacity = int(alpha * samples)
    caches = refill([np.arange(samples)] * nodes, balanced_owners(samples, nodes, rng), capacity, rng)
    caches = refill(caches, balanced_owners(samples, nodes, rng), capacity, rng)
    owners = balanced_owners(samples, nodes, rng)
    sizes = np.maximum(1, rng.lognormal(np.log(MEDIAN_BYTES), SIGMA, samples)).astype(np.int64)
    holders = holder_bits(caches, samples)
    repeats = REPEATS if nodes >= 256 else 1
    out: dict[str, object] = {
        "nodes": nodes,
        "alpha": round(alpha, 4),
        "copies": round(float(np.bitwise_count(holders).sum()) / samples, 2),
        "samples": samples,
    }
    for scheme in SCHEMES:
        packets, seconds = timed(lambda s=scheme: plan(holders, owners, s, sizes), repeats)
        cost = load(packets, sizes)  # type: ignore[arg-type]
        out[f"{scheme}_packets"] = cost.packets
        out[f"{scheme}_tx"] = cost.transmissions
        out[f"{scheme}_GiB"] = cost.bytes / 2**30
        out[f"{scheme}_s"] = seconds
        if scheme == "none":
            out["needed"] = cost.packets
    out["uber_tx_vs_none"] = out["uber_tx"] / max(1, out["none_tx"])  # type: ignore[operator]
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    rows = []
    for alpha in SEED_FRACTIONS:
        for samples in SEED_SAMPLES:
            if quick and samples > 10**5:
                continue
            progress(f"{SEED_NODES} nodes, alpha {alpha}, {samples:,} samples")
            rows.append(row(SEED_NODES, alpha, samples))
    for nodes, alpha in BEYOND:
        for samples in BEYOND_SAMPLES:
            if quick and samples > 10**5:
                continue
            progress(f"{nodes} nodes, alpha {alpha:.4f}, {samples:,} samples")
            rows.append(row(nodes, alpha, samples))
    report("coded_shuffle", rows, COLUMNS)


if __name__ == "__main__":
    main()
