"""Timing a training loop four ways: :func:`measure`.

The runs go in the only order that keeps each honest: cold first (nothing has
read the data yet), warm second (the cold run has just read it), the loader
alone third, synthetic last (it needs a batch, and taking one earlier would
warm the data it came from).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from dataquay.analyze.report import RunTiming, StallReport

Batch = TypeVar("Batch")
#: A loader (re-iterable, like a DataLoader or a list) or a function returning a fresh one.
LoaderSource = Iterable[Batch] | Callable[[], Iterable[Batch]]


class UnfitLoaderError(ValueError):
    """A loader cannot be read as a run needs: too few batches, or one pass where several are read."""


def measure(
    loader: LoaderSource[Batch],
    steps: int,
    step_fn: Callable[[Batch], object],
    *,
    warmup: int = 2,
    cold_loader: LoaderSource[Batch] | None = None,
    warm_loader: LoaderSource[Batch] | None = None,
    workers: int = 1,
    samples_per_batch: int | None = None,
    sample_bytes: float | None = None,
    epoch_samples: int | None = None,
    cache_bytes: int | None = None,
) -> StallReport:
    """Times ``steps`` training steps four ways and returns the stall breakdown.

    Args:
        loader: yields batches; iterated once cold, then twice warm (so it must
            yield the same batches each time it is iterated, in the same
            order). A function of no arguments is called for a fresh loader
            each time.
        steps: timed steps per run; each run reads ``warmup + steps`` batches.
        step_fn: the training step on one batch. It must return only when the
            step is done (on a GPU: after a synchronize or a ``.item()``), or
            its time leaks into the next wait.
        warmup: untimed steps at the start of every run (worker start-up,
            autotuning, first-touch allocation).
        cold_loader: reads data that no cache holds, instead of ``loader``'s
            first pass.
        warm_loader: reads cached data, instead of ``loader``'s later passes;
            iterated twice.
        workers: the prep workers (processes or threads) ``loader`` runs in
            parallel: a DataLoader's ``num_workers``, 1 for a loader that
            prepares in the calling thread.
        samples_per_batch: for samples per second.
        sample_bytes: the mean bytes a cold read fetches per sample.
        epoch_samples: the samples one epoch reads on this node.
        cache_bytes: a cache size to predict the fetch stall of.

    Raises:
        ValueError: a count below its minimum.
        UnfitLoaderError: a loader yields fewer than ``warmup + steps``
            batches, or is a one-shot iterator where it is read more than once.
    """
    if steps < 1 or warmup < 0 or workers < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0 and workers >= 1, not {steps}, {warmup}, {workers}")
    cold_source = loader if cold_loader is None else cold_loader
    warm_source = loader if warm_loader is None else warm_loader
    warm_name = "loader" if warm_loader is None else "warm_loader"
    _check_reiterable(warm_source, warm_name)

    first: list[Batch] = []
    cold = _run("cold", _iterate(cold_source), steps, warmup, step_fn, first)
    warm = _run("warm", _iterate(warm_source), steps, warmup, step_fn)
    loader_alone = _run("loader alone", _iterate(warm_source), steps, warmup, None)
    synthetic = _run("synthetic", itertools.repeat(first[0]), steps, warmup, step_fn)
    return StallReport(
        synthetic=synthetic,
        warm=warm,
        cold=cold,
        loader_alone=loader_alone,
        workers=workers,
        samples_per_batch=samples_per_batch,
        sample_bytes=sample_bytes,
        epoch_samples=epoch_samples,
        cache_bytes=cache_bytes,
        cpus=usable_cpus(),
    )


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_reiterable(source: LoaderSource[Any], name: str) -> None:
    if not callable(source) and iter(source) is source:
        raise UnfitLoaderError(
            f"{name} is a one-shot iterator (a generator?) but is read more than once: "
            "pass a function that returns a fresh loader, or a re-iterable such as a DataLoader"
        )


def _iterate(source: LoaderSource[Batch]) -> Iterator[Batch]:
    return iter(source() if callable(source) else source)


def _run(
    name: str,
    batches: Iterator[Batch],
    steps: int,
    warmup: int,
    step_fn: Callable[[Batch], object] | None,
    keep_first: list[Batch] | None = None,
) -> RunTiming:
    """Times ``steps`` batches after ``warmup``; ``keep_first`` receives the first batch."""
    clock = time.perf_counter
    wait = work = 0.0
    try:
        for index in range(warmup):
            batch = _next(name, batches, index, warmup + steps)
            if keep_first is not None and index == 0:
                keep_first.append(batch)
            if step_fn is not None:
                step_fn(batch)
        started = clock()
        for index in range(warmup, warmup + steps):
            asked = clock()
            batch = _next(name, batches, index, warmup + steps)
            got = clock()
            if keep_first is not None and index == 0:
                keep_first.append(batch)
            if step_fn is not None:
                step_fn(batch)
            wait += got - asked
            work += clock() - got
        seconds = clock() - started
    finally:
        # Stops a loader's background workers before the next run competes with them.
        close = getattr(batches, "close", None)
        if callable(close):
            close()
    return RunTiming(steps=steps, seconds=seconds, wait_seconds=wait, step_fn_seconds=work)


def _next(name: str, batches: Iterator[Batch], index: int, needed: int) -> Batch:
    try:
        return next(batches)
    except StopIteration:
        raise UnfitLoaderError(
            f"the {name} run's loader ran out after {index} batches; a run reads warmup + steps = {needed}"
        ) from None
