"""Who makes a call: the user the kernel names on a unix socket, found again on gRPC by a ticket.

On a raw unix socket the kernel says which process connected, with its uid
and gid (SO_PEERCRED) and its groups (SO_PEERGROUPS), as they were when it
connected: nothing the caller sends can change them. gRPC hides the socket,
so a client first asks the daemon's fd socket for a caller ticket
(:mod:`dataquay.client.wire.caller_ticket`); :class:`Tickets` binds a random one
to what the kernel said, for as long as that connection lives, and a gRPC
call on the unix socket that carries the ticket is that user's. Over TCP
the kernel names no user.
"""

from __future__ import annotations

import secrets
import socket
import struct
from dataclasses import dataclass

#: Linux's SO_PEERGROUPS (4.13); Python's socket module does not name it.
SO_PEERGROUPS = 59
#: The groups SO_PEERGROUPS returns in one call (Python's getsockopt takes at most 1024 bytes).
_GROUPS_BYTES = 1024
_PEERCRED = struct.Struct("3i")
#: Tickets one uid may hold at once (one per client process and daemon), and all users together.
MAX_TICKETS_PER_UID = 256
MAX_TICKETS = 4096


@dataclass(frozen=True)
class Caller:
    """A caller as the kernel named it; ``uid`` None where it named none (TCP)."""

    uid: int | None = None
    gids: frozenset[int] = frozenset()
    pid: int = 0
    #: A daemon of the cluster, over TCP with the node credential.
    node: bool = False

    @property
    def remote(self) -> bool:
        return self.uid is None


#: A caller over TCP with the cluster token: a trainer or tool of any user.
REMOTE = Caller()
#: A peer daemon over TCP (it holds the node token).
PEER_DAEMON = Caller(node=True)


def peer_caller(conn: socket.socket) -> Caller:
    """The process at the other end of unix socket ``conn``, as it was when it
    connected: its uid, primary and supplementary groups and pid.

    Raises:
        OSError: the kernel does not say (not a unix socket).
    """
    pid, uid, gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Caller(uid, frozenset({gid, *_peer_groups(conn, pid)}), pid)


def _peer_groups(conn: socket.socket, pid: int) -> tuple[int, ...]:
    """The peer's supplementary groups: from the kernel's record of the
    connection, or (more groups than fit one call, an older kernel) from the
    process's status while it holds the connection; none if neither says."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BYTES)
        return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


class Tickets:
    """The callers of live ticket connections, by ticket."""

    def __init__(self) -> None:
        self._callers: dict[str, Caller] = {}

    def issue(self, caller: Caller) -> str | None:
        """A fresh ticket for ``caller``; None when it (or everyone) holds as many as allowed."""
        held = sum(1 for c in self._callers.values() if c.uid == caller.uid)
        if held >= MAX_TICKETS_PER_UID or len(self._callers) >= MAX_TICKETS:
            return None
        ticket = secrets.token_hex(16)
        self._callers[ticket] = caller
        return ticket

    def revoke(self, ticket: str) -> None:
        self._callers.pop(ticket, None)

    def caller(self, ticket: str) -> Caller | None:
        return self._callers.get(ticket) if ticket else None

    def __len__(self) -> int:
        return len(self._callers)
