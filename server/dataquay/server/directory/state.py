"""What the directory knows, as a sans-IO state machine: nodes and their
leases, job records and the version counters daemons poll.

No sockets, no clock, no files: every method that depends on time takes
``now`` (seconds, the caller's clock), and persistence is :meth:`to_json` /
:meth:`from_json`, so tests drive it step by step. The server owns the I/O:
it calls :meth:`DirectoryState.expire` and :meth:`DirectoryState.expire_jobs`
from periodic tasks, writes the state whenever :attr:`DirectoryState.revision`
moved, and logs the transitions the methods return.

The server's ``now`` is the monotonic clock: leases and idle ages count on
it, so that a step of the system clock neither keeps a killed node up for the
length of the step nor ends every lease and every job's activity at once.
What people read and what is written is Unix time, passed as ``wall`` (a
node's registration and last heartbeat, a job's creation and last activity;
``now`` when not given); a job's last activity is read back from the disk
as its age at the restart.

Jobs record no end (they have no epoch count), so a finished job is an idle
one: each remembers when it was last active (created, joined, an epoch
reported), and one idle for the directory's job TTL is dropped.

A heartbeat must stay O(1) however many nodes there are (a thousand nodes
every two seconds): leases of live nodes sit in an ordered dict in the order
they end, because every lease has the same length; a heartbeat moves its node
to the end, and expiry pops expired leases from the front.

Membership changes go to a :class:`~.node_log.NodeLog`, which publishes them
as node-set versions at most once per heartbeat period: the server calls
:meth:`DirectoryState.publish_nodes` before it hands a version out.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any, NamedTuple

from dataquay.client.job_settings import SETTINGS
from dataquay.client.jobs import check_epoch_ahead
from dataquay.client.placement import MAX_EPOCH, MODES
from dataquay.server.directory.node_log import NodeLog, first_version
from dataquay.server.directory.records import (
    Beat,
    Change,
    DatasetFacts,
    Job,
    JoinRequest,
    Node,
    NodeInfo,
    Registration,
    Versions,
)
from dataquay.server.directory.state_check import check_state
from dataquay.server.errors import (
    InvalidRequestError,
    JobActiveError,
    JobMismatchError,
    NodeNameTakenError,
    NoLiveNodesError,
    UnknownJobError,
)
from dataquay.server.planning.absences import follow_absences

#: Version of the persisted document; a directory refuses any other.
STATE_FORMAT = 1

_JOB_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d{1,5}$")
#: Length of the identity key a daemon keeps (see dataquay.server.node.cluster.identity).
IDENTITY_KEY_BYTES = 32

#: A job's activity moves the revision (so it reaches the disk) once per this
#: many seconds of the clock, not at every join or epoch report: each write is
#: of the whole state, and a restart that loses a minute of a job's idle time
#: changes nothing for a TTL counted in days.
ACTIVITY_WRITE_SECONDS = 60.0


class DirectoryState:
    """Nodes, leases, jobs and versions; see the module docstring."""

    def __init__(
        self, lease_seconds: float, publish_seconds: float = 0.0, sessions: Callable[[], int] | None = None
    ) -> None:
        self.lease_seconds = lease_seconds
        #: Makes the session each registration hands out.
        self._new_session = sessions or _random_session
        self.versions = Versions()
        self.node_log = NodeLog(publish_seconds)
        #: Moves on every change that must reach the disk.
        self.revision = 0
        self.heartbeats = 0
        #: Jobs dropped for being idle past the TTL, since this state was made.
        self.jobs_expired = 0
        self._nodes: dict[str, Node] = {}
        self._leases: OrderedDict[str, float] = OrderedDict()
        self._jobs: dict[str, Job] = {}
        # When each job was last active, on the clock of ``now``: its idle age
        # counts from here, its record's last_active is the Unix time shown.
        self._active: dict[str, float] = {}
        # Nodes restored up from a state file that have neither registered nor
        # heartbeated since: whoever registers such a name is no second daemon.
        self._unheard: set[str] = set()
        #: The records this state changed that a shared store must write, as
        #: ("node", name), ("job", id) and ("new-job", id) for a job created
        #: here; None where nothing follows them.
        self.changed: set[tuple[str, str]] | None = None

    # ---------------------------------------------------------------- nodes

    def register(self, info: NodeInfo, now: float, identity: str, wall: float | None = None) -> Registration:
        """Adds or refreshes a node and starts its lease; ``wall`` is the Unix
        time it records as registered (default ``now``).

        ``identity`` (:func:`identity_of` the node's key) binds the name: while
        the node's lease runs, the name is refused to any other identity, so
        that a second daemon given a live node's name cannot take its place in
        every peer's list. The same identity is the same
        node restarted, wherever it now listens. A name whose lease ended goes
        to whoever registers it (a node rebuilt on a fresh disk).

        Raises:
            InvalidRequestError: a name or address that peers could not use.
            NodeNameTakenError: a live node of another identity holds the name.
        """
        _check_node(info)
        wall = now if wall is None else wall
        node = self._nodes.get(info.name)
        session = self._new_session()
        if node is None:
            change, previous, previous_identity = Change.JOINED, None, ""
            self._nodes[info.name] = Node(
                info, registered=wall, last_heartbeat=wall, beat_sequence=0, identity=identity, session=session
            )
        else:
            self._check_holder(node, identity, now)
            live = node.up and info.name not in self._unheard
            change, previous, previous_identity = (Change.RENEWED if live else Change.UP), node.info, node.identity
            self._unheard.discard(info.name)
            node.info, node.registered, node.last_heartbeat, node.up = info, wall, wall, True
            node.beat_sequence = 0
            node.identity, node.session = identity, session
        self._renew(info.name, now)
        self.node_log.mark(info.name)
        self._nodes_changed(now)
        self._record_changed("node", info.name)
        return Registration(change, previous, previous_identity, session)

    def _check_holder(self, node: Node, identity: str, now: float) -> None:
        """Refuses ``identity`` the name of ``node`` while another identity's lease on it runs."""
        if node.identity == identity or self._leases.get(node.info.name, now) <= now:
            return
        raise NodeNameTakenError(
            f"node name {node.info.name} is held by a live node at {node.info.tcp_address}; "
            "pick another --node-name or stop that daemon"
        )

    def heartbeat(
        self,
        name: str,
        cache_used_bytes: int,
        cache_entries: int,
        now: float,
        sequence: int | None = None,
        wall: float | None = None,
        session: int = 0,
    ) -> Beat:
        """Renews a lease in O(1); a node that was down comes back up. ``wall``
        is the Unix time it records as the last heartbeat (default ``now``).

        A beat must carry the ``session`` of the node's registration, or it is refused as not the
        holder's and renews nothing: no other daemon keeps the name alive.
        A datagram's ``sequence`` must exceed every one accepted from the node
        since it registered, or the beat is refused as a replay and renews
        nothing. The mark starts again at each registration, so that a daemon
        restarted with its clock set back is not refused. Beats by RPC carry
        none: the channel authenticates them.
        """
        node = self._nodes.get(name)
        if node is not None and session != node.session:
            return Beat(known=True, came_up=False, refused="holder")
        if node is not None and sequence is not None:
            if sequence <= node.beat_sequence:
                return Beat(known=True, came_up=False, refused="replayed")
            node.beat_sequence = sequence
        self.heartbeats += 1
        if node is None:
            return Beat(known=False, came_up=False)
        self._unheard.discard(name)
        node.last_heartbeat = now if wall is None else wall
        node.cache_used_bytes = cache_used_bytes
        node.cache_entries = cache_entries
        self._renew(name, now)
        if node.up:
            return Beat(known=True, came_up=False)
        node.up = True
        self.node_log.mark(name)
        self._nodes_changed(now)
        self._record_changed("node", name)
        return Beat(known=True, came_up=True)

    def expire(self, now: float) -> list[str]:
        """Marks nodes whose lease ended before ``now`` down; returns their names."""
        expired = []
        while self._leases:
            name, until = next(iter(self._leases.items()))
            if until > now:
                break
            del self._leases[name]
            self._nodes[name].up = False
            self.node_log.mark(name)
            expired.append(name)
        if expired:
            self._nodes_changed(now)
        return expired

    def hold_leases(self, seconds: float) -> None:
        """The directory did not run for ``seconds`` (its process stopped, its
        host hung): every running lease ends that much later, since no node
        could renew one with a directory that heard nothing, as after a restart."""
        for name in self._leases:
            self._leases[name] += seconds

    def _nodes_changed(self, now: float) -> None:
        self.publish_nodes(now)
        self.revision += 1

    def publish_nodes(self, now: float) -> Versions:
        """The versions, with the node changes marked so far published as a new
        node-set version if the last one is a heartbeat period old."""
        if self.node_log.publish(now):
            self.versions = replace(self.versions, nodes=self.node_log.version)
        return self.versions

    def _renew(self, name: str, now: float) -> None:
        self._leases[name] = now + self.lease_seconds
        self._leases.move_to_end(name)

    def node(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def nodes(self) -> list[Node]:
        """Every registered node, up or down, sorted by name."""
        return [self._nodes[name] for name in sorted(self._nodes)]

    def up_nodes(self) -> list[Node]:
        """Nodes whose lease runs, sorted by name."""
        return [self._nodes[name] for name in sorted(self._leases)]

    def node_counts(self) -> tuple[int, int]:
        """(up, down)."""
        return len(self._leases), len(self._nodes) - len(self._leases)

    # ------------------------------------------------------------- datasets

    def datasets_changed(self) -> None:
        """Records that a dataset was added, replaced or dropped (the registry
        itself lives in its own files)."""
        self._bump(datasets=1)

    # ----------------------------------------------------------------- jobs

    def join(
        self, request: JoinRequest, dataset: Callable[[str], DatasetFacts], now: float, wall: float | None = None
    ) -> tuple[Job, bool]:
        """Creates the job or joins it; returns the record and whether it was created.

        Args:
            request: the job id and the settings the caller named.
            dataset: looks a registered dataset up by name; raises
                UnknownDatasetError for an unknown one. Called only to create.
            now: the time a new job was created, or the existing one last active.
            wall: ``now`` as the Unix time the record shows (default ``now``).

        Raises:
            InvalidRequestError: a bad job id, mode, partition, q, batch size
                or node list.
            JobMismatchError: the job exists with a different setting.
            UnknownJobError: ``must_exist`` and there is no such job.
            NoLiveNodesError: the job would run on all live nodes and none is up.
        """
        job_id = request.settings.job_id
        if not _JOB_ID.match(job_id):
            raise InvalidRequestError(f"bad job id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-'")
        job = self._jobs.get(job_id)
        if job is not None:
            return self._touch(self._join_existing(job, request), now, wall), False
        if request.must_exist:
            raise UnknownJobError(f"no job {job_id!r} (the first rank to join creates it)")
        spec = request.settings
        if not spec.dataset:
            raise InvalidRequestError(f"job {job_id!r} does not exist; name its dataset to create it")
        try:
            spec.check()
        except ValueError as exc:
            raise InvalidRequestError(f"job {job_id!r}: {exc}") from None
        facts = dataset(spec.dataset)
        spec = replace(spec, nodes=self._job_nodes(job_id, spec.nodes))
        wall = now if wall is None else wall
        job = Job(spec, facts.manifest_id, facts.num_samples, epoch=0, created=wall, started=False, last_active=wall)
        self._jobs[job_id] = job
        self._active[job_id] = now
        self._bump(jobs=1)
        self._record_changed("new-job", job_id)
        return job, True

    def _join_existing(self, job: Job, request: JoinRequest) -> Job:
        for name in SETTINGS:
            asked, have = getattr(request.settings, name), getattr(job.spec, name)
            if name not in request.named or asked == have:
                continue
            if name == "ranks_per_node" and (asked == 0 or have == 0):
                continue
            raise JobMismatchError(
                f"job {job.spec.job_id!r} exists with {name} {_show(have)}; this join asked for {_show(asked)}"
            )
        if job.spec.ranks_per_node == 0 and request.settings.ranks_per_node:
            job = replace(job, spec=replace(job.spec, ranks_per_node=request.settings.ranks_per_node))
            self._jobs[job.spec.job_id] = job
            self._bump(jobs=1)
            self._record_changed("job", job.spec.job_id)
        return job

    def _job_nodes(self, job_id: str, named: tuple[str, ...]) -> tuple[str, ...]:
        if not named:
            live = tuple(sorted(self._leases))
            if not live:
                raise NoLiveNodesError(
                    f"job {job_id!r} would run on all live nodes, and none is up; "
                    "start the daemons or name the job's nodes"
                )
            return live
        repeated = sorted(n for n, times in Counter(named).items() if times > 1)
        if repeated:
            raise InvalidRequestError(
                f"job {job_id!r} names {len(repeated)} node(s) more than once: {_named(repeated)}"
            )
        unknown = [n for n in named if n not in self._nodes]
        if unknown:
            raise InvalidRequestError(
                f"job {job_id!r} names {len(unknown)} node(s) no daemon registered: {_named(unknown)} "
                f"({len(self._nodes)} registered)"
            )
        return tuple(named)

    def get_job(self, job_id: str) -> Job:
        """Raises UnknownJobError."""
        try:
            return self._jobs[job_id]
        except KeyError:
            known = ", ".join(sorted(self._jobs)[:10]) or "none"
            raise UnknownJobError(f"no job {job_id!r} (jobs: {known})") from None

    def jobs(self) -> list[Job]:
        """Every job, sorted by id."""
        return [self._jobs[job_id] for job_id in sorted(self._jobs)]

    def drop_job(self, job_id: str) -> Job:
        job = self.get_job(job_id)
        del self._jobs[job_id], self._active[job_id]
        self._bump(jobs=1)
        self._record_changed("job", job_id)
        return job

    def drop_idle_job(self, job_id: str, min_idle: float, now: float) -> Job:
        """Drops the job only if it has been idle for ``min_idle`` seconds at
        ``now``: a prune that listed it idle must not drop it once a rank has
        joined or reported an epoch since.

        Raises:
            UnknownJobError: no such job.
            InvalidRequestError: ``min_idle`` is negative or not a number.
            JobActiveError: the job was active more recently.
        """
        if not min_idle >= 0:
            raise InvalidRequestError(f"minimum idle time {min_idle} is not a number of seconds >= 0")
        self.get_job(job_id)
        idle = now - self._active[job_id]
        if idle < min_idle:
            raise JobActiveError(
                f"job {job_id!r} was active {idle:.0f}s ago, less than the {min_idle:.0f}s idle asked for"
            )
        return self.drop_job(job_id)

    def expire_jobs(self, ttl: float, now: float) -> list[tuple[Job, float]]:
        """Drops every job idle for ``ttl`` seconds or more at ``now``, as
        :meth:`drop_job` does; returns each with its idle seconds.

        A scan of every job: at one scan a minute, even 100,000 jobs cost the
        loop a few milliseconds, less than keeping them in order of activity
        at every join.
        """
        expired = [(self._jobs[job_id], now - at) for job_id, at in self._active.items() if now - at >= ttl]
        for job, _ in expired:
            del self._jobs[job.spec.job_id], self._active[job.spec.job_id]
            self._record_changed("job", job.spec.job_id)
        if expired:
            self.jobs_expired += len(expired)
            self._bump(jobs=1)
        return expired

    def report_epoch(
        self, job_id: str, epoch: int, now: float, wall: float | None = None, lost: Iterable[str] = ()
    ) -> Job:
        """Raises the job's epoch to ``epoch`` and marks it active at ``now``
        (Unix time ``wall``); an older report changes only the activity. In
        a mode whose owners move, the nodes the reporter counts ``lost`` that
        are listed down here become absent, and absent nodes listed up again
        come back (:func:`~dataquay.server.planning.absences.follow_absences`).

        Raises:
            EpochTooFarError: see :func:`~dataquay.client.jobs.check_epoch_ahead`.
        """
        if epoch > MAX_EPOCH:
            raise InvalidRequestError(f"epoch {epoch} is beyond the last one a job may reach ({MAX_EPOCH})")
        job = self.get_job(job_id)
        check_epoch_ahead(job_id, job.spec.mode, epoch, job.epoch)
        changed = replace(job, epoch=max(epoch, job.epoch), started=True)
        if MODES[job.spec.mode].owners_move:
            lost = set(lost)
            # Only the names in question: a report of a job on 4,096 nodes must not walk them all.
            named = lost | {a.node for a in job.absences}
            up = {name for name in named if (node := self._nodes.get(name)) is not None and node.up}
            absences = follow_absences(job.absences, job.spec.nodes, lost, up, changed.epoch)
            changed = replace(changed, absences=absences)
        if changed != job:
            if changed.absences != job.absences:
                self._bump(jobs=1)  # every node steps its holders by them: its copy must follow
            job = self._jobs[job_id] = changed
            self.revision += 1
            self._record_changed("job", job_id)
        return self._touch(job, now, wall)

    def _touch(self, job: Job, now: float, wall: float | None) -> Job:
        """Marks ``job`` active at ``now`` (Unix time ``wall``, default ``now``);
        see :data:`ACTIVITY_WRITE_SECONDS` for when that alone moves the revision."""
        job_id = job.spec.job_id
        last = self._active[job_id]
        if now <= last:
            return job
        if now // ACTIVITY_WRITE_SECONDS != last // ACTIVITY_WRITE_SECONDS:
            self.revision += 1
            self._record_changed("job", job_id)
        self._active[job_id] = now
        job = self._jobs[job_id] = replace(job, last_active=now if wall is None else wall)
        return job

    # ------------------------------------------------ a shared store's copy

    def _record_changed(self, kind: str, key: str) -> None:
        if self.changed is not None:
            self.changed.add((kind, key))

    def apply_node(self, node: Node, up: bool, now: float) -> None:
        """Takes ``node`` as another replica wrote it (``up``: its lease runs).

        What this replica heard itself is kept where the record is silent on
        it: the cache usage and last heartbeat it was told, and the highest
        datagram sequence, unless the record is of another registration.
        """
        mine = self._nodes.get(node.info.name)
        if mine is not None and (mine.info, mine.registered, mine.identity, mine.session) == (
            node.info,
            node.registered,
            node.identity,
            node.session,
        ):
            self.apply_up(node.info.name, up, now)
            return
        if mine is not None and mine.session == node.session:
            node.beat_sequence = mine.beat_sequence
        node.up = up
        self._nodes[node.info.name] = node
        self._leases.pop(node.info.name, None)
        if up:
            self._renew(node.info.name, now)
        self.node_log.mark(node.info.name)
        self._nodes_changed(now)

    def apply_up(self, name: str, up: bool, now: float) -> None:
        """Marks the node up or down as the shared store says (its lease granted or ended)."""
        node = self._nodes.get(name)
        if node is None or (node.up == up and (name in self._leases) == up):
            return
        node.up = up
        if up:
            self._renew(name, now)
        else:
            self._leases.pop(name, None)
        self.node_log.mark(name)
        self._nodes_changed(now)

    def apply_job(self, job: Job, now: float, wall: float) -> None:
        """Takes ``job`` as another replica wrote it; its idle time counts from its
        record's last activity (Unix time ``wall`` is ``now``)."""
        job_id = job.spec.job_id
        if self._jobs.get(job_id) == job:
            return
        self._jobs[job_id] = job
        self._active[job_id] = now - max(0.0, wall - job.last_active)
        self._bump(jobs=1)

    def apply_job_dropped(self, job_id: str) -> None:
        """Forgets a job another replica dropped."""
        if self._jobs.pop(job_id, None) is not None:
            del self._active[job_id]
            self._bump(jobs=1)

    # ---------------------------------------------------------- persistence

    def _bump(self, datasets: int = 0, jobs: int = 0) -> None:
        v = self.versions
        self.versions = Versions(v.nodes, v.datasets + datasets, v.jobs + jobs)
        self.revision += 1

    def snapshot(self) -> StateSnapshot:
        """The state as of now, cheap enough to take on the event loop.

        Jobs and versions are immutable, so a shallow copy of the job table
        stands for them; only nodes, which heartbeats change in place, are
        copied field by field. The snapshot is then serialised off the loop.
        """
        return StateSnapshot(
            self.revision,
            self.versions,
            [{**vars(n), "info": vars(n.info)} for n in self._nodes.values()],
            dict(self._jobs),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able document of everything but leases and heartbeat counts."""
        return self.snapshot().to_json()

    @classmethod
    def from_json(
        cls,
        doc: dict[str, Any],
        lease_seconds: float,
        now: float,
        publish_seconds: float = 0.0,
        wall: float | None = None,
    ) -> DirectoryState:
        """The state a directory restarted at ``now`` resumes from.

        Nodes that were up get a fresh lease from ``now``, so a restart does
        not mark a running job's nodes down; every version moves (and the
        revision, so the moved versions are written), so daemons refetch
        whatever may have changed while the directory was away, the node list
        whole (:func:`~.node_log.first_version`).
        ``wall`` is ``now`` as Unix time (default ``now``): a job's written
        activity counts as that long before ``now``, one in the future as ``now``.

        Raises:
            ValueError: a document this version cannot read
                (:class:`~dataquay.server.errors.StateFileError`: a field's
                path, its value and what it should be).
        """
        check_state(doc, STATE_FORMAT)
        state = cls(lease_seconds, publish_seconds)
        wall = now if wall is None else wall
        try:
            for raw in doc["nodes"]:
                node = Node(**{**raw, "info": NodeInfo(**raw["info"])})
                state._nodes[node.info.name] = node
                if node.up:
                    state._renew(node.info.name, now)
                    state._unheard.add(node.info.name)
            for raw in doc["jobs"]:
                job = Job.from_json(raw)
                state._jobs[job.spec.job_id] = job
                state._active[job.spec.job_id] = now - max(0.0, wall - job.last_active)
            v = Versions(**doc["versions"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed state: {exc!r}") from None
        state.node_log = NodeLog(publish_seconds, first_version(v.nodes, wall))
        state.versions = replace(v, nodes=state.node_log.version)
        state._bump(datasets=1, jobs=1)
        return state


class StateSnapshot(NamedTuple):
    """A copy of the persisted part of :class:`DirectoryState` that later changes do not touch."""

    revision: int
    versions: Versions
    nodes: list[dict[str, Any]]
    jobs: dict[str, Job]

    def to_json(self) -> dict[str, Any]:
        """The document :meth:`DirectoryState.from_json` reads."""
        return {
            "format": STATE_FORMAT,
            "versions": asdict(self.versions),
            "nodes": self.nodes,
            "jobs": [job.to_json() for _, job in sorted(self.jobs.items())],
        }


def identity_of(key: bytes) -> str:
    """The identity the directory keeps of a node's key: its SHA-256, so that
    the state file holds nothing a daemon could register with.

    Raises:
        InvalidRequestError: no key, or one of another length than daemons make.
    """
    if not key:
        raise InvalidRequestError("a node registered without an identity key (a daemon keeps one in its cache dir)")
    if len(key) != IDENTITY_KEY_BYTES:
        raise InvalidRequestError(f"identity key of {len(key)} bytes, expected {IDENTITY_KEY_BYTES}")
    return hashlib.sha256(key).hexdigest()


def _random_session() -> int:
    return secrets.randbits(64) or 1


def _check_node(info: NodeInfo) -> None:
    if not _NODE_NAME.match(info.name):
        raise InvalidRequestError(
            f"bad node name {info.name!r}: use 1-255 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    if not _ADDRESS.match(info.tcp_address):
        raise InvalidRequestError(f"node {info.name!r}: bad tcp address {info.tcp_address!r}, expected HOST:PORT")
    if info.bulk_address and not _ADDRESS.match(info.bulk_address):
        raise InvalidRequestError(f"node {info.name!r}: bad bulk address {info.bulk_address!r}, expected HOST:PORT")
    if info.metrics_address and not _ADDRESS.match(info.metrics_address):
        raise InvalidRequestError(
            f"node {info.name!r}: bad metrics address {info.metrics_address!r}, expected HOST:PORT"
        )


def _show(value: object) -> str:
    """A setting as a mismatch message shows it; long node lists are cut."""
    if isinstance(value, tuple):
        return f"[{_named(value)}] ({len(value)} nodes)"
    return repr(value)


def _named(names: Sequence[str], most: int = 6) -> str:
    """Node names as a message lists them: the first ``most``, then "..." (a
    job may name thousands)."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")
