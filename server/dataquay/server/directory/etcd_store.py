"""The directory's state in etcd v3, shared by several directory processes.

Why: a single directory with a state file is a single point of failure; a
site that runs etcd already has a replicated store with leases and watches.
Each directory process (replica) keeps the whole state in memory, as the
embedded store's directory does, and answers every call from it; what a
call changes is written to etcd before the call returns, and every replica
follows etcd's changes through one watch, so that any replica answers any
call. Keys, under ``dataquay/``::

    nodes/<name>       a node's registration (JSON)
    up/<name>          present while the node's lease runs, attached to the etcd lease
                       of the replica the node beats at
    jobs/<id>          a job record (JSON)
    datasets/<name>    a dataset's record (JSON); its manifest in manifests/<name>/<id>/<chunk>
    leader             the replica doing the periodic work, attached to that replica's lease

A node's lease is counted, in memory, by the replica it beats at, which
deletes the node's up key when the beats stop for --lease-seconds; every
replica marks the node down on that deletion. A beat costs no message to
etcd: each replica holds one etcd lease for the up keys of the nodes
beating at it and renews that one lease a few times a lease. When a
replica dies its etcd lease ends, between 1.25 and 1.5 leases after its
last renewal, and etcd deletes the up keys still attached to it: the
nodes that beat on at another replica were moved to that replica's lease
by their first beat there (one write per node), so only those whose beats
stopped with it are listed down, never before a lease after their last beat.

The replica holding ``leader`` (created only if absent, in a transaction,
attached to its own lease) drops idle jobs; when it dies its lease ends
and another takes the key within a lease.

What replicas do not share: a node's cache usage and last heartbeat (each
knows what beats it received; writing them would be a write per beat) and
node-set version numbers (a daemon that moves to another replica fetches
the whole list once). Two replicas creating the same job at the same
moment: the later write wins, as for every record.

With etcd down, replicas answer from what they hold: reads, listings and
heartbeats go on; calls that change the state fail with
:class:`~dataquay.server.errors.DirectoryUnavailableError`, as they do
while the embedded store's directory is down. Once etcd is back, leases
that ended meanwhile mark their nodes down, and those nodes' next beats
bring them up again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import grpc

from dataquay.protos import etcd_kv_pb2 as kv
from dataquay.protos import etcd_rpc_pb2 as epb
from dataquay.server.config import DirectoryConfig
from dataquay.server.directory.etcd_client import MAX_VALUE_BYTES, EtcdClient, absent, delete, parse_endpoints, put
from dataquay.server.directory.node_log import NodeLog, first_version
from dataquay.server.directory.records import Job, Node, NodeInfo
from dataquay.server.directory.state import DirectoryState
from dataquay.server.errors import DataquayError, DirectoryUnavailableError, StartupError
from dataquay.server.registry import Registered, Registry
from dataquay.server.task_group import TaskGroup

log = logging.getLogger("dataquay.directory")

PREFIX = b"dataquay/"
NODES, UP, JOBS, DATASETS, MANIFESTS = (PREFIX + k for k in (b"nodes/", b"up/", b"jobs/", b"datasets/", b"manifests/"))
LEADER = PREFIX + b"leader"
#: How long a change waits for others to share its write.
GROUP_WRITE_SECONDS = 0.005
#: Records written at once: a booting cluster's registrations go in parallel, bounded.
PARALLEL_WRITES = 64
#: Lease renewals waiting for the stream; past it (etcd unreachable) the newest are not sent.
KEEPALIVE_QUEUE = 1 << 16
#: Wait before a broken watch or keep-alive stream is opened again.
RECONNECT_SECONDS = 0.5
#: The least TTL etcd grants (its election timeout bounds it).
MIN_TTL_SECONDS = 2
#: The etcd lease a replica's nodes' up keys share lasts this fraction of
#: --lease-seconds longer than a lease and is renewed four times a lease: when
#: the replica dies it ends at least a lease after a beat the replica took.
NODE_LEASE_MARGIN = 0.5
#: The most a node whose beats stopped waits past its lease to be listed
#: down (the replica's scan for such nodes runs this often, or 8 times a lease).
EXPIRY_SCAN_SECONDS = 0.5
#: Nodes written in one transaction: two operations each, within etcd's
#: default --max-txn-ops (128).
NODES_PER_TXN = 64
#: Such transactions (and their lease grants) under way at once: a booting
#: cluster's registrations are answered in a few round trips, not one per 64.
PARALLEL_TXNS = 8


class EtcdStore:
    """The etcd store of one replica; see the module docstring.

    Args:
        config: the directory's config; ``config.store`` is the etcd:// URL.
        state: the server's current state (the one :meth:`open` returned).
        registry: the replica's dataset registry, a copy of etcd's.
    """

    def __init__(self, config: DirectoryConfig, state: Callable[[], DirectoryState], registry: Registry) -> None:
        self.config = config
        self.client = EtcdClient(parse_endpoints(config.store))
        self.leader = False
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._ttl = max(MIN_TTL_SECONDS, math.ceil(config.lease_seconds))
        self._node_ttl = max(MIN_TTL_SECONDS, math.ceil(config.lease_seconds * (1 + NODE_LEASE_MARGIN)))
        self._scan_seconds = min(EXPIRY_SCAN_SECONDS, config.lease_seconds / 8)
        self._state = state
        self._registry = registry
        #: The etcd lease each node's up key has, for the nodes up (whose up key exists).
        self._owner: dict[str, int] = {}
        #: When each node last beat here or was written here (monotonic clock).
        self._beat_at: dict[str, float] = {}
        #: This replica's etcd lease for the up keys of nodes beating at it (0: none yet).
        self._node_lease = 0
        self._granting = asyncio.Lock()
        #: The revision this replica has applied up to.
        self.revision = 0
        #: key -> revision of this replica's latest write of it: its echo, and older events, change nothing.
        self._own: dict[bytes, int] = {}
        #: key -> value this replica is writing: its echo may come before the write's answer.
        self._writing: dict[bytes, bytes] = {}
        self._dirty = asyncio.Event()
        self._next_write: asyncio.Future[None] | None = None
        self._renewals: asyncio.Queue[int] = asyncio.Queue(KEEPALIVE_QUEUE)
        self._my_lease = 0

    # ------------------------------------------------------------- start-up

    async def open(self) -> DirectoryState:
        config, wall = self.config, time.time()
        # No lease ends here: etcd ends them, and the watch says so.
        state = DirectoryState(math.inf, config.heartbeat_seconds)
        # Each replica numbers its own node-set versions: apart from another's started the same second.
        state.node_log = NodeLog(config.heartbeat_seconds, first_version(0, wall) + (secrets.randbits(24) << 8))
        state.versions = replace(state.versions, nodes=state.node_log.version)
        try:
            await self._resync(state)
        except (DirectoryUnavailableError, grpc.aio.AioRpcError) as exc:
            raise StartupError(f"cannot read the directory's state from {config.store}: {exc}") from exc
        state.changed = set()
        up, down = state.node_counts()
        log.info(
            "state read from etcd",
            extra={
                "fields": {
                    "store": config.store,
                    "revision": self.revision,
                    "nodes_up": up,
                    "nodes_down": down,
                    "jobs": len(state.jobs()),
                    "replica": self.replica,
                }
            },
        )
        return state

    async def _resync(self, state: DirectoryState) -> None:
        """Makes ``state`` etcd's, as of one revision (manifests are read per dataset, when needed)."""
        reply = await self.client.range_prefix(NODES)
        for kind in (UP, JOBS, DATASETS):
            reply.kvs.extend((await self.client.range_prefix(kind, reply.header.revision)).kvs)
        now, wall = time.monotonic(), time.time()
        nodes: dict[str, Node] = {}
        jobs: dict[str, Job] = {}
        datasets: dict[str, dict[str, Any]] = {}
        self._owner = {}
        for item in reply.kvs:
            kind, name = _split(item.key)
            if kind == UP:
                self._owner[name] = item.lease
            elif kind == NODES:
                nodes[name] = _node(item.value)
            elif kind == JOBS:
                jobs[name] = _job(item.value)
            elif kind == DATASETS:
                datasets[name] = json.loads(item.value)
        for node in nodes.values():
            state.apply_node(node, node.info.name in self._owner, now)
        for name, lease in self._owner.items():
            if lease == self._node_lease:
                self._beat_at.setdefault(name, now)
        for node in state.nodes():
            if node.info.name not in nodes:
                state.apply_up(node.info.name, False, now)
        for job in jobs.values():
            state.apply_job(job, now, wall)
        for job in state.jobs():
            if job.spec.job_id not in jobs:
                state.apply_job_dropped(job.spec.job_id)
        for name in self._registry.names():
            if name not in datasets:
                self._drop_local_dataset(state, name)
        for name, record in datasets.items():
            await self._fetch_dataset(state, name, record)
        self.revision = reply.header.revision
        self._own = {key: at for key, at in self._own.items() if at > self.revision}

    def start(self, tasks: TaskGroup) -> None:
        tasks.spawn(self._write_changes(), "etcd-writer")
        tasks.spawn(self._follow(), "etcd-watch")
        tasks.spawn(self._renew(), "etcd-keepalive")
        tasks.spawn(self._keep_node_lease(), "etcd-node-lease")
        tasks.spawn(self._expire_nodes(), "etcd-node-expiry")
        tasks.spawn(self._elect(), "etcd-election")

    # ------------------------------------------------------------- writing

    def changed(self) -> None:
        if self._state().changed:
            self._dirty.set()

    async def persist(self) -> None:
        """Returns once what changed so far is in etcd; shares the write with
        every call that changes the state before it begins.

        Raises:
            DirectoryUnavailableError: etcd does not answer.
        """
        if self._next_write is None:
            self._next_write = asyncio.get_running_loop().create_future()
        waiter = self._next_write
        self._dirty.set()
        await asyncio.shield(waiter)

    async def _write_changes(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(GROUP_WRITE_SECONDS)
            self._dirty.clear()
            waiter, self._next_write = self._next_write, None
            state = self._state()
            changed, state.changed = state.changed or set(), set()
            written: set[tuple[str, str]] = set()
            error: BaseException | None = None
            try:
                await self._write_all(state, sorted(changed), written)
            except (DirectoryUnavailableError, grpc.aio.AioRpcError) as exc:
                error = (
                    exc
                    if isinstance(exc, DataquayError)
                    else DirectoryUnavailableError(f"the directory's etcd store refused a write: {exc.details()}")
                )
            except Exception as exc:  # the writer must outlive it: its waiters would wait forever
                log.exception("writing to etcd failed")
                error = DirectoryUnavailableError(f"the directory's etcd store could not be written: {exc}")
            if error is not None:
                state.changed = (state.changed or set()) | (changed - written)
                log.warning(
                    "cannot write to etcd; kept to write again",
                    extra={"fields": {"records": len(changed - written), "error": str(error)}},
                )
            if waiter is not None:
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)

    async def _write_all(
        self, state: DirectoryState, changed: list[tuple[str, str]], written: set[tuple[str, str]]
    ) -> None:
        """Writes ``changed``, adding to ``written`` what is in etcd, so that a
        failure leaves only the rest to write again."""
        created = {key for kind, key in changed if kind == "new-job"}
        written |= {("job", key) for key in created}
        nodes = [key for kind, key in changed if kind == "node"]
        jobs = [(kind, key) for kind, key in changed if kind != "node" and not (kind == "job" and key in created)]
        bound = asyncio.Semaphore(PARALLEL_TXNS)

        async def write(batch: list[str]) -> None:
            async with bound:
                await self._write_nodes(state, batch)
            written.update(("node", key) for key in batch)

        await asyncio.gather(*(write(nodes[i : i + NODES_PER_TXN]) for i in range(0, len(nodes), NODES_PER_TXN)))
        for start in range(0, len(jobs), PARALLEL_WRITES):
            records = jobs[start : start + PARALLEL_WRITES]
            await asyncio.gather(*(self._write_job(state, key, new=kind == "new-job") for kind, key in records))
            written |= set(records)

    async def _write_nodes(self, state: DirectoryState, names: list[str]) -> None:
        """Nodes that registered, came back up or moved their beats here: their
        records, and their up keys attached to this replica's etcd lease, in one
        transaction. A node down needs no write here: its counting replica
        deleted its up key. A fresh etcd lease is granted if etcd says this
        replica's is gone."""
        nodes = [node for node in map(state.node, names) if node is not None and node.up]
        if not nodes:
            return
        lease = await self._lease_for_nodes()
        try:
            await self._put_nodes(nodes, lease)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise
            lease = await self._lease_for_nodes(gone=lease)
            await self._put_nodes(nodes, lease)
        now = time.monotonic()
        for node in nodes:
            self._owner[node.info.name] = lease
            self._beat_at[node.info.name] = now

    async def _lease_for_nodes(self, gone: int = 0) -> int:
        """This replica's etcd lease for its nodes' up keys, granted if it has
        none or its lease is ``gone``; one grant for all the writes waiting."""
        async with self._granting:
            if not self._node_lease or self._node_lease == gone:
                self._node_lease = await self.client.grant(self._node_ttl)
            return self._node_lease

    async def _put_nodes(self, nodes: list[Node], lease: int) -> None:
        """Writes ``nodes``, their up keys attached to ``lease``."""
        ops, writes = [], {}
        for node in nodes:
            key = node.info.name.encode()
            record = {
                "info": vars(node.info),
                "registered": node.registered,
                "identity": node.identity,
                "session": node.session,
            }
            writes[NODES + key], writes[UP + key] = json.dumps(record).encode(), b""
            ops += [put(NODES + key, writes[NODES + key]), put(UP + key, b"", lease)]
        await self._own_txn(epb.TxnRequest(success=ops), writes)

    async def _write_job(self, state: DirectoryState, job_id: str, new: bool) -> None:
        key = JOBS + job_id.encode()
        job = _find_job(state, job_id)
        if job is None:
            await self._own_txn(epb.TxnRequest(success=[delete(key)]), {key: b""})
            return
        value = json.dumps(job.to_json()).encode()
        if not new:
            await self._own_txn(epb.TxnRequest(success=[put(key, value)]), {key: value})
            return
        # Created here: made only if absent, else the record another replica made is taken.
        reply = await self._own_txn(
            epb.TxnRequest(
                compare=[absent(key)],
                success=[put(key, value)],
                failure=[epb.RequestOp(request_range=epb.RangeRequest(key=key))],
            ),
            {key: value},
        )
        kvs = [] if reply.succeeded else reply.responses[0].response_range.kvs
        if kvs:
            state.apply_job(_job(kvs[0].value), time.monotonic(), time.time())

    async def _own_txn(self, request: epb.TxnRequest, writes: dict[bytes, bytes]) -> epb.TxnResponse:
        """Runs ``request``, which writes ``writes`` (key -> value, b"" for a
        deletion), so that the watch takes their echo for this replica's own,
        whether it comes before the answer or after."""
        self._writing.update(writes)
        try:
            reply = await self.client.txn(request)
        finally:
            for key in writes:
                self._writing.pop(key, None)
        if reply.succeeded and reply.header.revision > self.revision:
            for key in writes:
                self._own[key] = reply.header.revision
        return reply

    async def dataset_added(self, entry: Registered) -> None:
        """Writes the manifest in chunks, then the record that names them; then
        drops the chunks of the manifest it replaced."""
        name, record = entry.record.name, entry.record
        data = entry.manifest.data
        chunks = max(1, math.ceil(len(data) / MAX_VALUE_BYTES))
        base = MANIFESTS + f"{name}/{record.manifest_id}/".encode()
        for i in range(chunks):
            part = bytes(data[i * MAX_VALUE_BYTES : (i + 1) * MAX_VALUE_BYTES])
            await self.client.txn(epb.TxnRequest(success=[put(base + b"%06d" % i, part)]))
        value = json.dumps({**asdict(record), "chunks": chunks}).encode()
        key = DATASETS + name.encode()
        await self._own_txn(epb.TxnRequest(success=[put(key, value)]), {key: value})
        await self._drop_chunks(name, keep=record.manifest_id)

    async def dataset_dropped(self, name: str) -> None:
        key = DATASETS + name.encode()
        await self._own_txn(epb.TxnRequest(success=[delete(key)]), {key: b""})
        await self._drop_chunks(name, keep="")

    async def _drop_chunks(self, name: str, keep: str) -> None:
        listed = await self.client.range_prefix(MANIFESTS + f"{name}/".encode())
        stale = {item.key.rsplit(b"/", 1)[0] + b"/" for item in listed.kvs} - {MANIFESTS + f"{name}/{keep}/".encode()}
        for prefix in sorted(stale):
            await self.client.txn(epb.TxnRequest(success=[delete(prefix, prefix=True)]))

    async def _fetch_dataset(self, state: DirectoryState, name: str, record: dict[str, Any]) -> None:
        """Copies a dataset another replica registered into this replica's registry,
        from etcd: no replica reads the dataset's files to serve it."""
        if name in self._registry.names() and self._registry.get(name).record.manifest_id == record["manifest_id"]:
            return
        listed = await self.client.range_prefix(MANIFESTS + f"{name}/{record['manifest_id']}/".encode())
        if len(listed.kvs) != record["chunks"]:
            log.warning(
                "dataset manifest incomplete in etcd; not served here until it is written again",
                extra={"fields": {"dataset": name, "chunks": len(listed.kvs), "expected": record["chunks"]}},
            )
            return
        data = b"".join(item.value for item in sorted(listed.kvs, key=lambda item: item.key))
        self._registry.add(name, data, replace=True)
        state.datasets_changed()

    def _drop_local_dataset(self, state: DirectoryState, name: str) -> None:
        if name in self._registry.names():
            self._registry.drop(name)
            state.datasets_changed()

    # ----------------------------------------------------------- following

    async def _follow(self) -> None:
        """Applies every change in etcd to this replica's state, in revision order."""
        while True:
            channel = self.client.channel()
            try:
                async for reply in self.client.watch(channel, PREFIX, self.revision + 1):
                    if reply.canceled:
                        log.warning(
                            "etcd cancelled the watch; reading everything again",
                            extra={
                                "fields": {"reason": reply.cancel_reason, "compact_revision": reply.compact_revision}
                            },
                        )
                        await self._resync(self._state())
                        break
                    await self._apply(reply)
            except (grpc.aio.AioRpcError, DirectoryUnavailableError) as exc:
                log.debug("etcd watch broke", extra={"fields": {"error": str(exc)}})
                await self.client.reconnect(channel)
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _apply(self, reply: epb.WatchResponse) -> None:
        state, now, wall = self._state(), time.monotonic(), time.time()
        for event in reply.events:
            revision, key = event.kv.mod_revision, event.kv.key
            own = self._own.get(key, 0)
            if own == revision:
                del self._own[key]
            echo = self._writing.get(key) == (b"" if event.type == kv.Event.DELETE else event.kv.value)
            if own < revision and not echo:
                await self._apply_event(state, event, now, wall)
            self.revision = max(self.revision, revision)
        if not reply.events:
            self.revision = max(self.revision, reply.header.revision)

    async def _apply_event(self, state: DirectoryState, event: kv.Event, now: float, wall: float) -> None:
        kind, name = _split(event.kv.key)
        deleted = event.type == kv.Event.DELETE
        if kind == UP:
            if deleted:
                self._owner.pop(name, None)
                node = state.node(name)
                if node is not None and node.up:
                    log.info("node down", extra={"fields": {"node": name, "lease_seconds": self.config.lease_seconds}})
            else:
                self._owner[name] = event.kv.lease
            state.apply_up(name, not deleted, now)
        elif kind == NODES and not deleted:
            state.apply_node(_node(event.kv.value), name in self._owner, now)
        elif kind == JOBS:
            if deleted:
                state.apply_job_dropped(name)
            else:
                state.apply_job(_job(event.kv.value), now, wall)
        elif kind == DATASETS:
            if deleted:
                self._drop_local_dataset(state, name)
            else:
                await self._fetch_dataset(state, name, json.loads(event.kv.value))

    # ------------------------------------------------------------ renewals

    def renewed(self, name: str) -> None:
        """Counts the node's lease from now, in memory: a beat costs etcd
        nothing unless the node's up key is on another replica's etcd lease
        (its beats moved here), then it is moved to this replica's, once."""
        self._beat_at[name] = time.monotonic()
        owner = self._owner.get(name)
        if owner is not None and owner != self._node_lease:
            changed = self._state().changed
            if changed is not None:
                changed.add(("node", name))
                self._dirty.set()

    async def _keep_node_lease(self) -> None:
        """Renews this replica's etcd lease for its nodes four times a lease."""
        while True:
            await asyncio.sleep(self.config.lease_seconds / 4)
            if self._node_lease:
                self._renew_lease(self._node_lease)

    async def _expire_nodes(self) -> None:
        """Deletes the up keys of the nodes counted here whose beats stopped for a lease."""
        bound = asyncio.Semaphore(PARALLEL_WRITES)

        async def end(name: str, lease: int) -> None:
            async with bound:
                await self._end_node(name, lease)

        while True:
            last = time.monotonic()
            await asyncio.sleep(self._scan_seconds)
            self._hold_leases(time.monotonic() - last - self._scan_seconds)
            lease, limit = self._node_lease, time.monotonic() - self.config.lease_seconds
            expired = [name for name, at in self._beat_at.items() if at < limit]
            for name in expired:
                if self._owner.get(name) != lease or not lease:
                    del self._beat_at[name]  # counted by another replica, or down
            await asyncio.gather(*(end(name, lease) for name in expired if name in self._beat_at))

    def _hold_leases(self, stalled: float) -> None:
        """The replica did not run for ``stalled`` seconds (stopped, its host hung):
        its nodes' leases run on from now, since the beats they sent meanwhile wait
        unread, as a single directory's do (the server logs the stall)."""
        if stalled > self.config.lease_seconds / 2:
            for name in self._beat_at:
                self._beat_at[name] += stalled

    async def _end_node(self, name: str, lease: int) -> None:
        """Deletes the node's up key if it is still on ``lease``; the watch
        then marks it down at every replica. While etcd does not answer the
        node stays up, and this is tried again at the next scan."""
        key = UP + name.encode()
        at = self._beat_at[name]
        try:
            await self.client.txn(
                epb.TxnRequest(
                    compare=[epb.Compare(result=epb.Compare.EQUAL, target=epb.Compare.LEASE, key=key, lease=lease)],
                    success=[delete(key)],
                )
            )
        except (DirectoryUnavailableError, grpc.aio.AioRpcError) as exc:
            log.debug("cannot end a node's lease in etcd", extra={"fields": {"node": name, "error": str(exc)}})
            return
        if self._beat_at.get(name) == at:
            del self._beat_at[name]

    def _renew_lease(self, lease: int) -> None:
        try:
            self._renewals.put_nowait(lease)
        except asyncio.QueueFull:
            pass  # etcd unreachable this long: the renewals queued already say it all

    async def _renew(self) -> None:
        """Sends lease renewals on one keep-alive stream, opened again when it breaks."""
        while True:
            channel = self.client.channel()
            try:
                async for reply in self.client.keep_alive(channel, self._renewals):
                    if reply.TTL <= 0 and reply.ID == self._my_lease:
                        self._my_lease = 0
                    if reply.TTL <= 0 and reply.ID == self._node_lease:
                        self._node_lease = 0  # etcd deleted its up keys: the watch marks those nodes down
            except (grpc.aio.AioRpcError, DirectoryUnavailableError) as exc:
                log.debug("etcd keep-alive broke", extra={"fields": {"error": str(exc)}})
                await self.client.reconnect(channel)
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _elect(self) -> None:
        """Holds or watches for the leader key, a third of a lease apart."""
        while True:
            was = self.leader
            try:
                self.leader = await self._campaign()
            except (DirectoryUnavailableError, grpc.aio.AioRpcError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError):
                    self._my_lease = 0  # "lease not found": it ended while etcd was away
                self.leader = False
            if self.leader != was:
                log.info(
                    "leading the directory's periodic work" if self.leader else "another replica leads",
                    extra={"fields": {"replica": self.replica}},
                )
            await asyncio.sleep(self._ttl / 3)

    async def _campaign(self) -> bool:
        if not self._my_lease:
            self._my_lease = await self.client.grant(self._ttl)
        self._renew_lease(self._my_lease)
        reply = await self.client.txn(
            epb.TxnRequest(
                compare=[absent(LEADER)],
                success=[put(LEADER, self.replica.encode(), self._my_lease)],
                failure=[epb.RequestOp(request_range=epb.RangeRequest(key=LEADER))],
            )
        )
        if reply.succeeded:
            return True
        held = reply.responses[0].response_range.kvs
        return bool(held) and held[0].value == self.replica.encode() and held[0].lease == self._my_lease

    async def close(self) -> None:
        """Gives the leader key up at once (so that another replica takes it now), then disconnects."""
        if self._my_lease:
            try:
                await self.client.revoke(self._my_lease)
            except (DirectoryUnavailableError, grpc.aio.AioRpcError):
                pass
        await self.client.close()


def _split(key: bytes) -> tuple[bytes, str]:
    """(kind prefix, name) of a key: (NODES, "n1") for dataquay/nodes/n1."""
    for kind in (NODES, UP, JOBS, DATASETS, MANIFESTS):
        if key.startswith(kind):
            return kind, key[len(kind) :].decode()
    return key, ""


def _node(value: bytes) -> Node:
    raw = json.loads(value)
    return Node(
        NodeInfo(**raw["info"]),
        registered=raw["registered"],
        last_heartbeat=raw["registered"],
        beat_sequence=0,
        identity=raw["identity"],
        session=raw["session"],
    )


def _job(value: bytes) -> Job:
    return Job.from_json(json.loads(value))


def _find_job(state: DirectoryState, job_id: str) -> Job | None:
    try:
        return state.get_job(job_id)
    except DataquayError:
        return None
