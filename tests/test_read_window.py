"""The staging window against model PFSs: one whose reads wait on latency
(more in flight read faster), one the page cache answers (more in flight
only contend), and a writer that falls behind."""

from __future__ import annotations

from collections.abc import Callable

from dataquay.server.node.reads.read_window import RETRY_JOBS, ReadWindow

JOB_BYTES = 4 << 20


def run(window: ReadWindow, rate: Callable[[int], float], jobs: int, fill: float = 0.0) -> list[int]:
    """Sizes the window takes over ``jobs`` completions, each job's time set by ``rate(size)`` (bytes/s)."""
    now, sizes = 0.0, []
    for _ in range(jobs):
        now += JOB_BYTES / rate(window.size)
        sizes.append(window.completed(now, JOB_BYTES, fill))
    return sizes


def latency_bound(size: int) -> float:
    """Each job waits 40 ms on the PFS: the rate grows with the jobs in flight."""
    return size * JOB_BYTES / 0.040


def cpu_bound(size: int) -> float:
    """The page cache: one job's worth of CPU at a time, and every extra thread costs a little."""
    return 2e9 / (1 + 0.05 * (size - 1))


def test_a_latency_bound_pfs_gets_every_thread() -> None:
    window = ReadWindow(most=16)
    sizes = run(window, latency_bound, 200)
    assert sizes[-1] == 16
    assert sizes.index(16) < 60  # it got there within the first few spans


def test_a_pfs_that_waits_for_nothing_keeps_few_jobs_in_flight() -> None:
    window = ReadWindow(most=16)
    sizes = run(window, cpu_bound, RETRY_JOBS - 20)
    assert max(sizes) <= 4  # tried once, and it did not pay
    assert sizes[-1] <= 2 and sizes.count(4) < 20


def test_a_size_that_did_not_pay_is_tried_again_later() -> None:
    window = ReadWindow(most=16)
    sizes = run(window, cpu_bound, 3 * RETRY_JOBS)
    probes = [k for k in range(1, len(sizes)) if sizes[k] > sizes[k - 1]]
    assert len(probes) >= 3  # the first try and a retry after each RETRY_JOBS
    assert max(sizes) <= 4


def test_a_pfs_that_slows_under_load_is_probed_again_and_followed() -> None:
    window = ReadWindow(most=16)
    run(window, cpu_bound, RETRY_JOBS)
    assert window.size <= 2
    sizes = run(window, latency_bound, 2 * RETRY_JOBS)  # its latency grew: more in flight pays now
    assert sizes[-1] == 16


def test_reads_ahead_of_the_writer_halve_the_window_whatever_the_rate() -> None:
    window = ReadWindow(most=16)
    run(window, latency_bound, 100)
    assert window.size == 16
    sizes = run(window, latency_bound, 5, fill=0.5)
    assert sizes == [8, 4, 2, 1, 1]
    assert ReadWindow(most=1, size=2).size == 1
