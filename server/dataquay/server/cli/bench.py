"""``dataquay bench``: the data-stall benchmark of :mod:`dataquay.server.tools.data_stall`;
``dataquay bench load``, the load run of :mod:`dataquay.server.tools.loadgen`; and
``dataquay bench overflow``, a dataset larger than the caches (:mod:`dataquay.server.tools.overflow_stall`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_bench(args: argparse.Namespace) -> None:
    from dataquay.server.tools.data_stall import main

    main(args.quick, Path(args.out))


def cmd_load(args: argparse.Namespace) -> None:
    from dataquay.server.tools.load_results import format_summary
    from dataquay.server.tools.loadgen import bench_load

    result, staged = bench_load(
        args.seconds,
        args.processes,
        args.threads,
        args.batch,
        samples=args.samples,
        cached=args.cached,
        out_dir=Path(args.out),
        progress=not args.quiet,
    )
    print(f"{staged.done_samples} of {staged.total_samples} samples cached, the rest read from the PFS")
    print(format_summary(result))
    print(f"(results in {Path(args.out) / 'load.json'})")


def cmd_overflow(args: argparse.Namespace) -> None:
    from dataquay.server.tools.overflow_stall import main

    main(args.quick, Path(args.out))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="how long trainers wait for data: the PFS directly, a page cache and every dataquay mode",
        description="Without a BENCHMARK: the data-stall benchmark (stall.json; stall.png with matplotlib). "
        "`dataquay bench load`: many clients reading from one daemon (load.json). "
        "`dataquay bench overflow`: a dataset larger than the caches (overflow.json).",
    )
    bench.add_argument("--quick", action="store_true", help="a smaller dataset and 3 epochs (a few minutes)")
    bench.add_argument(
        "--out", default="bench/results", help="where stall.json and stall.png go (default bench/results)"
    )
    bench.set_defaults(func=cmd_bench)
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    load = benchmarks.add_parser(
        "load", help="many clients reading random batches from one daemon: errors, latency, throughput, daemon memory"
    )
    load.add_argument("--seconds", type=float, default=60.0, help="how long the clients read (default 60)")
    load.add_argument("--processes", type=int, default=8, help="client processes (default 8)")
    load.add_argument("--threads", type=int, default=8, help="clients per process (default 8)")
    load.add_argument("--batch", type=int, default=32, help="ids per read (default 32)")
    load.add_argument("--samples", type=int, default=4096, help="samples of the synthetic dataset (default 4096)")
    load.add_argument(
        "--cached",
        type=float,
        default=0.75,
        help="share of the dataset the cache holds; the rest is read from the PFS (default 0.75)",
    )
    # SUPPRESS: `dataquay bench --out DIR load` keeps DIR.
    load.add_argument("--out", default=argparse.SUPPRESS, help="where load.json goes (default bench/results)")
    load.add_argument("--quiet", action="store_true", help="no progress bar")
    load.set_defaults(func=cmd_load)
    overflow = benchmarks.add_parser(
        "overflow",
        help="a dataset 1.5x the caches behind a capped PFS: the stall with the overflow prefetched for the "
        "ranks, read on demand, and read directly",
    )
    overflow.add_argument("--quick", action="store_true", help="half the dataset, shorter epochs (under a minute)")
    overflow.add_argument("--out", default=argparse.SUPPRESS, help="where overflow.json goes (default bench/results)")
    overflow.set_defaults(func=cmd_overflow)
