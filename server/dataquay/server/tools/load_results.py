"""What a load run measured, and its summary for a terminal: the types
:func:`dataquay.server.tools.loadgen.run_load` returns and ``dataquay bench
load`` prints and writes to load.json."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MiB = 1 << 20


@dataclass(frozen=True)
class Figures:
    """Counts, batch latency and throughput of a group of clients."""

    clients: int
    batches: int
    #: Samples received; ``verified`` of them had the right id and bytes.
    samples: int
    verified: int
    bytes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    samples_per_s: float
    mb_per_s: float


@dataclass(frozen=True)
class RssSample:
    """The daemon's resident memory at ``t`` seconds into the run, in bytes."""

    t: float
    vm_rss: int
    rss_anon: int


@dataclass(frozen=True)
class LoadResult:
    """One run: its figures in total and per transport, its errors by kind,
    where the samples came from, and the daemon's memory over time."""

    dataset: str
    num_samples: int
    processes: int
    threads: int
    batch: int
    #: Wall time from the start signal until the last client stopped.
    seconds: float
    total: Figures
    by_transport: dict[str, Figures]
    #: Samples by the tier the daemon served them from (cache, peer, pfs).
    tiers: dict[str, int]
    errors: dict[str, int]
    #: The first message of each kind of error.
    error_examples: dict[str, str]
    warmup_seconds: float
    rss: list[RssSample]
    #: Growth after the warm-up: the median of the last quarter of the samples
    #: taken between the warm-up and the end of the run's duration, minus the
    #: median of the first quarter. Medians, because the bytes of the batches
    #: in flight swing single samples by tens of MiB; 0 without samples.
    rss_anon_growth: int
    vm_rss_growth: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def growth(values: list[int]) -> int:
    """The median of the last quarter of ``values`` minus that of the first; 0 without values."""
    if not values:
        return 0
    quarter = max(1, len(values) // 4)
    return int(np.median(values[-quarter:]) - np.median(values[:quarter]))


def figures(counts: list[dict[str, Any]], seconds: float) -> Figures:
    """The figures of the clients whose counts (as workers report them) are ``counts``, over ``seconds``."""
    latencies = np.concatenate(
        [np.frombuffer(base64.b64decode(c["latencies"]), dtype=np.float32) for c in counts] or [np.zeros(0, np.float32)]
    )
    p50, p99, top = (np.percentile(latencies, [50, 99, 100]) * 1e3).tolist() if len(latencies) else (0.0, 0.0, 0.0)
    samples = sum(c["samples"] for c in counts)
    nbytes = sum(c["bytes"] for c in counts)
    return Figures(
        clients=sum(c["clients"] for c in counts),
        batches=sum(c["batches"] for c in counts),
        samples=samples,
        verified=sum(c["verified"] for c in counts),
        bytes=nbytes,
        p50_ms=p50,
        p99_ms=p99,
        max_ms=top,
        samples_per_s=samples / seconds if seconds else 0.0,
        mb_per_s=nbytes / 1e6 / seconds if seconds else 0.0,
    )


def format_summary(result: LoadResult) -> str:
    """One table (a row per transport and one for all clients), then errors,
    tiers and the daemon's memory, for a terminal."""
    header = (
        "transport",
        "clients",
        "batches",
        "samples",
        "verified",
        "p50 ms",
        "p99 ms",
        "max ms",
        "samples/s",
        "MB/s",
    )
    rows = [
        (
            name,
            f.clients,
            f.batches,
            f.samples,
            f.verified,
            f"{f.p50_ms:.1f}",
            f"{f.p99_ms:.1f}",
            f"{f.max_ms:.1f}",
            f"{f.samples_per_s:,.0f}",
            f"{f.mb_per_s:,.1f}",
        )
        for name, f in [*result.by_transport.items(), ("all", result.total)]
    ]
    cells = [list(map(str, header)), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    errors = ", ".join(
        f"{kind} x{n} (first: {result.error_examples.get(kind, '')})" for kind, n in sorted(result.errors.items())
    )
    served = sum(result.tiers.values()) or 1
    lines.append(
        f"{result.processes} processes x {result.threads} threads, batches of {result.batch}, {result.seconds:.1f} s"
    )
    lines.append(f"errors: {errors or 'none'}")
    lines.append("served from: " + ", ".join(f"{t} {100 * n / served:.0f}%" for t, n in sorted(result.tiers.items())))
    if result.rss:
        first, last = result.rss[0], result.rss[-1]
        lines.append(
            f"daemon RSS: {first.vm_rss / MiB:.1f} -> {last.vm_rss / MiB:.1f} MiB "
            f"(anon {first.rss_anon / MiB:.1f} -> {last.rss_anon / MiB:.1f} MiB); growth after the "
            f"{result.warmup_seconds:.0f} s warm-up {result.vm_rss_growth / MiB:+.1f} MiB "
            f"(anon {result.rss_anon_growth / MiB:+.1f} MiB), medians of its first and last quarter"
        )
    return "\n".join(lines)
