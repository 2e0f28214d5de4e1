"""ListNodes replies at thousands of nodes, built without a message per node per call.

Building a NodeStatus in Python costs microseconds, a list of 4,096 of them
about 10 ms, and encoding such a reply for each caller another 0.5 ms. So
each node's entry is encoded once per change of the node (and once per
heartbeat period, for its cache usage), the whole list's entries are kept in
order and updated by the names the log marked since (a booting cluster's
every registration is followed by a whole list for the node that made it),
and replies are encoded bytes, joined from the entries (a message's fields
may come in any order, and a repeated field's entries concatenate) and kept:
the whole list until a node changes, the changes since a version until the
next version. The servicer sends them as they are
(:class:`~dataquay.server.interceptors.EncodedReplies`).

A kept reply is at most a heartbeat period old, and a delta may carry a node
as it is later than at the version it answers for: applying it again when a
later version names the node changes nothing, so copies still converge.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.directory.records import Node, NodeInfo
from dataquay.server.directory.state import DirectoryState


def node_status(node: Node) -> jpb.NodeStatus:
    i = node.info
    return jpb.NodeStatus(
        info=jpb.NodeInfo(
            name=i.name,
            tcp_address=i.tcp_address,
            metrics_address=i.metrics_address,
            cache_capacity=i.cache_capacity,
            pid=i.pid,
            version=i.version,
            bulk_address=i.bulk_address,
        ),
        state=jpb.NODE_UP if node.up else jpb.NODE_DOWN,
        registered_unix=node.registered,
        last_heartbeat_unix=node.last_heartbeat,
        cache_used_bytes=node.cache_used_bytes,
        cache_entries=node.cache_entries,
    )


class NodeListing:
    """The replies to ListNodes; see the module docstring.

    Args:
        max_age: how long, in seconds, an encoded entry or a reply is kept
            (the heartbeat period: the age of what heartbeats report anyway).
    """

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        #: Replies sent, by kind ("full", "delta").
        self.sent: Counter[str] = Counter()
        #: name -> (info, up, registered, when encoded, the entry as field 1 of a ListNodesReply)
        self._entries: dict[str, tuple[NodeInfo, bool, float, float, bytes]] = {}
        self._full: tuple[tuple[int, int], float, bytes] | None = None
        #: The whole list's names in order and their entries, as of :attr:`_marks` marks of the log.
        self._order: list[str] = []
        self._blobs: list[bytes] = []
        self._marks = -1
        self._ordered_at = 0.0
        self._deltas: dict[int, bytes] = {}
        self._deltas_of: tuple[int, float] = (-1, 0.0)

    def reply(self, state: DirectoryState, since: int, versions: dpb.Versions, now: float) -> bytes:
        """The encoded ListNodesReply to a caller holding node-set version
        ``since`` (0: none), carrying ``versions``."""
        changed = state.node_log.changes_since(since)
        self.sent["full" if changed is None else "delta"] += 1
        if changed is None:
            return self._whole(state, versions, now)
        if self._deltas_of[0] != versions.nodes or not 0 <= now - self._deltas_of[1] < self.max_age:
            self._deltas, self._deltas_of = {}, (versions.nodes, now)
        reply = self._deltas.get(since)
        if reply is None:
            names = sorted(changed)
            nodes = [node for node in map(state.node, names) if node is not None]
            tail = dpb.ListNodesReply(
                versions=versions, delta=True, removed=[name for name in names if state.node(name) is None]
            )
            reply = b"".join([self._entry(n, now) for n in nodes]) + tail.SerializeToString()
            self._deltas[since] = reply
        return reply

    def _whole(self, state: DirectoryState, versions: dpb.Versions, now: float) -> bytes:
        key = (state.node_log.marks, versions.nodes)
        if self._full is not None and self._full[0] == key and 0 <= now - self._full[1] < self.max_age:
            return self._full[2]
        self._follow(state, now)
        reply = b"".join(self._blobs) + dpb.ListNodesReply(versions=versions).SerializeToString()
        self._full = (key, now, reply)
        return reply

    def _follow(self, state: DirectoryState, now: float) -> None:
        """Brings the ordered entries up to the log's marks, entry by entry, or
        all of them when the journal does not reach back or they are a period old."""
        log = state.node_log
        changed = log.marked_since(self._marks)
        if changed is None or not 0 <= now - self._ordered_at < self.max_age:
            nodes = state.nodes()
            self._order = [node.info.name for node in nodes]
            self._blobs = [self._entry(node, now) for node in nodes]
            self._ordered_at = now
        else:
            for name in set(changed):
                node, i = state.node(name), bisect_left(self._order, name)
                listed = i < len(self._order) and self._order[i] == name
                if node is None:
                    if listed:
                        del self._order[i], self._blobs[i]
                elif listed:
                    self._blobs[i] = self._entry(node, now)
                else:
                    self._order.insert(i, name)
                    self._blobs.insert(i, self._entry(node, now))
        self._marks = log.marks

    def _entry(self, node: Node, now: float) -> bytes:
        kept = self._entries.get(node.info.name)
        if (
            kept is not None
            and kept[0] is node.info
            and kept[1] == node.up
            and kept[2] == node.registered
            and 0 <= now - kept[3] < self.max_age
        ):
            return kept[4]
        encoded = dpb.ListNodesReply(nodes=[node_status(node)]).SerializeToString()
        self._entries[node.info.name] = (node.info, node.up, node.registered, now, encoded)
        return encoded
