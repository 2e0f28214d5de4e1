"""The fd socket: where clients on this node hand their daemon sealed memfd segments.

It lies next to the daemon's unix socket (``<socket>.fds``, the same mode and
group), so the clients' trust checks of one hold for the other. A client
connects, sends one SOCK_SEQPACKET message (size and cluster token) carrying
one descriptor, and gets the segment's name or why it was refused (see
:mod:`dataquay.client.wire.memfd`). The connection then stays open as the
segment's lease: its end, whatever the client's way of ending, unmaps it.
Given ``reads``, it also carries the client's batch reads into that segment,
one request and one reply at a time (:mod:`dataquay.client.wire.batch_reads`);
anything else the client sends on it ends the lease.

A client may instead ask for a caller ticket (a message with the token and
no descriptor, :mod:`dataquay.client.wire.caller_ticket`): given ``tickets``, the
daemon binds one to the user the kernel names for the connection, which
stays open as the ticket's lease.

Everything runs as callbacks on the event loop (no task or thread per
connection): a handshake is a few system calls, bounded in time and in how
many may wait at once, and what a client sends can at worst be refused.
The kernel says which process connected (SO_PEERCRED); it is logged and
bounds how many segments one process keeps mapped.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import shutil
import socket
import struct
import time
from pathlib import Path

from dataquay.client.errors import SegmentRefusedError
from dataquay.client.wire import caller_ticket
from dataquay.client.wire.batch_reads import MAX_IDS, REQUEST_BYTES
from dataquay.client.wire.memfd import HANDSHAKE_SECONDS, MESSAGE_BYTES, parse_request, reply_message
from dataquay.server.errors import StartupError
from dataquay.server.listen import SocketIdentity, claim_socket_path, remove_own_socket, socket_identity
from dataquay.server.node.handoff.batch_reads import SegmentReads
from dataquay.server.node.handoff.segments import ShmSegments
from dataquay.server.node.users.callers import Caller, Tickets, peer_caller
from dataquay.server.task_group import Spawn

log = logging.getLogger("dataquay.daemon")

#: Connections that may be waiting for their message at once; more are closed at once.
MAX_HANDSHAKES = 32
#: A refusal is logged at most this often (a flood of them once).
REFUSAL_LOG_SECONDS = 10.0
#: How long accepting pauses when the daemon is out of descriptors.
ACCEPT_PAUSE_SECONDS = 1.0
_PEERCRED = struct.Struct("3i")


class SegmentSocket:
    """Takes sealed memfd segments into ``segments`` from clients that bring
    ``token``; answers their batch reads with ``reads``, each in a task of
    ``spawn``; and hands out caller tickets of ``tickets``."""

    def __init__(
        self,
        path: Path,
        segments: ShmSegments,
        token: str,
        reads: SegmentReads | None = None,
        spawn: Spawn | None = None,
        tickets: Tickets | None = None,
    ) -> None:
        self.path = path
        self.segments = segments
        self._token = token.encode()
        self._reads = reads if spawn is not None else None
        self._spawn = spawn
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[socket.socket, asyncio.TimerHandle] = {}
        self._tickets = tickets
        self._ticket_conns: dict[socket.socket, str] = {}
        self._logged_at = 0.0
        self.refused = 0
        #: The socket file this process bound, the only one it may remove.
        self._identity: SocketIdentity | None = None

    def open(self, group: str = "") -> None:
        """Listens on :attr:`path`, mode 0660 (of ``group`` when given).

        Raises:
            StartupError: the path is taken by something else than a stale
                socket, or the socket cannot be given to ``group``.
            OSError: the socket cannot be made (a path too long, no permission).
        """
        self._loop = asyncio.get_running_loop()
        claim_socket_path(self.path, group)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(str(self.path))
            self._identity = socket_identity(self.path)
            os.chmod(self.path, 0o660)
            if group:
                try:
                    shutil.chown(self.path, group=group)
                except (LookupError, OSError) as exc:
                    raise StartupError(f"cannot give socket {self.path} to group {group!r}: {exc}") from exc
            listener.listen(MAX_HANDSHAKES)
            listener.setblocking(False)
        except (OSError, StartupError):
            listener.close()
            remove_own_socket(self.path, self._identity)
            raise
        self._listener = listener
        self._loop.add_reader(listener.fileno(), self._accept)

    def close(self) -> None:
        """Stops taking segments (those taken stay mapped until ``segments`` closes)."""
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            remove_own_socket(self.path, self._identity)
        for conn in list(self._waiting):
            self._stop_waiting(conn)
            conn.close()
        for conn in list(self._ticket_conns):
            self._end_ticket(conn)

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of descriptors: the listener stays readable, so wait rather than spin.
                log.warning("cannot accept on the fd socket", extra={"fields": {"error": exc.strerror}})
                self._loop.remove_reader(self._listener.fileno())
                self._loop.call_later(ACCEPT_PAUSE_SECONDS, self._resume_accepting)
                return
            conn.setblocking(False)
            if len(self._waiting) >= MAX_HANDSHAKES:
                self._refuse(conn, _peer(conn), "too many clients handing over segments at once", busy=True)
                continue
            self._waiting[conn] = self._loop.call_later(HANDSHAKE_SECONDS, self._give_up, conn)
            self._loop.add_reader(conn.fileno(), self._handshake, conn)

    def _resume_accepting(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _give_up(self, conn: socket.socket) -> None:
        self._stop_waiting(conn)
        self._refuse(conn, _peer(conn), f"no message within {HANDSHAKE_SECONDS:.0f} s")

    def _stop_waiting(self, conn: socket.socket) -> None:
        timer = self._waiting.pop(conn, None)
        if timer is not None and self._loop is not None:
            timer.cancel()
            self._loop.remove_reader(conn.fileno())

    def _handshake(self, conn: socket.socket) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MESSAGE_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._stop_waiting(conn)
            conn.close()
            return
        self._stop_waiting(conn)
        pid, uid = _peer(conn)
        if not fds and not flags & socket.MSG_TRUNC and caller_ticket.is_request(data):
            self._issue_ticket(conn, data, (pid, uid))
            return
        try:
            name, size = self._adopt(conn, data, fds, flags, pid)
        except SegmentRefusedError as exc:
            self._refuse(conn, (pid, uid), str(exc))
            return
        finally:
            for fd in fds:
                os.close(fd)
        try:
            conn.send(reply_message(segment=name, reads=MAX_IDS if self._reads is not None else 0))
        except OSError:
            self.segments.drop(name)
            return
        assert self._loop is not None
        self._loop.add_reader(conn.fileno(), self._readable, conn, name, size, _caller(conn))
        log.info(
            "mapped a sealed shared memory segment",
            extra={"fields": {"pid": pid, "uid": uid, "mapped": self.segments.mapped}},
        )

    def _adopt(self, conn: socket.socket, data: bytes, fds: list[int], flags: int, pid: int) -> tuple[str, int]:
        if flags & socket.MSG_TRUNC:
            raise SegmentRefusedError(f"a message longer than {MESSAGE_BYTES} bytes")
        if flags & socket.MSG_CTRUNC or len(fds) != 1:
            raise SegmentRefusedError(
                f"a message must carry exactly one descriptor, not {len(fds) or 'none'}"
                + (" or more" if flags & socket.MSG_CTRUNC else "")
            )
        try:
            size, token = parse_request(data)
        except ValueError:
            raise SegmentRefusedError('a malformed message; expected {"size": N, "token": T}') from None
        self._check_token(token)
        return self.segments.adopt(fds[0], size, pid, lambda: self._release(conn)), size

    def _check_token(self, token: str) -> None:
        if self._token and not hmac.compare_digest(token.encode(), self._token):
            raise SegmentRefusedError(
                "missing or wrong cluster token" if token else "this daemon needs the cluster token"
            )

    def _issue_ticket(self, conn: socket.socket, data: bytes, who: tuple[int, int]) -> None:
        """Binds a caller ticket to the user the kernel names for ``conn``; the
        connection stays open as the ticket's lease."""
        try:
            if self._tickets is None:
                raise SegmentRefusedError("this daemon hands out no caller tickets")
            self._check_token(caller_ticket.parse_token(data))
            ticket = self._tickets.issue(peer_caller(conn))
            if ticket is None:
                raise SegmentRefusedError(f"uid {who[1]} holds as many caller tickets as one user may")
        except (SegmentRefusedError, OSError) as exc:
            self._refuse(conn, who, str(exc), what="a caller ticket")
            return
        try:
            conn.send(caller_ticket.reply_message(ticket=ticket))
        except OSError:
            self._tickets.revoke(ticket)
            conn.close()
            return
        assert self._loop is not None
        self._ticket_conns[conn] = ticket
        self._loop.add_reader(conn.fileno(), self._end_ticket, conn)

    def _end_ticket(self, conn: socket.socket) -> None:
        """The client closed its ticket's connection (or sent something, which it must not): the ticket ends."""
        ticket = self._ticket_conns.pop(conn, None)
        if ticket is not None and self._tickets is not None:
            self._tickets.revoke(ticket)
        if conn.fileno() >= 0 and self._loop is not None:
            self._loop.remove_reader(conn.fileno())
        conn.close()

    def _readable(self, conn: socket.socket, name: str, size: int, caller: Caller) -> None:
        """A batch read to answer; or the client closed the connection (or,
        against the protocol, sent something else): unmap."""
        try:
            data, _, flags, _ = conn.recvmsg(REQUEST_BYTES if self._reads is not None else 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, flags = b"", 0
        if data and self._reads is not None and self._spawn is not None and not flags & socket.MSG_TRUNC:
            assert self._loop is not None
            self._loop.remove_reader(conn.fileno())  # one request at a time
            self._spawn(self._answer(conn, name, size, data, caller), "segment-read")
            return
        if data:
            log.warning(
                "a client sent something else than a batch read on a segment's connection; unmapping it",
                extra={"fields": {"pid": _peer(conn)[0]}},
            )
        self.segments.drop(name)

    async def _answer(self, conn: socket.socket, name: str, size: int, request: bytes, caller: Caller) -> None:
        assert self._reads is not None and self._loop is not None
        try:
            reply = await self._reads.answer(name, size, request, caller)
        except ValueError as exc:
            log.warning(
                "a malformed batch read on a segment's connection; unmapping it",
                extra={"fields": {"pid": _peer(conn)[0], "error": str(exc)}},
            )
            self.segments.drop(name)
            return
        except BaseException:
            self.segments.drop(name)
            raise
        if conn.fileno() < 0:
            return  # unmapped meanwhile (the daemon closes)
        try:
            conn.send(reply)
        except OSError:
            self.segments.drop(name)
            return
        self._loop.add_reader(conn.fileno(), self._readable, conn, name, size, caller)

    def _release(self, conn: socket.socket) -> None:
        """Ends a segment's connection once the segment is unmapped."""
        if conn.fileno() >= 0 and self._loop is not None:
            self._loop.remove_reader(conn.fileno())
        conn.close()

    def _refuse(
        self,
        conn: socket.socket,
        who: tuple[int, int],
        why: str,
        busy: bool = False,
        what: str = "a shared memory segment",
    ) -> None:
        """Tells the client why it is refused ``what`` (if it still listens;
        ``busy``: it may try again), closes, and logs it now and then."""
        try:
            conn.send(reply_message(error=why, busy=busy))
        except OSError:
            pass
        conn.close()
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_SECONDS:
            self._logged_at = now
            log.warning(
                f"refused {what}",
                extra={"fields": {"pid": who[0], "uid": who[1], "reason": why, "refused_so_far": self.refused}},
            )


def _caller(conn: socket.socket) -> Caller:
    """The user at the other end of ``conn``; one the daemon trusts with nothing where the kernel does not say."""
    try:
        return peer_caller(conn)
    except OSError:
        return Caller(uid=-1)


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel saw it connect; (0, -1) if unknown."""
    try:
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return 0, -1
    return pid, uid
