"""Prometheus metrics of the directory itself.

Everything is read from the live state at scrape time by one collector, so
the heartbeat handler pays for no metric update of its own: the state already
counts heartbeats, and the datagram endpoint counts the beats it refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dataquay.server.directory.beats import REFUSALS
from dataquay.server.directory.state import DirectoryState
from dataquay.server.planning.absences import absent_at


class _DirectoryCollector(Collector):
    def __init__(
        self,
        state: Callable[[], DirectoryState],
        datasets: Callable[[], int],
        beats_refused: Callable[[], Mapping[str, int]],
        node_lists: Callable[[], Mapping[str, int]],
    ) -> None:
        self._state = state
        self._datasets = datasets
        self._beats_refused = beats_refused
        self._node_lists = node_lists

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        up, down = state.node_counts()
        nodes = GaugeMetricFamily("dataquay_directory_nodes", "Registered nodes, by lease state", labels=["state"])
        nodes.add_metric(["up"], up)
        nodes.add_metric(["down"], down)
        yield nodes
        yield CounterMetricFamily(
            "dataquay_directory_heartbeats", "Heartbeats received, from known and unknown nodes", value=state.heartbeats
        )
        refused = CounterMetricFamily(
            "dataquay_directory_heartbeats_refused",
            "Heartbeats refused, by reason (signature, format, malformed, stale, replayed: datagrams; "
            "holder: datagrams or RPCs not from the node name's registered holder)",
            labels=["reason"],
        )
        counts = self._beats_refused()
        for reason in REFUSALS:
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        lists = CounterMetricFamily(
            "dataquay_directory_node_lists",
            "ListNodes replies, by kind: the whole list, or the changes since the caller's node-set version",
            labels=["kind"],
        )
        sent = self._node_lists()
        for kind in ("full", "delta"):
            lists.add_metric([kind], sent.get(kind, 0))
        yield lists
        yield GaugeMetricFamily("dataquay_directory_jobs", "Job records", value=len(state.jobs()))
        absent = GaugeMetricFamily(
            "dataquay_directory_absent_nodes",
            "Nodes a job whose owners move leaves out of its holders at its current epoch (lost longer than "
            "--heal-after; the others hold their share), by job; jobs with none are not listed",
            labels=["job"],
        )
        for job in state.jobs():
            if count := len(absent_at(job.absences, job.epoch)):
                absent.add_metric([job.spec.job_id], count)
        yield absent
        yield CounterMetricFamily(
            "dataquay_directory_jobs_expired",
            "Jobs dropped for being idle longer than --job-ttl",
            value=state.jobs_expired,
        )
        yield GaugeMetricFamily("dataquay_directory_datasets", "Registered datasets", value=self._datasets())


def directory_metrics(
    state: Callable[[], DirectoryState],
    datasets: Callable[[], int],
    beats_refused: Callable[[], Mapping[str, int]],
    node_lists: Callable[[], Mapping[str, int]],
) -> CollectorRegistry:
    """A registry of the directory's metrics, read live from ``state``, the
    refusal counts and the counts of ListNodes replies."""
    registry = CollectorRegistry()
    registry.register(_DirectoryCollector(state, datasets, beats_refused, node_lists))
    return registry
