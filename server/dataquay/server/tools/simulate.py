"""What a job's placement costs, epoch by epoch, before it spends allocation hours.

``dataquay simulate`` runs the real placement code (:mod:`dataquay.client.placement`)
on a job's sizes and counts the bytes each node sends, receives and reads from
the PFS. The model:

- Every sample is ``sample_bytes`` long and takes the LMDB pages
  :func:`dataquay.server.planning.capacity.stored_bytes` counts; a node's cache holds
  as many as fit in ``cache_bytes`` (all it owns when no capacity is given),
  less what the daemons' staging leaves free where owners move
  (:func:`dataquay.server.planning.capacity.exchange_staging_limit`: the
  exchange's reserve and the refill margin), as its own inserts stop there.
  What is in transit when an epoch
  begins is ignored.
- Epoch 0 stages: each node reads its initial owned set from the PFS once
  (N * S bytes in all). Later epochs read from the PFS only what a node owns
  beyond its capacity: the cache inserts once and never evicts (MinIO), so the
  same excess misses every epoch. The owner reads its misses and serves them,
  so capacity changes PFS bytes, not network bytes.
- Network bytes of epoch e are the exchange before e (``partial``: every
  sample of :func:`~dataquay.client.placement.moves`, sent by its old owner to
  its new one, if its cache holds it: a node that holds a fraction f of what
  it owns ships f of what it gives away, and the new owners read the rest from
  the PFS as part of their excess) plus the epoch's reads from peers: ``global`` ranks read their
  slice of the epoch's permutation, and every id their node does not own comes
  from its owner; ``locality`` moves each global batch's imbalance (a node
  sends its surplus and receives its deficit); ``local`` and ``partial`` read
  only what their node owns. A cache short of its share (less the
  exchange's reserve) takes a sample only once its sender's ranks have read
  it, so no sample takes room in two short caches; its ranks, reading
  ``read_ahead`` batches ahead, ask for the first of the next epoch while the
  senders still read this one, and read from its previous owner each one
  their sender had not reported read yet (``early_read_bytes``, with ranks in
  lockstep; a rank's reported position trails its reads by half a batch).
- With ``exchange_coding`` (``coded``, ``uber``), the exchange before epoch e
  is the coded one (:mod:`dataquay.server.tools.coded_traffic`): caches keep
  spare copies up to their capacity, a sample already cached at its new owner
  moves nothing, and XOR packets multicast to the nodes that need their
  parts; a node sends each packet once and every decoder receives it. The
  epoch also carries the uncoded exchange from the same caches, so the two
  compare on equal terms.
- A node change (``leave_at``, ``join_at``) before an epoch moves every
  sample whose holder changes once (``moved``), as the daemons handle it
  (:mod:`.node_changes`): one whose old holder is still up comes from it
  over the network; one whose holder left is read from the PFS by its new
  holder in that epoch and cached, so the PFS reads no more of it after.
  In modes whose owners never move, the share of the node that left goes
  where the stable placement on the others puts it and a node that joins
  takes its share of the stable placement. In ``partial`` the node that
  left is absent from the holders and the one that comes back is it; a
  node new to the job re-forms it. A coded exchange is not modelled
  across a change.
- The estimate (:func:`estimate`) takes per-node training, aggregate PFS and
  per-node network rates. Reads of ``global`` and ``locality`` sit on the
  critical path, so an epoch lasts as long as its slowest term. The exchange
  before epoch e of ``partial`` runs during epoch e-1's training; what does not
  fit there spills into epoch e as peer reads, which is where a partial
  exchange stops being free (few iterations per epoch at large scale).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from dataquay.client.placement import (
    MODES,
    BatchBalance,
    JobPlan,
    Moves,
    moves,
    owner_read_positions,
    owners,
    rank_length,
)
from dataquay.server.node.exchange.coding import SCHEMES
from dataquay.server.planning.capacity import exchange_reserve, exchange_staging_limit, stored_bytes
from dataquay.server.tools.coded_traffic import CodedEpoch, CodedExchanges
from dataquay.server.tools.node_changes import absent_holders, holder_moves, static_change
from dataquay.server.tools.peer_reads import PEER_READS

#: The name of the node that ``Scenario.join_at`` adds: it sorts after
#: "0".."M-1", the case that shifted every block of a placement by index.
SPARE = "spare"


@dataclass(frozen=True)
class Scenario:
    """A job to simulate: its plan and the bytes behind each sample.

    Attributes:
        plan: the job; needs ranks per node and a per-rank batch size.
        sample_bytes: S, the size of every sample.
        cache_bytes: each node's cache capacity; None holds all a node owns.
        exchange_coding: ``none``, or a coded scheme of the planner
            (``coded``, ``uber``) for the exchanges of a mode whose owners
            move; caches then keep spare copies up to their capacity
            (:mod:`dataquay.server.tools.coded_traffic`).
        leave_at: the epoch before which the plan's first node leaves; None
            for none.
        join_at: the epoch before which a spare node joins; None for none.
        joiner: the name of the node that joins; the default sorts after
            "0".."M-1". The name of the node that left models it coming back
            (a placement hashes names, so it takes the share it had).
        read_ahead: batches each rank reads ahead of the one it trains on
            (``Dataset.batches``' default is 2).

    Raises:
        ValueError: a field outside its range, named in the message.
    """

    plan: JobPlan
    sample_bytes: int
    cache_bytes: int | None = None
    exchange_coding: str = "none"
    leave_at: int | None = None
    join_at: int | None = None
    joiner: str = SPARE
    read_ahead: int = 2

    def __post_init__(self) -> None:
        plan = self.plan
        if plan.num_samples < plan.num_nodes:
            raise ValueError(f"num_samples must be at least one per node ({plan.num_nodes}), not {plan.num_samples}")
        if plan.settings.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, not {plan.settings.ranks_per_node}")
        if plan.settings.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {plan.settings.batch_size}")
        if self.sample_bytes < 1:
            raise ValueError(f"sample_bytes must be at least 1, not {self.sample_bytes}")
        if self.cache_bytes is not None and self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must not be negative, not {self.cache_bytes}")
        if self.read_ahead < 0:
            raise ValueError(f"read_ahead must not be negative, not {self.read_ahead}")
        if self.exchange_coding not in SCHEMES:
            raise ValueError(f"exchange_coding must be one of {', '.join(SCHEMES)}, not {self.exchange_coding!r}")
        if self.exchange_coding != "none" and not MODES[plan.settings.mode].owners_move:
            raise ValueError(
                f"exchange_coding codes an exchange, and mode {plan.settings.mode} has none: use mode partial"
            )
        for name in ("leave_at", "join_at"):
            at = getattr(self, name)
            if at is None:
                continue
            if at < 1:
                raise ValueError(f"{name} must be an epoch after staging (1 or more), not {at}")
            if self.exchange_coding != "none":
                raise ValueError(f"{name} is not modelled with exchange_coding {self.exchange_coding}: use none")
        if self.leave_at is not None and plan.num_nodes < 2:
            raise ValueError("leave_at needs at least 2 nodes: the job must keep one")
        if self.join_at is not None and self._absences:
            if self.joiner != plan.nodes[0]:
                raise ValueError(
                    f"in mode {plan.settings.mode} a node that joins after one left is the one that left "
                    f"({plan.nodes[0]!r}): a job whose owners move keeps its nodes; a new one re-forms it"
                )
            if self.leave_at is not None and self.join_at <= self.leave_at:
                raise ValueError(f"join_at ({self.join_at}) must come after leave_at ({self.leave_at})")
        elif self.join_at is not None and self.joiner in self.plan_at(self.join_at - 1).nodes:
            raise ValueError(f"joiner {self.joiner!r} is already one of the job's nodes before epoch {self.join_at}")

    @property
    def _absences(self) -> bool:
        """Whether the node that leaves is absent from the job's holders (its
        owners move) rather than gone from its node set (see :mod:`.node_changes`)."""
        return MODES[self.plan.settings.mode].owners_move and self.leave_at is not None

    def absent_at(self, epoch: int) -> tuple[str, ...]:
        """The nodes absent from the holders of ``epoch`` in a job whose owners move."""
        if not self._absences or self.leave_at is None or epoch < self.leave_at:
            return ()
        if self.join_at is not None and epoch >= self.join_at:
            return ()
        return (self.plan.nodes[0],)

    def plan_at(self, epoch: int) -> JobPlan:
        """The plan of ``epoch``: the job's, less the node that left (unless
        it is absent instead), plus the one that joined."""
        if self._absences:
            return self.plan
        names = list(self.plan.nodes)
        if self.leave_at is not None and epoch >= self.leave_at:
            names = names[1:]
        if self.join_at is not None and epoch >= self.join_at:
            names.append(self.joiner)
        if tuple(names) == self.plan.nodes:
            return self.plan
        return replace(self.plan, settings=replace(self.plan.settings, nodes=tuple(names)), num_nodes=len(names))

    @property
    def dataset_bytes(self) -> int:
        """N * S."""
        return self.plan.num_samples * self.sample_bytes

    @cached_property
    def ids_per_rank(self) -> int:
        """Ids each rank reads per epoch, padding included (kept: some modes
        derive it from the initial partition)."""
        return rank_length(self.plan)

    @property
    def iterations(self) -> int:
        """Steps per epoch: the ids each rank reads over its per-rank batch."""
        return -(-self.ids_per_rank // self.plan.settings.batch_size)

    @property
    def node_samples(self) -> int:
        """Ids each node consumes per epoch, padding included."""
        return self.ids_per_rank * self.plan.settings.ranks_per_node


@dataclass(frozen=True)
class Rates:
    """The speeds an epoch-time estimate needs.

    Attributes:
        train_rate: samples per second one node's GPUs consume.
        pfs_bandwidth: bytes per second the PFS delivers to the whole job.
        network_bandwidth: bytes per second one node sends, and receives.
        egress_bandwidth: bytes per second one node sends, where less than it
            receives (an oversubscribed uplink); None: ``network_bandwidth``.

    Raises:
        ValueError: a rate that is not positive, named in the message.
    """

    train_rate: float
    pfs_bandwidth: float
    network_bandwidth: float
    egress_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name in ("train_rate", "pfs_bandwidth", "network_bandwidth", "egress_bandwidth"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, not {value}")

    @property
    def egress(self) -> float:
        """Bytes per second one node sends."""
        return self.network_bandwidth if self.egress_bandwidth is None else self.egress_bandwidth


@dataclass(frozen=True)
class EpochTraffic:
    """The bytes one epoch moves; per-node arrays are indexed by node rank.

    Attributes:
        epoch: 0 is the staging epoch.
        sent: bytes each node sends to peers (int64).
        received: bytes each node receives from peers (int64).
        pfs_bytes: bytes the job reads from the PFS.
        balance: ``locality``'s per-batch balancing, None for other modes.
        coding: the coded exchange before this epoch (``sent`` and
            ``received`` count it in place of the uncoded one), None
            without ``exchange_coding`` or an exchange.
        moved_bytes: bytes of the samples whose holder a node change before
            this epoch moved, from peers (counted in ``sent``) or the PFS
            (in ``pfs_bytes``); 0 without a change.
        early_read_bytes: bytes ranks read from a sample's previous owner before
            the exchange into this epoch delivered it to their short cache
            (counted in ``sent`` and ``received`` too).
        absent_nodes: nodes of a job whose owners move that hold nothing in
            this epoch (they left; :mod:`.node_changes`); ``sent`` and
            ``received`` still have their entries.
    """

    epoch: int
    sent: np.ndarray
    received: np.ndarray
    pfs_bytes: int
    balance: BatchBalance | None
    coding: CodedEpoch | None = None
    moved_bytes: int = 0
    early_read_bytes: int = 0
    absent_nodes: int = 0

    @property
    def nodes(self) -> int:
        """Nodes that hold samples in this epoch."""
        return len(self.sent) - self.absent_nodes

    @property
    def network_bytes(self) -> int:
        """Bytes that cross the network (each counted once, at its sender)."""
        return int(self.sent.sum())


@dataclass(frozen=True)
class Spread:
    """How a per-node quantity spreads over the nodes.

    Attributes:
        min: the least loaded node's value.
        median: the typical node's.
        max: the busiest node's, which sets the pace.
        mean: the total over the node count.
        balance: max / mean; 1.0 is perfectly even (and when nothing moves).
    """

    min: float
    median: float
    max: float
    mean: float
    balance: float


@dataclass(frozen=True)
class Estimate:
    """One epoch's time, by term (seconds).

    Attributes:
        training: the node's share of the epoch at the training rate.
        pfs: the epoch's PFS bytes at the PFS bandwidth.
        network: the busiest node's sent or received bytes at the network rate.
        epoch: the estimate of the whole epoch (see the module docstring).
        spill: seconds of ``partial``'s exchange before this epoch that do
            not fit into the previous epoch's training; 0 for modes whose
            network traffic is reads, already on the critical path.
    """

    training: float
    pfs: float
    network: float
    epoch: float
    spill: float


def spread(values: np.ndarray) -> Spread:
    """The min, median, max, mean and max/mean balance of ``values``."""
    mean = float(values.mean())
    return Spread(
        float(values.min()),
        float(np.median(values)),
        float(values.max()),
        mean,
        float(values.max()) / mean if mean else 1.0,
    )


def simulate(scenario: Scenario, epochs: int) -> Iterator[EpochTraffic]:
    """The traffic of epochs 0..epochs-1, one at a time.

    Keeps the current owners between epochs, so each ``partial`` epoch costs
    one exchange step rather than a replay from epoch 0.

    Raises:
        ValueError: fewer than one epoch.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, not {epochs}")
    plan, size = scenario.plan, scenario.sample_bytes
    current = owners(plan, 0)
    loads, held, short = _holdings(scenario, current, plan.num_nodes)
    reads = PEER_READS[plan.settings.mode]
    coded = None
    if scenario.exchange_coding != "none":
        capacity = int(_cache_samples(scenario, loads).min())
        coded = CodedExchanges(current, plan.num_nodes, capacity, scenario.exchange_coding, plan.settings.seed)
    absent: tuple[str, ...] = ()
    holders = current
    for epoch in range(epochs):
        restaged = moved = 0
        sent = np.zeros(plan.num_nodes, dtype=np.int64)
        received = np.zeros(plan.num_nodes, dtype=np.int64)
        if scenario.plan_at(epoch) != plan:
            before, plan = plan, scenario.plan_at(epoch)
            current, change = static_change(before, plan, current, epoch)
            holders = current
            moved, restaged = len(change.ids), int((change.sources < 0).sum())
            loads, held, short = _holdings(scenario, current, plan.num_nodes)
            peers = change.sources >= 0
            sent = np.bincount(change.sources[peers], minlength=plan.num_nodes)
            received = np.bincount(change.targets[peers], minlength=plan.num_nodes)
        coding = None
        early = 0
        if epoch and MODES[plan.settings.mode].owners_move:
            shipped = moves(plan, epoch, current)
            current = current.copy()
            current[shipped.ids] = shipped.targets
            previous, now_absent = holders, scenario.absent_at(epoch)
            holders = absent_holders(plan, current, now_absent)
            if now_absent or absent:
                left = tuple(sorted(set(now_absent) - set(absent)))
                back = tuple(sorted(set(absent) - set(now_absent)))
                shipped, change = holder_moves(plan, previous, holders, left, back)
                moved, restaged = len(change.ids), int((change.sources < 0).sum())
                shipped = Moves(*(column[shipped.sources >= 0] for column in shipped))
            if now_absent != absent:
                loads, held, short = _holdings(scenario, holders, plan.num_nodes)
            absent = now_absent
            if coded is None:
                kept = held / np.maximum(loads, 1)
                early_sent, early_received = _read_before_delivery(
                    scenario, plan, epoch, (previous, holders), shipped, kept, short
                )
                sent += early_sent
                received += early_received
                early = int(early_received.sum())
                ships = np.bincount(shipped.sources, minlength=plan.num_nodes) * held / np.maximum(loads, 1)
                sent += np.rint(ships).astype(np.int64)
                received += np.rint(
                    np.bincount(
                        shipped.targets,
                        weights=(held / np.maximum(loads, 1))[shipped.sources],
                        minlength=plan.num_nodes,
                    )
                ).astype(np.int64)
            else:
                coding = coded.exchange(current)
                sent += coding.sent
                received += coding.received
        read_sent, read_received, balance = reads(plan, epoch, current)
        sent += read_sent
        received += read_received
        pfs = plan.num_samples if epoch == 0 else int((loads - held).sum()) + restaged
        pfs += coding.coded.pfs_bytes if coding else 0
        yield EpochTraffic(
            epoch, sent * size, received * size, pfs * size, balance, coding, moved * size, early * size, len(absent)
        )


def estimate(scenario: Scenario, traffic: EpochTraffic, rates: Rates) -> Estimate:
    """The time of ``traffic``'s epoch at ``rates`` (see the module docstring)."""
    training = scenario.node_samples / rates.train_rate
    pfs = traffic.pfs_bytes / rates.pfs_bandwidth
    network = max(int(traffic.sent.max()) / rates.egress, int(traffic.received.max()) / rates.network_bandwidth)
    if MODES[scenario.plan.settings.mode].owners_move:
        spill = max(0.0, network - training)
        return Estimate(training, pfs, network, max(training, pfs) + spill, spill)
    return Estimate(training, pfs, network, max(training, pfs, network), 0.0)


def _holdings(scenario: Scenario, holders: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node: the samples it holds, those of them its cache keeps, and
    whether its cache is short of what it holds."""
    loads = np.bincount(holders, minlength=num_nodes)
    return loads, np.minimum(loads, _cache_samples(scenario, loads)), _short_of_share(scenario, loads)


def _cache_samples(scenario: Scenario, loads: np.ndarray) -> np.ndarray:
    """Samples each node's cache holds; the rest of its load is read from the
    PFS every epoch.

    Node loads never change (``partial`` trades as many as it takes), so the
    initial partition's loads hold for every epoch. Where owners move, staging
    stops where the daemon's does (:func:`exchange_staging_limit`).
    """
    if scenario.cache_bytes is None:
        return loads
    usable = scenario.cache_bytes
    if MODES[scenario.plan.settings.mode].owners_move:
        usable = exchange_staging_limit(scenario.cache_bytes)
    return np.full(len(loads), max(usable, 0) // _stored_per_sample(scenario, loads), dtype=np.int64)


def _stored_per_sample(scenario: Scenario, loads: np.ndarray) -> float:
    """The LMDB bytes a sample takes in a node's cache. Pages per sample
    barely depend on the count: a bounded sample of the typical load."""
    count = int(min(max(loads.max(), 1), _PAGES_SAMPLE))
    return stored_bytes(np.full(count, scenario.sample_bytes, dtype=np.int64)) / count


def _short_of_share(scenario: Scenario, loads: np.ndarray) -> np.ndarray:
    """Which nodes' caches, less the exchange's reserve, cannot hold what they
    own: their exchange takes a sample only once its sender's ranks read it
    (as the receiving daemon tells its senders)."""
    if scenario.cache_bytes is None:
        return np.zeros(len(loads), dtype=bool)
    return loads * _stored_per_sample(scenario, loads) > scenario.cache_bytes - exchange_reserve(scenario.cache_bytes)


def _read_before_delivery(
    scenario: Scenario,
    plan: JobPlan,
    epoch: int,
    epoch_owners: tuple[np.ndarray, np.ndarray],
    shipped: Moves,
    kept: np.ndarray,
    short: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Samples per node sent, and received, by peer reads of ``epoch``'s first
    ids before the exchange delivered them to a short cache.

    With ranks in lockstep, the sender's rank reads a sample at position p of
    epoch - 1, and the receiver's read-ahead asks for it at its position p'
    of ``epoch`` less the window, from the start of epoch - 1: L + p' - W. It
    is read from the sender when p >= L + p' - W, for the ``kept`` fraction of
    the sender's samples that it ships at all (the rest its new owner reads
    from the PFS, counted as its excess). W is the read-ahead and half a
    batch: the sender ships what its rank reported read, and a rank reports
    its position at most every :data:`~dataquay.client.stats.POSITION_REPORT_SECONDS`
    while it takes a batch's ids at once, so the report trails its reads by
    half a batch on average.
    """
    none = np.zeros(plan.num_nodes, dtype=np.int64)
    batch = plan.settings.batch_size
    window = scenario.read_ahead * batch + batch // 2
    to_short = short[shipped.targets]
    if not to_short.any():
        return none, none
    ids, sources, targets = shipped.ids[to_short], shipped.sources[to_short], shipped.targets[to_short]
    before, after = epoch_owners
    read_here = owner_read_positions(plan, epoch - 1, before, ids)
    read_there = owner_read_positions(plan, epoch, after, ids)
    late = (read_here >= 0) & (read_there >= 0) & (read_here >= rank_length(plan) + read_there - window)
    weights = kept[sources] * late
    return (
        np.rint(np.bincount(sources, weights=weights, minlength=plan.num_nodes)).astype(np.int64),
        np.rint(np.bincount(targets, weights=weights, minlength=plan.num_nodes)).astype(np.int64),
    )


_PAGES_SAMPLE = 100_000
