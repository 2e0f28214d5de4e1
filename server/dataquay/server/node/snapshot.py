"""One snapshot of a daemon's counters and state, read from its parts.

The Stats RPC answers from it and the Prometheus collector exports it, so a
number a user sees in ``dataquay stats`` and on /metrics comes from one place.
A snapshot is taken when asked (a call, a scrape); nothing is kept between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from dataquay.protos import cache_pb2 as pb
from dataquay.server.node.cache.admission import REASONS
from dataquay.server.node.exchange.coded import CodedProgress
from dataquay.server.node.healer import HealCounts
from dataquay.server.node.reads.behind import BehindCounts
from dataquay.server.node.reads.overflow import OverflowCounts

if TYPE_CHECKING:
    from dataquay.server.node.cache.manager import CacheManager, Holding, UserUse
    from dataquay.server.node.cache.store import Store
    from dataquay.server.node.client_stats import ClientStatsBook
    from dataquay.server.node.counters import FaceCounters
    from dataquay.server.node.exchange import ExchangeReceiver, ExchangeRun, Exchanges
    from dataquay.server.node.healer import Healer
    from dataquay.server.node.peers.bulk.server import BulkServer
    from dataquay.server.node.peers.reads import PeerHealth, Peers
    from dataquay.server.node.prep.groups import PrepGroups
    from dataquay.server.node.reads.behind import CacheBehind
    from dataquay.server.node.reads.pfs import PfsPool
    from dataquay.server.node.reads.service import ReadService
    from dataquay.server.node.stager import Stager, StagingProgress


@dataclass(frozen=True)
class BulkCounts:
    """The bulk data path, and payloads handed into trainers' segments."""

    served_samples: int = 0  # sent to peers
    served_bytes: int = 0
    fetched_samples: int = 0  # read from peers
    fetched_bytes: int = 0
    refused_connections: int = 0  # closed for bad input or over a cap
    fallbacks: int = 0  # fetches that failed over bulk and went over gRPC
    exchange_samples: int = 0  # exchange payloads taken in over bulk
    forwarded_samples: int = 0  # peer payloads in trainers' segments before their windows were answered
    in_place_samples: int = 0  # of those, received straight into a sealed memfd segment
    segment_reads: int = 0  # trainers' batch reads answered on their segments' connections

    def proto(self) -> pb.BulkCounts:
        return pb.BulkCounts(**asdict(self))


@dataclass(frozen=True)
class ExchangeState:
    """One job's latest exchange, sending side (or its failure before its run began)."""

    job: str
    epoch: int
    total_samples: int = 0
    total_bytes: int = 0
    delivered_samples: int = 0
    delivered_bytes: int = 0
    sent_bytes: int = 0
    unavailable_samples: int = 0
    refused_samples: int = 0
    elapsed_seconds: float = 0.0
    first_delivery_seconds: float = 0.0
    finished: bool = False
    failed: bool = False
    error: str = ""
    coded_packets_sent: int = 0
    coded_bytes_sent: int = 0
    coded_samples_decoded: int = 0
    coded_note: str = ""
    coded_datagrams_received: int = 0
    coded_bytes_received: int = 0
    coded_foreign_datagrams: int = 0

    def proto(self) -> pb.ExchangeProgress:
        return pb.ExchangeProgress(**asdict(self))


def exchange_state(run: ExchangeRun) -> ExchangeState:
    done = run.progress()
    coded = run.coded or CodedProgress()
    return ExchangeState(
        job=run.job,
        epoch=run.epoch,
        total_samples=done.total_samples,
        total_bytes=done.total_bytes,
        delivered_samples=done.delivered_samples,
        delivered_bytes=done.delivered_bytes,
        sent_bytes=done.sent_bytes,
        unavailable_samples=done.unavailable_samples,
        refused_samples=done.refused_samples,
        elapsed_seconds=run.elapsed,
        first_delivery_seconds=run.first_delivery,
        finished=run.finished,
        failed=run.failed,
        error=run.error,
        coded_packets_sent=coded.packets_sent,
        coded_bytes_sent=coded.bytes_sent,
        coded_samples_decoded=coded.samples_decoded,
        coded_note=coded.note,
        coded_datagrams_received=coded.datagrams_received,
        coded_bytes_received=coded.bytes_received,
        coded_foreign_datagrams=coded.foreign_datagrams,
    )


