"""``dataquay analyze``: how much of a step is spent waiting for data, and why.

The measurement and the model are :mod:`dataquay.analyze`'s; this module
builds the loaders to measure and prints the report.

Two kinds of loader:

- A registered dataset (``dataquay analyze NAME``): batches of random sample
  ids, read cold straight from the PFS with :class:`PfsReader` (after asking
  the kernel to drop those files from the page cache) and warm through this
  node's daemon (primed first, so every sample is a cache hit). Prep and the
  step are stand-ins of a given length: the question is what the PFS costs
  this dataset on this node, next to a step you know.
- A loader of your own (``--loader MODULE:FUNCTION``): the function is called
  with no arguments for every pass and returns a re-iterable of batches.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

import dataquay.client as dq
from dataquay.analyze import StallReport, UnfitLoaderError, format_report, measure
from dataquay.client.manifest import Manifest
from dataquay.client.pfs import PfsReader
from dataquay.server.cli.common import CliError, add_addr
from dataquay.server.sizes import parse_size

#: Tiers of :meth:`dataquay.client.Client.stats` that mean a sample was not in any cache.
UNCACHED_TIERS = ("pfs", "fallback")
#: How long the warm batches may take to land in the cache after the priming read.
PRIME_TIMEOUT_S = 10.0
PRIME_RETRY_S = 0.2

Batch = list[bytes]


class BatchLoader:
    """The batches ``ids`` read by ``read``, each followed by ``prep_seconds`` of
    stand-in prep, on ``workers`` threads that keep two batches each in flight
    (a DataLoader's default prefetch).

    Prep is a wait, not work: each worker behaves as if it had a core of its
    own, which is what the workers-needed estimate assumes anyway.
    """

    def __init__(
        self, ids: Sequence[np.ndarray], read: Callable[[np.ndarray], Batch], prep_seconds: float, workers: int
    ) -> None:
        self._ids = ids
        self._read = read
        self._prep_seconds = prep_seconds
        self._workers = workers

    def _load(self, ids: np.ndarray) -> Batch:
        batch = self._read(ids)
        if self._prep_seconds > 0:
            time.sleep(self._prep_seconds)
        return batch

    def __iter__(self) -> Iterator[Batch]:
        if self._workers == 1:
            for ids in self._ids:
                yield self._load(ids)
            return
        todo = iter(self._ids)
        with ThreadPoolExecutor(self._workers, thread_name_prefix="dataquay-analyze") as pool:
            pending: collections.deque[Future[Batch]] = collections.deque(
                pool.submit(self._load, ids) for ids in itertools.islice(todo, 2 * self._workers)
            )
            try:
                while pending:
                    batch = pending.popleft().result()
                    following = next(todo, None)
                    if following is not None:
                        pending.append(pool.submit(self._load, following))
                    yield batch
            finally:
                for future in pending:
                    future.cancel()


def drop_page_cache(manifest: Manifest, ids: np.ndarray) -> list[str]:
    """Asks the kernel to forget the cached pages of the files holding ``ids``.

    Returns a note for each file it could not (an empty list when all went
    well). Unprivileged and per file, unlike ``drop_caches``; the kernel keeps
    pages that are dirty or mapped, and a file server's own cache stays.
    """
    if not hasattr(os, "posix_fadvise"):
        return ["this OS has no posix_fadvise: cold reads may come from the page cache"]
    root = manifest.root if manifest.root.endswith("/") else manifest.root + "/"
    notes = []
    for index in np.unique(manifest.sample_path[ids]).tolist():
        path = root + manifest.path(index)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as exc:
            notes.append(f"cannot drop {path} from the page cache ({exc.strerror}): its cold reads may be warm")
    return notes


def _uncached_reads(client: dq.Client, read: Callable[[], object]) -> int:
    """Samples that ``read`` got from no cache, by the client's counters."""
    before = client.stats().samples
    read()
    after = client.stats().samples
    return sum(after[tier] - before[tier] for tier in UNCACHED_TIERS)


def prime_cache(client: dq.Client, dataset: dq.Dataset, batches: Sequence[np.ndarray]) -> int:
    """Reads ``batches`` through the daemon until all are cache hits or the time is up.

    The daemon caches what it reads from the PFS in the background, so the
    first pass is followed by checks until a whole pass hits. Returns the
    samples the last pass still missed.
    """

    def read_all() -> None:
        for ids in batches:
            dataset.get_batch(ids)

    read_all()
    deadline = time.monotonic() + PRIME_TIMEOUT_S
    while (missed := _uncached_reads(client, read_all)) and time.monotonic() < deadline:
        time.sleep(PRIME_RETRY_S)
    return missed


def _entry_point(spec: str, flag: str) -> Callable[..., Any]:
    """The callable named by ``MODULE:FUNCTION``, imported as ``python -m`` would (the working directory first)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CliError(f"{flag} takes MODULE:FUNCTION, not {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"{flag} {spec}: cannot import {module_name}: {exc}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise CliError(f"{flag} {spec}: {module_name} has no {attr}") from None
    if not callable(target):
        raise CliError(f"{flag} {spec}: {attr} is not callable")
    return target


def _step_fn(args: argparse.Namespace) -> Callable[[Any], object]:
    if (args.step_ms is None) == (args.step_fn is None):
        raise CliError("give the training step as one of --step-ms or --step-fn")
    if args.step_fn is not None:
        return _entry_point(args.step_fn, "--step-fn")
    if args.step_ms <= 0:
        raise CliError(f"--step-ms must be positive, not {args.step_ms}")
    step_seconds = args.step_ms / 1000

    def step(batch: object) -> None:
        time.sleep(step_seconds)

    return step


def _measure(**kwargs: Any) -> StallReport:
    try:
        return measure(**kwargs)
    except UnfitLoaderError as exc:
        raise CliError(str(exc)) from None


def _analyze_dataset(
    args: argparse.Namespace, step_fn: Callable[[Any], object], sizes: dict[str, int | None]
) -> tuple[StallReport, list[str]]:
    if args.batch_size is None or args.batch_size < 1:
        raise CliError("analyzing a dataset needs --batch-size B (B >= 1)")
    if args.prep_ms < 0:
        raise CliError(f"--prep-ms must be at least 0, not {args.prep_ms}")
    notes: list[str] = []
    with dq.connect(args.addr) as client:
        dataset = client.dataset(args.dataset)
        manifest = dataset.manifest
        needed = (args.warmup + args.steps) * args.batch_size
        if needed > len(dataset):
            raise CliError(
                f"--warmup {args.warmup} + --steps {args.steps} batches of {args.batch_size} read {needed:,} "
                f"samples but {args.dataset!r} has {len(dataset):,}: lower them"
            )
        ids = np.random.default_rng(args.seed).permutation(len(dataset))[:needed]
        batches = [ids[start : start + args.batch_size] for start in range(0, needed, args.batch_size)]

        missed = prime_cache(client, dataset, batches)
        notes += drop_page_cache(manifest, ids)
        prep_seconds = args.prep_ms / 1000
        pfs = PfsReader(manifest, args.dataset)
        before = client.stats().samples
        report = _measure(
            loader=BatchLoader(batches, dataset.get_batch, prep_seconds, args.workers),
            cold_loader=BatchLoader(batches, pfs.read, prep_seconds, args.workers),
            steps=args.steps,
            step_fn=step_fn,
            warmup=args.warmup,
            workers=args.workers,
            samples_per_batch=args.batch_size,
            sample_bytes=sizes["sample_bytes"] or manifest.total_bytes / len(dataset),
            epoch_samples=sizes["epoch_samples"] or len(dataset),
            cache_bytes=sizes["cache_bytes"],
        )
        after = client.stats().samples
    uncached = sum(after[tier] - before[tier] for tier in UNCACHED_TIERS)
    if missed or uncached:
        notes.append(
            f"{max(missed, uncached):,} samples of the warm runs came from the PFS, not a cache: "
            "is the cache full? (`dataquay status`)"
        )
    return report, notes


def _analyze_loader(
    args: argparse.Namespace, step_fn: Callable[[Any], object], sizes: dict[str, int | None]
) -> StallReport:
    return _measure(
        loader=_entry_point(args.loader, "--loader"),
        cold_loader=None if args.cold_loader is None else _entry_point(args.cold_loader, "--cold-loader"),
        warm_loader=None if args.warm_loader is None else _entry_point(args.warm_loader, "--warm-loader"),
        steps=args.steps,
        step_fn=step_fn,
        warmup=args.warmup,
        workers=args.workers,
        samples_per_batch=args.batch_size,
        **sizes,
    )


def _inputs(args: argparse.Namespace, sizes: dict[str, int | None]) -> dict[str, Any]:
    names = (
        "dataset",
        "loader",
        "cold_loader",
        "warm_loader",
        "steps",
        "warmup",
        "step_ms",
        "step_fn",
        "batch_size",
        "prep_ms",
        "workers",
        "seed",
        "sweep_jobs",
    )
    return {name: getattr(args, name) for name in names} | sizes


def _describe(args: argparse.Namespace) -> str:
    step = f"a {args.step_ms:g} ms stand-in step" if args.step_fn is None else f"step {args.step_fn}"
    workers = f"{args.workers} worker" + ("" if args.workers == 1 else "s")
    if args.dataset is None:
        return f"loader {args.loader}, {step}, {workers}"
    return (
        f"dataset {args.dataset!r}: {args.warmup + args.steps} batches of {args.batch_size} random samples "
        f"(seed {args.seed}), {step}, {args.prep_ms:g} ms stand-in prep on {workers}; "
        "cold = the PFS read directly, warm = through this node's daemon"
    )


def cmd_analyze(args: argparse.Namespace) -> None:
    if (args.dataset is None) == (args.loader is None):
        raise CliError("name a dataset or give --loader MODULE:FUNCTION (one of the two)")
    if args.steps < 1 or args.warmup < 0 or args.workers < 1 or args.sweep_jobs < 1:
        raise CliError("--steps, --workers and --sweep-jobs must be at least 1 and --warmup at least 0")
    if args.dataset is not None and (args.cold_loader or args.warm_loader):
        raise CliError("--cold-loader and --warm-loader go with --loader, not with a dataset")
    sizes = {
        "sample_bytes": None if args.sample_bytes is None else parse_size(args.sample_bytes, "--sample-bytes"),
        "epoch_samples": args.epoch_samples,
        "cache_bytes": None if args.cache_bytes is None else parse_size(args.cache_bytes, "--cache-bytes"),
    }
    step_fn = _step_fn(args)
    if args.dataset is not None:
        report, notes = _analyze_dataset(args, step_fn, sizes)
    else:
        report, notes = _analyze_loader(args, step_fn, sizes), []
    report = dataclasses.replace(report, sweep_jobs=args.sweep_jobs)
    if args.json:
        document = {"inputs": _inputs(args, sizes), **report.to_dict()}
        document["warnings"] += notes
        print(json.dumps(document, indent=2))
        return
    print(_describe(args) + "\n")
    print(format_report(report))
    for note in notes:
        print(f"warning: {note}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "analyze",
        help="how much of a training step waits for data: the prep and fetch stalls, and what removes them",
        description="Times the step alone (one batch repeated), with cached data and with cold data, and "
        "reports the prep stall (cached minus step alone), the fetch stall (cold minus cached), the cache "
        "that removes the fetch stall and the prep workers that remove the prep stall.",
    )
    p.add_argument("dataset", nargs="?", help="a registered dataset: cold from the PFS, warm through the daemon")
    entry = "MODULE:FUNCTION"
    p.add_argument("--loader", metavar=entry, help="a function returning a loader of your own (re-iterable batches)")
    p.add_argument("--cold-loader", metavar=entry, help="the loader of the cold run (default: --loader's first pass)")
    p.add_argument("--warm-loader", metavar=entry, help="the loader of the warm runs (default: --loader's next passes)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per run (default 50)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run (default 2)")
    p.add_argument("--step-ms", type=float, help="the training step's time, as a stand-in wait of this many ms")
    p.add_argument("--step-fn", metavar=entry, help="a function taking a batch: the training step itself")
    p.add_argument("--batch-size", type=int, help="samples per batch (a dataset needs it; a loader's for samples/s)")
    p.add_argument("--prep-ms", type=float, default=0.0, help="dataset: stand-in prep per batch and worker (default 0)")
    p.add_argument("--workers", type=int, default=1, help="prep workers the loader runs in parallel (default 1)")
    p.add_argument("--seed", type=int, default=0, help="dataset: seed of the random sample order (default 0)")
    p.add_argument(
        "--sweep-jobs",
        type=int,
        default=1,
        help="jobs of a sweep on this node: the prep stall coordinated prep would save them (default 1)",
    )
    p.add_argument("--sample-bytes", help="mean bytes per sample as stored (dataset: from the manifest)")
    p.add_argument("--epoch-samples", type=int, help="samples one epoch reads on this node (dataset: all)")
    p.add_argument("--cache-bytes", help="a cache size (e.g. 200G) to predict the fetch stall with")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    add_addr(p)
    p.set_defaults(func=cmd_analyze)
