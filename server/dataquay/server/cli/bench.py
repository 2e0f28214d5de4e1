"""``dataquay bench``: the data-stall benchmark of :mod:`dataquay.server.benchmark`."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_bench(args: argparse.Namespace) -> None:
    from dataquay.server.benchmark import main

    main(args.quick, Path(args.out))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="how long trainers wait for data: the PFS directly, a page cache and every dataquay mode",
    )
    bench.add_argument("--quick", action="store_true", help="a smaller dataset and 3 epochs (a few minutes)")
    bench.add_argument("--out", default="bench/results", help="where stall.json and stall.png go")
    bench.set_defaults(func=cmd_bench)
