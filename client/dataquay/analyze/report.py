"""The arithmetic of a stall analysis, apart from any timing.

Everything here is a pure function of the four timed runs and of what the
caller says about its data, so the model can be checked with exact numbers and
a report can be rebuilt from its JSON. :mod:`dataquay.analyze.measure` does
the timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dataquay.client.units import format_bytes

#: A stall below this share of the step time is within the noise of a run and
#: reported as nothing to fix.
NEGLIGIBLE_SHARE = 0.05
#: step_fn may take this much longer in one run than in another before the
#: report warns that the step was not the same in all runs.
STEP_DRIFT_RATIO = 1.5
STEP_DRIFT_MIN_SECONDS = 0.001
#: A warm run this much slower than the cold one earns a warning.
SLOW_WARM_RATIO = 1.1


@dataclass(frozen=True)
class RunTiming:
    """One timed run of ``steps`` batches (after its warm-up batches).

    ``wait_seconds`` and ``step_fn_seconds`` are the parts of ``seconds``
    spent asking the loader for the next batch and in the step; the loop's
    own cost is the rest.
    """

    steps: int
    seconds: float
    wait_seconds: float
    step_fn_seconds: float

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else math.inf

    @property
    def wait_per_step(self) -> float:
        return self.wait_seconds / self.steps

    @property
    def step_fn_per_step(self) -> float:
        return self.step_fn_seconds / self.steps

    def to_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "wait_seconds": self.wait_seconds,
            "step_fn_seconds": self.step_fn_seconds,
            "seconds_per_step": self.seconds_per_step,
            "steps_per_second": self.steps_per_second,
        }


def stall_seconds(synthetic: float, warm: float, cold: float) -> tuple[float, float]:
    """(prep stall, fetch stall) per step from the seconds per step of the three runs.

    The prep stall is what data preparation adds to the bare step (warm minus
    synthetic); the fetch stall is what reading cold data adds on top (cold
    minus warm). A difference below zero is noise and counts as no stall; the
    fetch stall is measured from the slower of the two faster runs, so that
    noise in one run is not counted twice.
    """
    prep = max(0.0, warm - synthetic)
    fetch = max(0.0, cold - max(warm, synthetic))
    return prep, fetch


def workers_needed(prep_seconds_per_batch: float, step_seconds: float) -> int:
    """Prep workers that together ready one batch per step: ceil(prep / step), at least 1.

    ``prep_seconds_per_batch`` is one worker's time for one batch of cached
    data; workers are assumed to run in parallel, each on a core of its own.

    Raises:
        ValueError: ``step_seconds`` is not positive or the prep time is negative.
    """
    if step_seconds <= 0 or prep_seconds_per_batch < 0:
        raise ValueError(
            f"need a positive step time and a prep time >= 0, not {step_seconds} and {prep_seconds_per_batch}"
        )
    # The tolerance keeps a ratio like 0.3 / 0.1 = 3.0000000000000004 at 3.
    return max(1, math.ceil(prep_seconds_per_batch / step_seconds - 1e-9))


def cache_bytes_needed(sample_bytes: float, epoch_samples: int) -> int:
    """Bytes of cache that hold every sample an epoch reads: the working set.

    ``sample_bytes`` is the mean size of a sample as stored (what a cold read
    fetches), ``epoch_samples`` the samples one epoch reads on this node.

    Raises:
        ValueError: a negative size or count.
    """
    if sample_bytes < 0 or epoch_samples < 0:
        raise ValueError(f"need sample_bytes and epoch_samples >= 0, not {sample_bytes} and {epoch_samples}")
    return math.ceil(sample_bytes * epoch_samples)


def fetch_stall_with_cache(fetch_stall: float, cache_bytes: int, working_set_bytes: int) -> float:
    """The fetch stall left with a cache of ``cache_bytes``, at worst.

    A cache that keeps a fixed part of the working set (as dataquay's staged
    cache does; an LRU page cache under a fresh shuffle each epoch keeps less)
    serves that fraction h of the reads, so at most (1 - h) of the measured
    stall remains. A loader that reads ahead while the step runs hides part of
    the rest, so the real figure may be lower.
    """
    if working_set_bytes <= 0:
        return 0.0
    hit_fraction = min(1.0, cache_bytes / working_set_bytes)
    return fetch_stall * (1.0 - hit_fraction)


def sweep_prep_stall(prep_seconds_per_batch: float, step_seconds: float, cpus: int, jobs: int) -> tuple[float, float]:
    """(independent, coordinated) prep stall per step of each of ``jobs`` jobs
    of a sweep that share a node's ``cpus``, each training at ``step_seconds``.

    Independent loaders prep every batch once per job: the node does ``jobs``
    x ``prep_seconds_per_batch`` of prep per step, so each job's batch takes
    jobs x prep / cpus. Coordinated prep (:mod:`dataquay.client.coordinated`)
    preps each batch once for all of them: prep / cpus. The stall is what of
    that exceeds the step. Prep is taken to spread over the cores perfectly,
    so the figures are the least stall either way can have.

    Raises:
        ValueError: a step that is not positive, a negative prep time, or fewer than one CPU or job.
    """
    if step_seconds <= 0 or prep_seconds_per_batch < 0 or cpus < 1 or jobs < 1:
        raise ValueError(
            f"need a positive step, a prep time >= 0 and at least one CPU and job, not "
            f"{step_seconds}, {prep_seconds_per_batch}, {cpus}, {jobs}"
        )
    independent = max(0.0, jobs * prep_seconds_per_batch / cpus - step_seconds)
    coordinated = max(0.0, prep_seconds_per_batch / cpus - step_seconds)
    return independent, coordinated


@dataclass(frozen=True)
class StallReport:
    """The result of :func:`dataquay.analyze.measure`: four runs and what they imply.

    ``synthetic`` repeats one batch (the step alone), ``warm`` reads cached
    data, ``cold`` reads data no cache holds, ``loader_alone`` iterates the
    warm loader without the step (prep throughput). ``workers`` is the number
    of prep workers the loader ran with; the sizes describe one epoch's reads
    for the cache estimate and may be unknown. ``sweep_jobs`` above 1 asks
    what a sweep of that many jobs on this node would stall on prep, with
    independent loaders and with coordinated prep.
    """

    synthetic: RunTiming
    warm: RunTiming
    cold: RunTiming
    loader_alone: RunTiming
    workers: int = 1
    samples_per_batch: int | None = None
    sample_bytes: float | None = None
    epoch_samples: int | None = None
    cache_bytes: int | None = None
    cpus: int = 1
    sweep_jobs: int = 1

    @property
    def step_seconds(self) -> float:
        """The bare step: the synthetic run's seconds per step."""
        return self.synthetic.seconds_per_step

    @property
    def prep_stall_seconds(self) -> float:
        return stall_seconds(self.step_seconds, self.warm.seconds_per_step, self.cold.seconds_per_step)[0]

    @property
    def fetch_stall_seconds(self) -> float:
        return stall_seconds(self.step_seconds, self.warm.seconds_per_step, self.cold.seconds_per_step)[1]

    @property
    def total_seconds(self) -> float:
        """Step plus both stalls: a cold step with noise taken out; the base of the shares."""
        return self.step_seconds + self.prep_stall_seconds + self.fetch_stall_seconds

    def share(self, seconds: float) -> float:
        """``seconds`` as a fraction of :attr:`total_seconds`."""
        return seconds / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def prep_seconds_per_batch(self) -> float:
        """One worker's time to ready a batch of cached data: workers x the loader alone's seconds per batch."""
        return self.workers * self.loader_alone.seconds_per_step

    @property
    def workers_needed(self) -> int:
        return workers_needed(self.prep_seconds_per_batch, self.step_seconds)

    @property
    def sweep_prep_stall_seconds(self) -> tuple[float, float]:
        """(independent, coordinated) prep stall per step of each job of a sweep of ``sweep_jobs``."""
        return sweep_prep_stall(self.prep_seconds_per_batch, self.step_seconds, self.cpus, self.sweep_jobs)

    @property
    def working_set_bytes(self) -> int | None:
        """The bytes one epoch reads, when the sizes are known."""
        if self.sample_bytes is None or self.epoch_samples is None:
            return None
        return cache_bytes_needed(self.sample_bytes, self.epoch_samples)

    @property
    def cache_bytes_needed(self) -> int | None:
        """The working set, or 0 when the fetch stall is negligible; None when the sizes are unknown."""
        working_set = self.working_set_bytes
        if working_set is None:
            return None
        return working_set if self.share(self.fetch_stall_seconds) >= NEGLIGIBLE_SHARE else 0

    @property
    def fetch_stall_with_cache_seconds(self) -> float | None:
        """The fetch stall left with ``cache_bytes`` of cache, at worst; None without both sizes."""
        working_set = self.working_set_bytes
        if working_set is None or self.cache_bytes is None:
            return None
        return fetch_stall_with_cache(self.fetch_stall_seconds, self.cache_bytes, working_set)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What makes the figures doubtful, one sentence each."""
        found = []
        step_times = {
            "synthetic": self.synthetic.step_fn_per_step,
            "warm": self.warm.step_fn_per_step,
            "cold": self.cold.step_fn_per_step,
        }
        slowest = max(step_times, key=step_times.__getitem__)
        fastest = min(step_times, key=step_times.__getitem__)
        high, low = step_times[slowest], step_times[fastest]
        if high > STEP_DRIFT_RATIO * low and high - low > STEP_DRIFT_MIN_SECONDS:
            found.append(
                f"step_fn took {_ms(high)} per step in the {slowest} run but {_ms(low)} in the {fastest} run; "
                "the stalls assume the same step in every run: does step_fn wait for the device to finish "
                "(e.g. torch.cuda.synchronize())?"
            )
        warm, cold = self.warm.seconds_per_step, self.cold.seconds_per_step
        if warm > SLOW_WARM_RATIO * cold:
            found.append(
                f"the warm run was slower than the cold one ({_ms(warm)} against {_ms(cold)} per step): "
                "reading the cache costs more than reading the source here, or load on the machine disturbed a run"
            )
        if self.workers_needed > self.cpus:
            found.append(
                f"keeping up needs {self.workers_needed} prep workers but this process may use {self.cpus} CPUs: "
                "the prep stall stays unless prep gets cheaper (smaller images, decoding on the GPU)"
            )
        return tuple(found)

    def samples_per_second(self, run: RunTiming) -> float | None:
        if self.samples_per_batch is None:
            return None
        return run.steps_per_second * self.samples_per_batch

    def runs(self) -> dict[str, RunTiming]:
        return {"synthetic": self.synthetic, "warm": self.warm, "cold": self.cold, "loader_alone": self.loader_alone}

    def to_dict(self) -> dict[str, Any]:
        """Every figure of the report, JSON-safe; seconds are per step unless named otherwise."""
        runs = {
            name: {**run.to_dict(), "samples_per_second": self.samples_per_second(run)}
            for name, run in self.runs().items()
        }
        return {
            "runs": runs,
            "samples_per_batch": self.samples_per_batch,
            "step_seconds": self.step_seconds,
            "prep_stall_seconds": self.prep_stall_seconds,
            "fetch_stall_seconds": self.fetch_stall_seconds,
            "total_seconds": self.total_seconds,
            "percent": {
                "compute": 100 * self.share(self.step_seconds),
                "prep_stall": 100 * self.share(self.prep_stall_seconds),
                "fetch_stall": 100 * self.share(self.fetch_stall_seconds),
            },
            "prep": {
                "workers": self.workers,
                "seconds_per_batch_per_worker": self.prep_seconds_per_batch,
                "workers_needed": self.workers_needed,
                "cpus": self.cpus,
            },
            "cache": {
                "sample_bytes": self.sample_bytes,
                "epoch_samples": self.epoch_samples,
                "working_set_bytes": self.working_set_bytes,
                "cache_bytes_needed": self.cache_bytes_needed,
                "cache_bytes": self.cache_bytes,
                "fetch_stall_with_cache_seconds": self.fetch_stall_with_cache_seconds,
            },
            "sweep": {
                "jobs": self.sweep_jobs,
                "independent_prep_stall_seconds": self.sweep_prep_stall_seconds[0],
                "coordinated_prep_stall_seconds": self.sweep_prep_stall_seconds[1],
                "prep_cpu_seconds_per_step_independent": self.sweep_jobs * self.prep_seconds_per_batch,
                "prep_cpu_seconds_per_step_coordinated": self.prep_seconds_per_batch,
            },
            "warnings": list(self.warnings),
        }


_RUN_MEANINGS = {
    "synthetic": "one batch repeated: the step alone (no I/O, no prep)",
    "warm": "cached data: step + prep (+ the cache read)",
    "cold": "cold data: step + prep + fetch",
    "loader_alone": "the warm loader without the step",
}


def format_report(report: StallReport) -> str:
    """The report as a table of runs and a few lines of findings."""
    header = ["RUN", "STEPS/S", "SAMPLES/S", "MS/STEP", "MS WAITING", "WHAT IT MEASURES"]
    rows = []
    for name, run in report.runs().items():
        samples = report.samples_per_second(run)
        rows.append(
            [
                name.replace("_", " "),
                f"{run.steps_per_second:.1f}",
                "-" if samples is None else f"{samples:,.0f}",
                f"{1000 * run.seconds_per_step:.1f}",
                f"{1000 * run.wait_per_step:.1f}",
                _RUN_MEANINGS[name] + (f" ({_workers(report.workers)})" if name == "loader_alone" else ""),
            ]
        )
    lines = _table(rows, header)
    step, prep, fetch = report.step_seconds, report.prep_stall_seconds, report.fetch_stall_seconds
    breakdown = (
        f"per step: {_ms(report.total_seconds)} = {_ms(step)} step ({_percent(report, step)})"
        f" + {_ms(prep)} prep stall ({_percent(report, prep)})"
        f" + {_ms(fetch)} fetch stall ({_percent(report, fetch)})"
    )
    lines += ["", breakdown, "", _fetch_finding(report), _prep_finding(report)]
    if report.sweep_jobs > 1:
        lines.append(_sweep_finding(report))
    lines += [f"warning: {text}" for text in report.warnings]
    return "\n".join(lines)


def _fetch_finding(report: StallReport) -> str:
    fetch = report.fetch_stall_seconds
    head = f"fetch stall {_ms(fetch)}/step ({_percent(report, fetch)})"
    needed = report.cache_bytes_needed
    if report.share(fetch) < NEGLIGIBLE_SHARE:
        return f"{head}: negligible, no cache needed"
    if needed is None:
        return f"{head}: a cache of every sample an epoch reads removes it (pass the sample size and count for bytes)"
    assert report.sample_bytes is not None and report.epoch_samples is not None
    text = (
        f"{head}: a cache of {format_bytes(needed)} removes it "
        f"({report.epoch_samples:,} samples an epoch reads x {format_bytes(report.sample_bytes)})"
    )
    left = report.fetch_stall_with_cache_seconds
    if left is not None and report.cache_bytes is not None:
        text += f"; with {format_bytes(report.cache_bytes)} of cache, at most {_ms(left)}/step remains"
    return text


def _prep_finding(report: StallReport) -> str:
    prep = report.prep_stall_seconds
    head = f"prep stall {_ms(prep)}/step ({_percent(report, prep)})"
    verdict = "negligible" if report.share(prep) < NEGLIGIBLE_SHARE else f"measured with {_workers(report.workers)}"
    return (
        f"{head}: {verdict}; prep workers needed to keep up with the step: {report.workers_needed} "
        f"(one worker readies a batch in {_ms(report.prep_seconds_per_batch)}, the step takes "
        f"{_ms(report.step_seconds)}; {report.cpus} CPUs here)"
    )


def _sweep_finding(report: StallReport) -> str:
    independent, coordinated = report.sweep_prep_stall_seconds
    jobs = report.sweep_jobs
    return (
        f"a sweep of {jobs} jobs on this node ({report.cpus} CPUs): prep stall {_ms(independent)}/step per job "
        f"with independent loaders, {_ms(coordinated)} with coordinated prep (ds.coordinated), which saves "
        f"{_ms(independent - coordinated)}/step and preps each batch once instead of {jobs} times"
    )


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _percent(report: StallReport, seconds: float) -> str:
    return f"{100 * report.share(seconds):.0f} %"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
