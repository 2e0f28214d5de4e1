"""Prometheus metrics of one daemon.

Events (reads, bytes, latencies) are plain counters and histograms; state
(cache fill, staging progress) is read live by one collector at scrape time, so
it can never drift from the truth, from the daemon's snapshot
(:mod:`dataquay.server.node.snapshot`), which the Stats RPC answers from too.
The endpoint is served by
:class:`dataquay.server.http_server.HttpServer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dataquay.client.wire.tiers import SERVED_TIERS

if TYPE_CHECKING:
    from dataquay.server.node.snapshot import LiveState

#: Where this daemon served a sample from: its own cache, another daemon's, the PFS.
TIERS = tuple(SERVED_TIERS.values())

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _cache_manager_metrics(state: LiveState) -> Iterator[Metric]:
    """What ``dataquay status`` and ``dataquay cache ls`` show of the cache manager, from the same state."""
    charged = GaugeMetricFamily(
        "dataquay_cache_charged_bytes", "Payload bytes of the cache charged to a user or a group", labels=["kind", "id"]
    )
    quota = GaugeMetricFamily(
        "dataquay_cache_quota_bytes", "Cache quota of a user or a group (cache_quotas)", labels=["kind", "id"]
    )
    for use in state.cache_charges:
        charged.add_metric([use.kind, str(use.ident)], use.nbytes)
        if use.quota:
            quota.add_metric([use.kind, str(use.ident)], use.quota)
    held = GaugeMetricFamily(
        "dataquay_cache_dataset_bytes", "Payload bytes a dataset version holds in the cache", labels=["cache_db"]
    )
    last_use = GaugeMetricFamily(
        "dataquay_cache_dataset_last_use_seconds",
        "Unix time a dataset version was last staged, read or exchanged into",
        labels=["cache_db"],
    )
    for row in sorted(state.cache_holdings, key=lambda row: row.cache_db):
        held.add_metric([row.cache_db], row.nbytes)
        last_use.add_metric([row.cache_db], row.last_use)
    yield from (charged, quota, held, last_use)
    yield CounterMetricFamily(
        "dataquay_cache_evicted_samples", "Samples the cache manager evicted to make room", value=state.cache_evicted[0]
    )
    yield CounterMetricFamily(
        "dataquay_cache_evicted_bytes", "Payload bytes of dataquay_cache_evicted_samples", value=state.cache_evicted[1]
    )


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], LiveState]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        state = self._snapshot()
        yield GaugeMetricFamily(
            "dataquay_cache_bytes",
            "Bytes of the cache's pages in use (deletes free them)",
            value=state.cache_used_bytes,
        )
        yield GaugeMetricFamily(
            "dataquay_cache_capacity_bytes", "Configured cache capacity", value=state.cache_capacity_bytes
        )
        yield GaugeMetricFamily("dataquay_cache_entries", "Samples held in the cache", value=state.cache_entries)
        yield GaugeMetricFamily(
            "dataquay_cache_full", "1 while the cache is at capacity and inserts stop", value=int(state.cache_full)
        )
        yield GaugeMetricFamily(
            "dataquay_cache_disk_full",
            "1 when the cache stopped inserting because its file system has no space left",
            value=int(state.cache_disk_full),
        )
        yield CounterMetricFamily(
            "dataquay_cache_corrupt_repaired",
            "Cached values that failed their checksum and were re-read from the PFS",
            value=state.corrupt_repaired,
        )
        yield CounterMetricFamily(
            "dataquay_cache_inserts_dropped",
            "Samples not inserted because the cache was full or its write queue was",
            value=state.inserts_dropped,
        )
        yield CounterMetricFamily("dataquay_pfs_read_bytes", "Bytes read from the PFS", value=state.pfs_bytes)
        yield from _cache_manager_metrics(state)
        behind = state.cache_behind
        samples = CounterMetricFamily(
            "dataquay_cache_behind_samples",
            "Samples trainers read from the PFS themselves, queued for the cache behind them: read back "
            "from the page cache, or handed over by the trainer where the page cache did not hold them",
            labels=["source"],
        )
        cached_bytes = CounterMetricFamily(
            "dataquay_cache_behind_bytes", "Payload bytes of dataquay_cache_behind_samples", labels=["source"]
        )
        for source, count, nbytes in (
            ("page_cache", behind.page_cache_samples, behind.page_cache_bytes),
            ("handed", behind.handed_samples, behind.handed_bytes),
        ):
            samples.add_metric([source], count)
            cached_bytes.add_metric([source], nbytes)
        yield samples
        yield cached_bytes
        yield CounterMetricFamily(
            "dataquay_cache_behind_not_in_page_cache",
            "Samples trainers read whose bytes the page cache no longer held when the daemon read them back",
            value=behind.not_in_page_cache,
        )
        yield CounterMetricFamily(
            "dataquay_cache_behind_refused",
            "Samples trainers read that were not cached behind them: a file changed, a bad hand-over",
            value=behind.refused_samples,
        )
        yield CounterMetricFamily("dataquay_pfs_errors", "Failed PFS reads", value=state.pfs_errors)
        done = GaugeMetricFamily(
            "dataquay_staging_samples", "Samples of a dataset cached by staging so far", labels=["dataset"]
        )
        total = GaugeMetricFamily(
            "dataquay_staging_total_samples", "Samples a staging run must cache", labels=["dataset"]
        )
        done_bytes = GaugeMetricFamily(
            "dataquay_staging_bytes", "Bytes of a dataset cached by staging so far", labels=["dataset"]
        )
        total_bytes = GaugeMetricFamily(
            "dataquay_staging_total_bytes", "Bytes a staging run must cache", labels=["dataset"]
        )
        for dataset, run in state.staging.items():
            done.add_metric([dataset], run.done_samples)
            total.add_metric([dataset], run.total_samples)
            done_bytes.add_metric([dataset], run.done_bytes)
            total_bytes.add_metric([dataset], run.total_bytes)
        yield from (done, total, done_bytes, total_bytes)
        suspect = GaugeMetricFamily(
            "dataquay_peer_suspect", "1 while a peer is set aside after a failure", labels=["peer"]
        )
        failures = CounterMetricFamily(
            "dataquay_peer_failures", "Batches a peer failed to deliver in time", labels=["peer"]
        )
        bad = CounterMetricFamily(
            "dataquay_peer_bad_checksums",
            "Samples from a peer whose checksum failed (read again elsewhere)",
            labels=["peer"],
        )
        # Only peers that failed or sent a bad checksum have series: a node of a
        # job over thousands talks to every other, and a series for each
        # (times every node) would swamp the site's Prometheus.
        for peer in state.peers:
            if peer.troubled:
                suspect.add_metric([peer.node], int(peer.suspect))
                failures.add_metric([peer.node], peer.failures)
                bad.add_metric([peer.node], peer.bad_checksums)
        yield from (suspect, failures, bad)
        yield from _exchange_metrics(state)
        yield from _prefetch_metrics(state)
        yield from _client_metrics(state)
        yield from _prep_group_metrics(state)


def _prefetch_metrics(state: LiveState) -> Iterator[Metric]:
    limit, used, peak = state.prefetch_memory
    yield GaugeMetricFamily(
        "dataquay_prefetch_memory_bytes", "Memory for samples prefetched for the ranks (--prefetch-memory)", value=limit
    )
    yield GaugeMetricFamily(
        "dataquay_prefetch_held_bytes", "Bytes prefetched for the ranks and held for them, or being read", value=used
    )
    yield GaugeMetricFamily(
        "dataquay_prefetch_peak_bytes", "The most bytes prefetched for the ranks held at once", value=peak
    )
    counts = state.overflow
    for name, what, samples, nbytes in (
        (
            "read",
            "read from the PFS ahead of the ranks (samples no cache holds)",
            counts.read_samples,
            counts.read_bytes,
        ),
        ("served", "prefetched from the PFS and handed to a rank's read", counts.served_samples, counts.served_bytes),
        ("wasted", "prefetched from the PFS and dropped unread", counts.wasted_samples, counts.wasted_bytes),
    ):
        yield CounterMetricFamily(f"dataquay_overflow_{name}_samples", f"Samples {what}", value=samples)
        yield CounterMetricFamily(f"dataquay_overflow_{name}_bytes", f"Payload bytes {what}", value=nbytes)
    yield CounterMetricFamily(
        "dataquay_overflow_failed_samples",
        "Samples the PFS refused to a prefetch (changed since the manifest, unreadable); read on demand",
        value=counts.failed_samples,
    )


def _client_metrics(state: LiveState) -> Iterator[Metric]:
    reads = CounterMetricFamily(
        "dataquay_client_reads", "Samples the node's trainers read, by the tier their client counted", labels=["tier"]
    )
    read_bytes = CounterMetricFamily(
        "dataquay_client_read_bytes", "Payload bytes the node's trainers read, by client tier", labels=["tier"]
    )
    for tier, (samples, nbytes) in sorted(state.client_reads.items()):
        reads.add_metric([tier], samples)
        read_bytes.add_metric([tier], nbytes)
    yield from (reads, read_bytes)
    yield CounterMetricFamily(
        "dataquay_client_data_wait_seconds",
        "Seconds the node's trainers spent waiting for data (inside get_batch and item reads)",
        value=state.client_data_wait_seconds,
    )
    yield GaugeMetricFamily(
        "dataquay_clients", "Trainers' clients that reported to this daemon and have not closed", value=state.clients
    )


def _prep_group_metrics(state: LiveState) -> Iterator[Metric]:
    gauges = {
        "members": ("dataquay_prep_members", "Members of a coordinated prep group in its current epoch"),
        "epoch": ("dataquay_prep_epoch", "The epoch a coordinated prep group runs"),
        "lag": ("dataquay_prep_lag_batches", "Batches the slowest member of a prep group is behind the fastest"),
        "staged_bytes": ("dataquay_prep_staged_bytes", "Bytes of prepped batches a group holds in shared memory"),
        "memory_bytes": ("dataquay_prep_memory_bytes", "A prep group's budget for prepped batches held at once"),
    }
    counters = {
        "prepped_total": ("dataquay_prep_batches_prepped", "Batches prepped once for every member of a group"),
        "dropped_total": ("dataquay_prep_members_dropped", "Prep group members dropped (dead, silent or stalled)"),
        "redealt_total": ("dataquay_prep_batches_redealt", "Batches re-dealt from dropped prep group members"),
    }
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        key: GaugeMetricFamily(name, text, labels=["group"]) for key, (name, text) in gauges.items()
    }
    families.update({key: CounterMetricFamily(name, text, labels=["group"]) for key, (name, text) in counters.items()})
    for group in state.prep_groups:
        values = {
            "members": group.members,
            "epoch": group.epoch,
            "lag": group.fastest_consumed - group.slowest_consumed,
            "staged_bytes": group.staged_bytes,
            "memory_bytes": group.memory_bytes,
            "prepped_total": group.prepped_total,
            "dropped_total": group.dropped_total,
            "redealt_total": group.redealt_total,
        }
        for key, family in families.items():
            family.add_metric([group.group], float(values[key]))
    yield from families.values()


def _exchange_metrics(state: LiveState) -> Iterator[Metric]:
    families = {
        "epoch": GaugeMetricFamily(
            "dataquay_exchange_epoch", "The epoch a job's latest exchange prepares", labels=["job"]
        ),
        "total_samples": GaugeMetricFamily(
            "dataquay_exchange_total_samples", "Samples this node gives away in the exchange", labels=["job"]
        ),
        "total_bytes": GaugeMetricFamily(
            "dataquay_exchange_total_bytes", "Bytes this node gives away in the exchange", labels=["job"]
        ),
        "delivered_samples": GaugeMetricFamily(
            "dataquay_exchange_delivered_samples", "Samples the receivers acknowledged", labels=["job"]
        ),
        "delivered_bytes": GaugeMetricFamily(
            "dataquay_exchange_delivered_bytes", "Bytes the receivers acknowledged", labels=["job"]
        ),
        "finished": GaugeMetricFamily(
            "dataquay_exchange_finished", "1 once the exchange has nothing left to send", labels=["job"]
        ),
        "coded_packets_sent": GaugeMetricFamily(
            "dataquay_exchange_coded_packets_sent",
            "Packets and fetches the coded pass multicast from this node",
            labels=["job"],
        ),
        "coded_bytes_sent": GaugeMetricFamily(
            "dataquay_exchange_coded_bytes_sent", "Bytes of those packets and fetches", labels=["job"]
        ),
        "coded_samples_decoded": GaugeMetricFamily(
            "dataquay_exchange_coded_samples_decoded",
            "Samples the coded pass decoded and committed here",
            labels=["job"],
        ),
        "coded_bytes_received": GaugeMetricFamily(
            "dataquay_exchange_coded_bytes_received",
            "Bytes of multicast datagrams (UDP payloads) the fabric "
            "delivered to this node in the coded pass, from other nodes",
            labels=["job"],
        ),
        "coded_foreign_datagrams": GaugeMetricFamily(
            "dataquay_exchange_coded_foreign_datagrams",
            "Multicast datagrams delivered to this node in the coded "
            "pass for groups it does not decode for (groups sharing an address of the pool)",
            labels=["job"],
        ),
    }
    for job, run in state.exchanges.items():
        for name, family in families.items():
            family.add_metric([job], float(getattr(run, name)))
    yield from families.values()
    samples, nbytes = state.exchange_sent
    yield CounterMetricFamily(
        "dataquay_exchange_sent_samples", "Samples sent in exchanges and committed by their receivers", value=samples
    )
    yield CounterMetricFamily(
        "dataquay_exchange_sent_bytes", "Payload bytes sent in exchanges and committed by their receivers", value=nbytes
    )
    yield CounterMetricFamily(
        "dataquay_exchange_given_up_samples",
        "Samples given away and deleted unshipped, so that exchanges waiting for room in full caches move again "
        "(their new owners read them from the PFS)",
        value=state.exchange_given_up,
    )
    waited, timed_out = state.exchange_waits
    yield CounterMetricFamily(
        "dataquay_exchange_wait_seconds",
        "Seconds ranks that asked to were held at their epoch boundary until the exchange into it was in",
        value=waited,
    )
    yield CounterMetricFamily(
        "dataquay_exchange_wait_timeouts", "Such waits whose deadline passed first (the rank read on)", value=timed_out
    )
    samples, nbytes = state.exchange_received
    yield CounterMetricFamily(
        "dataquay_exchange_received_samples", "Samples committed from other nodes' exchanges", value=samples
    )
    yield CounterMetricFamily(
        "dataquay_exchange_received_bytes", "Payload bytes committed from other nodes' exchanges", value=nbytes
    )
    refused_values = CounterMetricFamily(
        "dataquay_values_refused",
        "Values kept out of this cache: a length other than the manifest's, or sent by a node the plan "
        "does not say gives them (they stay with their sender; readers get them from the next tier)",
        labels=["reason"],
    )
    for reason, count in state.values_refused.items():
        refused_values.add_metric([reason], count)
    yield refused_values
    heal = state.healing
    heal_samples = CounterMetricFamily(
        "dataquay_heal_samples",
        "Samples fetched into this cache for the share of nodes lost longer than --heal-after, by source",
        labels=["source"],
    )
    heal_bytes = CounterMetricFamily("dataquay_heal_bytes", "Payload bytes of dataquay_heal_samples", labels=["source"])
    for source, count, nbytes in (
        ("peer", heal.peer_samples, heal.peer_bytes),
        ("pfs", heal.pfs_samples, heal.pfs_bytes),
    ):
        heal_samples.add_metric([source], count)
        heal_bytes.add_metric([source], nbytes)
    yield heal_samples
    yield heal_bytes
    yield CounterMetricFamily(
        "dataquay_heal_dropped_samples",
        "Samples healing held for a lost node and deleted once it was back",
        value=heal.dropped_samples,
    )
    yield GaugeMetricFamily(
        "dataquay_heal_pending_samples", "Samples healing is to fetch and has not yet", value=heal.pending_samples
    )
    yield GaugeMetricFamily(
        "dataquay_heal_lost_nodes", "Nodes of this node's jobs down longer than --heal-after", value=heal.lost_nodes
    )
    for name, text in (
        ("served_samples", "Samples sent to peers over the bulk data path"),
        ("served_bytes", "Payload bytes sent to peers over the bulk data path"),
        ("fetched_samples", "Samples read from peers over the bulk data path"),
        ("fetched_bytes", "Payload bytes read from peers over the bulk data path"),
        (
            "refused_connections",
            "Bulk connections closed for bad input (garbage, a wrong token, oversized, stalled) or over a cap",
        ),
        ("fallbacks", "Bulk connections to peers that failed, after which gRPC was used"),
        ("segment_reads", "Trainers' batch reads answered on their shared-memory segment's connection, not gRPC"),
    ):
        yield CounterMetricFamily(f"dataquay_bulk_{name}", text, value=getattr(state.bulk, name))
    dropped = CounterMetricFamily(
        "dataquay_mcast_datagrams_dropped",
        "Coded passes' multicast datagrams (and whole packets) dropped, by reason: another pass's (unknown_pass), "
        "forged (unauthenticated), malformed, duplicate, ... (see docs/guides/coded-shuffling.md)",
        labels=["reason"],
    )
    for reason, count in sorted(state.mcast_dropped.items()):
        dropped.add_metric([reason], count)
    yield dropped
    yield CounterMetricFamily(
        "dataquay_reads_previous_owner",
        "Samples read from their owner of the epoch before (exchange not done yet)",
        value=state.previous_owner_samples,
    )
    yield CounterMetricFamily(
        "dataquay_reads_prefetched",
        "Samples of locality jobs served from transfers fetched ahead of the ranks",
        value=state.prefetched_samples,
    )


class DaemonMetrics:
    """The daemon's metric objects, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reads = Counter("dataquay_reads", "Samples served, by tier", ["tier"], registry=self.registry)
        self.read_bytes = Counter(
            "dataquay_read_bytes", "Payload bytes served, by tier", ["tier"], registry=self.registry
        )
        self.request_seconds = Histogram(
            "dataquay_request_seconds",
            "Time to serve a request, by method",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.peer_served = Counter(
            "dataquay_peer_served", "Samples this daemon served to other daemons", registry=self.registry
        )
        self.peer_served_bytes = Counter(
            "dataquay_peer_served_bytes", "Payload bytes this daemon served to other daemons", registry=self.registry
        )
        self.user_refusals = Counter(
            "dataquay_user_refusals",
            "Calls refused because the calling user may not make them (--users apart), by rule",
            ["rule"],
            registry=self.registry,
        )
        # Every tier's series exists from the start; a read looks its pair up once, not per call.
        self._reads_by_tier = {tier: (self.reads.labels(tier), self.read_bytes.labels(tier)) for tier in TIERS}

    def export_state(self, snapshot: Callable[[], LiveState]) -> None:
        """Exports what ``snapshot`` reads at each scrape (the daemon's :class:`NodeState`)."""
        self.registry.register(_StateCollector(snapshot))

    def count_read(self, tier: str, samples: int, nbytes: int) -> None:
        if samples:
            reads, read_bytes = self._reads_by_tier[tier]
            reads.inc(samples)
            read_bytes.inc(nbytes)

    def count_user_refusal(self, rule: str) -> None:
        self.user_refusals.labels(rule).inc()

    def count_peer_served(self, samples: int, nbytes: int) -> None:
        self.peer_served.inc(samples)
        self.peer_served_bytes.inc(nbytes)

    def tier_totals(self) -> dict[str, tuple[int, int]]:
        """(samples, bytes) served per tier since start; read from the counters
        themselves, so that the state collector may call it mid-scrape."""
        samples, nbytes = _by_tier(self.reads), _by_tier(self.read_bytes)
        return {tier: (samples.get(tier, 0), nbytes.get(tier, 0)) for tier in TIERS}


def _by_tier(counter: Counter) -> dict[str, int]:
    return {
        sample.labels["tier"]: int(sample.value)
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }
