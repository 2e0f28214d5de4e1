"""The directory's records: what daemons say about themselves, nodes and
their leases' facts, job records and the version counters, as the state
machine (:mod:`.state`) and its I/O exchange them.

Plain values with no behaviour of their own, so that the servicer, the
server, service discovery and the tests name them without importing the
state machine.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from dataquay.client.job_settings import JobSettings
from dataquay.server.planning.absences import Absence


@dataclass(frozen=True)
class NodeInfo:
    """What a daemon says about itself when it registers."""

    name: str
    tcp_address: str
    metrics_address: str = ""
    cache_capacity: int = 0
    pid: int = 0
    version: str = ""
    bulk_address: str = ""


@dataclass
class Node:
    """A registered node; ``up`` while its lease runs."""

    info: NodeInfo
    registered: float
    last_heartbeat: float
    up: bool = True
    cache_used_bytes: int = 0
    cache_entries: int = 0
    #: The highest datagram sequence accepted since the node registered.
    beat_sequence: int = field(kw_only=True)
    #: SHA-256 (hex) of the identity key the node registered with.
    identity: str = field(kw_only=True)
    #: What its heartbeats must carry (see RegisterNodeReply.session).
    session: int = field(kw_only=True)


@dataclass(frozen=True)
class Versions:
    """Counters that move when nodes, datasets or jobs change, so that daemons
    polling them refetch only what changed."""

    nodes: int = 0
    datasets: int = 0
    jobs: int = 0


class Change(enum.Enum):
    """What a registration did to the node's membership."""

    JOINED = "joined"  # a name never seen before
    UP = "up"  # a node that was down, or not heard from since the directory restarted, is back
    RENEWED = "renewed"  # a live node registered again (a restart)


class Registration(NamedTuple):
    change: Change
    previous: NodeInfo | None
    #: The identity that held the name before ("" for a name never seen).
    previous_identity: str
    #: What the node's heartbeats must carry.
    session: int


class Beat(NamedTuple):
    known: bool  # False: the name is not registered; the daemon must register
    came_up: bool  # the node was down and is up again
    #: Why the beat renewed nothing: "replayed" (a datagram's sequence already
    #: seen) or "holder" (not the session of the name's registration); "" if it did.
    refused: str = ""


@dataclass(frozen=True)
class JoinRequest:
    """A join: the settings the caller named, over the defaults, and which it named.

    Unnamed settings are the job's. ``ranks_per_node`` 0 is "not known yet":
    it is not compared, and the first join naming a value above 0 fixes the
    job's.
    """

    settings: JobSettings
    named: frozenset[str] = frozenset()
    must_exist: bool = False


@dataclass(frozen=True)
class DatasetFacts:
    """What a job records of its dataset when it is created."""

    manifest_id: str
    num_samples: int


@dataclass(frozen=True)
class Job:
    """A job record. ``epoch`` is the highest epoch any node reported;
    ``started`` says whether one did (so that epoch 0 has begun);
    ``last_active`` is when it was created, joined or last had an epoch
    reported, as Unix time (the directory counts its idle time on the
    monotonic clock); ``absences`` are its nodes lost for a while, in modes
    whose owners move (:mod:`~dataquay.server.planning.absences`)."""

    spec: JobSettings
    manifest_id: str
    num_samples: int
    epoch: int
    created: float
    started: bool
    last_active: float
    absences: tuple[Absence, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The record as the state file and the etcd store write it."""
        return {**asdict(self), "spec": {**asdict(self.spec), "nodes": list(self.spec.nodes)}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Job:
        """The record :meth:`to_json` wrote (a record without ``absences`` has none)."""
        absences = tuple(Absence(**a) for a in raw.get("absences", ()))
        return cls(**{**raw, "spec": JobSettings(**raw["spec"]), "absences": absences})
