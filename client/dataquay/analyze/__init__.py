"""Where a training loop's time goes: compute, data preparation or fetching.

A slow epoch does not say why it is slow. The differential method (after
DS-Analyzer, Mohan et al., VLDB 2021) runs the same loop with one cost added
at a time and reads each stall off as the drop in rate::

    from dataquay.analyze import format_report, measure

    report = measure(make_loader, steps=50, step_fn=train_step, workers=8, samples_per_batch=256,
                     sample_bytes=110_000, epoch_samples=1_281_167)
    print(format_report(report))

The runs, each ``warmup`` untimed steps then ``steps`` timed ones:

1. cold: the loader's first pass, reading data no cache holds. The loop as
   it runs against the PFS: step + prep + fetch.
2. warm: a second pass over the same batches, now in the page cache (or the
   dataquay cache, or whatever ``warm_loader`` reads): step + prep.
3. loader alone: the warm loader iterated without the step: how fast prep
   can go with the loader's ``workers``.
4. synthetic: the first batch over and over, no loader at all: the step
   alone, the rate the GPU sets.

prep stall = warm - synthetic, fetch stall = cold - warm, per step. A stall
is what a loader fails to hide behind the step, so a loader that reads and
prepares ahead shows smaller stalls than the work it does; that is the point.

What a single Python process can and cannot make honest:

- Cold must really be cold. Nothing here can empty the OS page cache (that
  needs root), so the first pass is cold only if the data was not read
  recently on this node; a file system's server-side caches are beyond reach
  too. Pass ``cold_loader`` to read from somewhere known to be cold.
  ``dataquay analyze`` drops the page cache of the files it reads first.
- Warm must read what cold read. The default second pass does only if the
  loader yields the same batches each pass: give it a fixed order (a
  shuffling DataLoader draws new samples each pass), or a ``warm_loader``.
- step_fn must end when the step does: CUDA calls return before the work
  is done, so synchronize (or read a loss value) inside it. The synthetic
  run hands it the same batch object again and again, so it must not consume
  or change the batch; a copy to the device inside it counts as the step.
- Workers scale linearly: one worker's prep time per batch is taken as
  ``workers`` x the loader-alone time per batch, and the workers needed to
  keep up as ceil(that / step time), each worker on a core of its own.
- The cache that removes the fetch stall is the working set, every sample one
  epoch reads on this node (``sample_bytes`` x ``epoch_samples``). A cache
  holding a fraction h of it leaves at most (1 - h) of the fetch stall when
  it keeps a fixed part of the data (dataquay's staged cache); an LRU page
  cache under a fresh shuffle each epoch evicts what the epoch needs next
  and does worse.
- A sweep of k jobs on one node (``sweep_jobs``) preps every batch k times
  with independent loaders; coordinated prep preps it once. Its figures
  take prep to spread over the node's CPUs perfectly.
"""

from dataquay.analyze.measure import LoaderSource, UnfitLoaderError, measure, usable_cpus
from dataquay.analyze.report import (
    RunTiming,
    StallReport,
    cache_bytes_needed,
    fetch_stall_with_cache,
    format_report,
    stall_seconds,
    sweep_prep_stall,
    workers_needed,
)

__all__ = [
    "LoaderSource",
    "RunTiming",
    "StallReport",
    "UnfitLoaderError",
    "cache_bytes_needed",
    "fetch_stall_with_cache",
    "format_report",
    "measure",
    "stall_seconds",
    "sweep_prep_stall",
    "usable_cpus",
    "workers_needed",
]
