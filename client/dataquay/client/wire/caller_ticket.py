"""The caller ticket: how a client's gRPC calls on the unix socket say which user makes them.

gRPC does not tell a server who is at the other end of a unix socket; the
kernel does, on a raw one (SO_PEERCRED). So a client asks its daemon's fd
socket (:mod:`.memfd`, ``<socket>.fds``) for a ticket: one SOCK_SEQPACKET
message with the cluster token and no descriptor. The daemon reads the
connecting process's uid and groups from the kernel, binds a fresh random
ticket to them and answers with it. The client keeps that connection open
(the ticket dies with it) and sends the ticket as :data:`METADATA_KEY` on its
gRPC calls over the unix socket; the daemon looks the caller up by it.

A ticket is a secret as the token is: whoever holds it speaks as its user.
It never leaves the process that asked for it (a forked child asks for its
own) and is sent only over the unix socket, which only the node's own
processes reach. A daemon without an fd socket, or one that answers no
ticket (an older one), gets calls without one.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import time

from dataquay.client.wire.memfd import daemon_socket_of, fd_socket_path

log = logging.getLogger("dataquay.client")

#: The gRPC metadata key that carries the ticket.
METADATA_KEY = "dataquay-caller"
#: Longest message either side sends for a ticket.
MESSAGE_BYTES = 1024
#: How long a client waits for the daemon's answer.
TICKET_SECONDS = 5.0
#: Tries at a ticket while the daemon is busy with other handshakes (about 1.5 s in all).
TICKET_TRIES = 5


def request_message(token: str) -> bytes:
    return json.dumps({"ticket": True, "token": token}).encode()


def is_request(data: bytes) -> bool:
    """Whether ``data`` asks for a ticket (rather than handing over a segment)."""
    try:
        fields = json.loads(data)
    except ValueError:
        return False
    return isinstance(fields, dict) and fields.get("ticket") is True


def parse_token(data: bytes) -> str:
    """The cluster token a ticket request (:func:`is_request`) carries; "" for none."""
    token = json.loads(data).get("token", "")
    return token if isinstance(token, str) else ""


def reply_message(ticket: str) -> bytes:
    """The daemon's answer with a ticket; a refusal is the fd socket's own
    (``{"error": ..., "busy": ...}``, :func:`dataquay.client.wire.memfd.reply_message`)."""
    return json.dumps({"ticket": ticket}).encode()


def parse_reply(data: bytes) -> str | None:
    """The ticket in the daemon's answer; None where it gave none (it refused).

    Raises:
        BlockingIOError: the daemon is busy with other clients' handshakes; worth another try.
    """
    try:
        fields = json.loads(data) if data else {}
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    if fields.get("busy") is True:
        raise BlockingIOError(errno.EAGAIN, str(fields.get("error", "the daemon is busy")))
    ticket = fields.get("ticket")
    return ticket if isinstance(ticket, str) and ticket else None


class CallerTicket:
    """A ticket from the daemon at ``fd_socket`` and the connection that keeps it valid.

    Raises:
        OSError: the fd socket is not there or does not answer in time.
    """

    def __init__(self, fd_socket: str, token: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.settimeout(TICKET_SECONDS)
            self._sock.connect(fd_socket)
            self._sock.send(request_message(token))
            self.ticket = parse_reply(self._sock.recv(MESSAGE_BYTES))
        except BaseException:
            self._sock.close()
            raise

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What the calls carry: the ticket, or nothing where the daemon gave none."""
        return ((METADATA_KEY, self.ticket),) if self.ticket else ()

    def close(self) -> None:
        """Ends the ticket (the daemon forgets it as the connection ends)."""
        self._sock.close()


def ticket_for(address: str, token: str) -> CallerTicket | None:
    """A ticket for calls to the daemon at ``address``; None over TCP, where
    the daemon has no fd socket or gives no ticket."""
    daemon_socket = daemon_socket_of(address)
    if daemon_socket is None:
        return None
    for attempt in range(TICKET_TRIES):
        try:
            return CallerTicket(fd_socket_path(daemon_socket), token)
        except BlockingIOError:  # many clients starting at once
            time.sleep(0.05 * 2**attempt)
        except OSError as exc:
            log.debug("no caller ticket from the daemon", extra={"fields": {"error": str(exc)}})
            return None
    log.warning("no caller ticket: the daemon stayed busy with other clients' handshakes")
    return None