@dataclass(frozen=True)
class LiveState:
    """A snapshot of the daemon's counters and state."""

    cache_used_bytes: int
    cache_capacity_bytes: int
    cache_entries: int
    cache_full: bool
    cache_disk_full: bool
    corrupt_repaired: int
    inserts_dropped: int
    pfs_bytes: int
    pfs_errors: int
    staging: dict[str, StagingProgress]  # dataset -> its latest staging run
    peers: tuple[PeerHealth, ...]
    exchanges: dict[str, ExchangeState]  # job -> its latest exchange, sending side
    exchange_sent: tuple[int, int]  # (samples, bytes) other nodes committed from this one
    exchange_received: tuple[int, int]  # (samples, bytes) committed from other nodes' exchanges
    exchange_given_up: int  # samples deleted unshipped so that every full node's exchange moves again
    previous_owner_samples: int
    prefetched_samples: int
    prefetch_memory: tuple[int, int, int]  # (budget, reserved now, most reserved at once), bytes
    overflow: OverflowCounts
    client_reads: dict[str, tuple[int, int]]  # client tier -> (samples, bytes), as trainers reported
    client_data_wait_seconds: float
    clients: int
    #: Samples and bytes this daemon served, by tier (the dataquay_reads counters).
    served: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Jobs whose latest exchange failed before its run began (not in ``exchanges``).
    exchanges_failed: tuple[ExchangeState, ...] = ()
    prep_groups: tuple[pb.PrepGroupStatus, ...] = ()
    bulk: BulkCounts = field(default_factory=BulkCounts)
    cache_behind: BehindCounts = field(default_factory=BehindCounts)
    #: Coded passes' multicast datagrams (and packets) dropped, by reason.
    mcast_dropped: dict[str, int] = field(default_factory=dict)
    multicast_note: str = ""
    #: Ranks held at their epoch boundary for the exchange: (seconds, waits that ran out).
    exchange_waits: tuple[float, int] = (0.0, 0)
    #: Values the admission rule kept out of the cache, by reason (node/cache/admission.py).
    values_refused: dict[str, int] = field(default_factory=dict)
    #: Each dataset version the cache holds: bytes, last use, whom it is charged to, who pins it.
    cache_holdings: tuple[Holding, ...] = ()
    #: Bytes charged to each user and group, and its quota.
    cache_charges: tuple[UserUse, ...] = ()
    #: (samples, payload bytes) the cache manager evicted.
    cache_evicted: tuple[int, int] = (0, 0)
    #: What healing fetched for lost nodes and dropped for nodes back (node/healer.py).
    healing: HealCounts = field(default_factory=HealCounts)


