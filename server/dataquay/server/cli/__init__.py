"""``dataquay``: the command line of the daemon, the directory, datasets, jobs
and local clusters.

Each module of this package adds one group of commands to the parser.

Exit codes: 0 success, 1 the operation failed (one line on stderr says why),
2 bad usage.
"""

# ruff: noqa: E402 (numpy is loaded first, on dataquay's terms: see one_blas_thread)
from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence

from dataquay.server.cli.one_blas_thread import import_numpy

import_numpy()  # before any command's module loads it

from dataquay.server import __version__
from dataquay.server.cli import analyze, bench, cache, cluster, config, directory, node, simulate, slurm, token
from dataquay.server.cli.common import CliError
from dataquay.server.cli.parser import Parser
from dataquay.server.errors import DataquayError

COMMAND_GROUPS = (node, cache, directory, cluster, config, token, slurm, simulate, analyze, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dataquay", description="Stage training data next to the GPUs.")
    parser.add_argument("--version", action="version", version=f"dataquay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except (CliError, DataquayError) as exc:
        print(f"dataquay: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`dataquay status | head`): end as a tool killed by
        # SIGPIPE would, quietly, with nothing left to flush into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return 0