class NodeState:
    """Takes snapshots of one daemon's parts (those a standalone daemon lacks are None)."""

    def __init__(
        self,
        *,
        store: Store,
        pfs: PfsPool,
        stager: Stager,
        peers: Peers,
        reads: ReadService,
        served: Callable[[], dict[str, tuple[int, int]]],
        client_stats: ClientStatsBook,
        prep_groups: PrepGroups,
        behind: CacheBehind,
        counters: FaceCounters,
        exchanges: Exchanges | None,
        receiver: ExchangeReceiver | None,
        bulk: BulkServer | None,
        cache: CacheManager,
        healer: Healer | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.pfs = pfs
        self.stager = stager
        self.peers = peers
        self.reads = reads
        self.served = served
        self.client_stats = client_stats
        self.prep_groups = prep_groups
        self.behind = behind
        self.counters = counters
        self.exchanges = exchanges
        self.receiver = receiver
        self.bulk = bulk
        self.healer = healer

    def snapshot(self) -> LiveState:
        store, reads, exchanges, receiver = self.store, self.reads, self.exchanges, self.receiver
        used, entries = store.usage() if store.is_open else (0, 0)
        return LiveState(
            cache_used_bytes=used,
            cache_capacity_bytes=store.capacity,
            cache_entries=entries,
            # Full as staging sees it too: at capacity less the refill margin, where it stops.
            cache_full=store.full or store.space.at_capacity,
            cache_disk_full=store.disk_full,
            corrupt_repaired=store.corrupt_repaired,
            inserts_dropped=store.inserts_dropped,
            pfs_bytes=self.pfs.bytes_read,
            pfs_errors=self.pfs.errors,
            staging=dict(self.stager.runs),
            peers=tuple(self.peers.health()),
            exchanges={run.job: exchange_state(run) for run in exchanges.progress()} if exchanges else {},
            exchanges_failed=tuple(
                ExchangeState(job=job, epoch=epoch, finished=True, failed=True, error=f"failed: {reason}")
                for job, epoch, reason in exchanges.failed_early()
            )
            if exchanges
            else (),
            exchange_sent=(exchanges.sent_samples, exchanges.sent_bytes) if exchanges else (0, 0),
            exchange_given_up=exchanges.given_up_samples if exchanges else 0,
            exchange_waits=(exchanges.arrivals.waited_seconds, exchanges.arrivals.timed_out) if exchanges else (0.0, 0),
            exchange_received=(receiver.received_samples, receiver.received_bytes) if receiver else (0, 0),
            values_refused=refused_values(receiver.refused if receiver else {}, self.peers.refused_lengths),
            previous_owner_samples=reads.previous_owner_samples,
            prefetched_samples=reads.prefetcher.served if reads.prefetcher else 0,
            prefetch_memory=(reads.budget.limit, reads.budget.held, reads.budget.peak),
            overflow=reads.overflow.counts if reads.overflow else OverflowCounts(),
            served=self.served(),
            client_reads={tier: (samples, nbytes) for tier, (samples, nbytes) in self.client_stats.reads.items()},
            client_data_wait_seconds=self.client_stats.data_wait_seconds,
            clients=self.client_stats.clients,
            prep_groups=tuple(self.prep_groups.status()),
            bulk=self._bulk(),
            cache_behind=self.behind.counts,
            mcast_dropped=dict(exchanges.mcast_dropped) if exchanges else {},
            cache_holdings=tuple(self.cache.holdings()),
            cache_charges=tuple(self.cache.users()),
            cache_evicted=(self.cache.evicted_samples, self.cache.evicted_bytes),
            healing=replace(self.healer.counts) if self.healer else HealCounts(),
            multicast_note=exchanges.multicast_note if exchanges else "",
        )

    def _bulk(self) -> BulkCounts:
        bulk, peers, counters = self.bulk, self.peers, self.counters
        return BulkCounts(
            served_samples=bulk.served_samples if bulk else 0,
            served_bytes=bulk.served_bytes if bulk else 0,
            fetched_samples=peers.bulk_samples,
            fetched_bytes=peers.bulk_bytes,
            refused_connections=bulk.refused if bulk else 0,
            fallbacks=peers.bulk_fallbacks,
            exchange_samples=bulk.exchange_samples if bulk else 0,
            forwarded_samples=counters.forwarded_samples,
            in_place_samples=counters.in_place_samples,
            segment_reads=counters.segment_reads,
        )


def refused_values(exchanged: dict[str, int], peer_lengths: int) -> dict[str, int]:
    """Values the admission rule kept out, by reason: from exchanges and from peer reads."""
    out = dict.fromkeys(REASONS.values(), 0) | exchanged
    out["length"] += peer_lengths
    return out
