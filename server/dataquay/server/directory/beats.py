"""Lease renewals as UDP datagrams, on the directory's gRPC port number.

A heartbeat carries a few dozen bytes and needs no ordering or retry (the
lease spans several beats), yet through gRPC it costs the directory about
0.8 ms of CPU: at 1,000 nodes beating every 2 s, 40% of a core. As one
datagram (a serialized HeartbeatRequest in, a HeartbeatReply back) it costs a
tenth of that. Daemons fall back to the Heartbeat RPC when datagrams go
unanswered (a firewall that drops UDP), so nothing depends on them arriving.

A datagram is a header (format version, sequence, send time in Unix
nanoseconds; :data:`HEADER`) followed by the HeartbeatRequest. With a node
token, the whole is followed by its HMAC under the token
(:func:`dataquay.server.auth.sign`); the directory ignores beats without a
valid one, so a stranger, or a trainer holding the cluster token, cannot
keep a dead node listed as up. Nor can one
who captured a signed beat: the directory refuses a sequence not above the
highest it accepted from the node since it registered, and a send time
further than ``max_age_seconds`` from its own clock, which covers captures
from before a directory restart. Each sender's sequence starts from its
clock in nanoseconds, so a restarted daemon's beats are above its previous
ones. A beat names the session its node's registration was handed, so that
only the daemon holding the name renews its lease (see
:meth:`~.state.DirectoryState.heartbeat`). Every refused datagram goes
unanswered, so a daemon whose beats are refused (a clock far off, a format
this directory does not read) renews its lease by RPC.

The version byte is not a valid start of a protobuf message, so a bare
HeartbeatRequest is refused as of an unknown format, never misread.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable
from typing import cast

from google.protobuf.message import DecodeError

from dataquay.protos import directory_pb2 as dpb
from dataquay.server.auth import sign, verified

log = logging.getLogger("dataquay.directory")

#: Format version, sequence, send time (Unix ns), before the HeartbeatRequest.
HEADER = struct.Struct(">BQQ")
#: The header's version byte; as a protobuf tag it names field 0, which no message has.
FORMAT = 1
#: Why a datagram was refused: the labels of the directory's refusal counter.
REFUSALS = ("signature", "format", "malformed", "stale", "replayed", "holder")

_REFUSAL_LOGS = {
    "signature": "ignoring heartbeats without a valid node token signature",
    "format": "ignoring heartbeats of an unknown format (a daemon of another version?)",
    "malformed": "ignoring a datagram that is not a heartbeat",
    "stale": "ignoring heartbeats sent too long ago or in the future (replayed, or a clock far off)",
    "replayed": "ignoring a heartbeat whose sequence the node already used (replayed)",
    "holder": "ignoring heartbeats for a node name from other than its registered holder",
}

#: Answers a beat given its sequence, or says why it is refused (a key of :data:`REFUSALS`).
Answer = Callable[[dpb.HeartbeatRequest, int], dpb.HeartbeatReply | str]


def count_refusal(refused: Counter[str], reason: str, source: str) -> None:
    """Counts a refused beat, and logs the first of each reason (a sender
    refused once is refused at every beat: one line says it all)."""
    refused[reason] += 1
    if refused[reason] == 1:
        log.warning(_REFUSAL_LOGS[reason], extra={"fields": {"from": source}})


def beat_datagram(token: str, request: dpb.HeartbeatRequest, sequence: int, sent_unix_ns: int) -> bytes:
    """The datagram of one beat, signed under ``token`` (see the module docstring)."""
    return sign(token, HEADER.pack(FORMAT, sequence, sent_unix_ns) + request.SerializeToString())


class HeartbeatEndpoint(asyncio.DatagramProtocol):
    """Answers each valid heartbeat datagram with the reply ``answer`` gives.

    Args:
        answer: the directory's handler; a string refuses the beat for that reason.
        token: the node token beats are signed with ("" for none).
        max_age_seconds: how far a beat's send time may be from now.
        refused: counts refused datagrams by reason (:data:`REFUSALS`).
    """

    def __init__(self, answer: Answer, token: str, max_age_seconds: float, refused: Counter[str]) -> None:
        self._answer = answer
        self._token = token
        self._max_age_ns = int(max_age_seconds * 1e9)
        self._transport: asyncio.DatagramTransport | None = None
        self.refused = refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDP transport has DatagramTransport's methods, not its class.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        reply = self._reply(data)
        if isinstance(reply, str):
            count_refusal(self.refused, reply, str(addr))
        elif self._transport is not None:
            self._transport.sendto(reply.SerializeToString(), addr)

    def _reply(self, data: bytes) -> dpb.HeartbeatReply | str:
        """The answer to ``data``, or the reason it is refused."""
        payload = verified(self._token, data)
        if payload is None:
            return "signature"
        if len(payload) < HEADER.size or payload[0] != FORMAT:
            return "format"
        _version, sequence, sent_unix_ns = HEADER.unpack_from(payload)
        try:
            request = dpb.HeartbeatRequest.FromString(payload[HEADER.size :])
        except DecodeError:
            return "malformed"
        if abs(time.time_ns() - sent_unix_ns) > self._max_age_ns:
            return "stale"
        return self._answer(request, sequence)


async def open_heartbeats(
    address: str, answer: Answer, token: str, max_age_seconds: float, refused: Counter[str]
) -> asyncio.DatagramTransport:
    """Listens for heartbeat datagrams on ``address`` (HOST:PORT, the gRPC listener's)."""
    host, _, port = address.rpartition(":")
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: HeartbeatEndpoint(answer, token, max_age_seconds, refused),
        local_addr=(host.strip("[]") or "0.0.0.0", int(port)),
    )
    return transport


class HeartbeatSender(asyncio.DatagramProtocol):
    """A daemon's side: sends a beat and waits briefly for the answer."""

    def __init__(self, token: str = "") -> None:
        self._token = token
        self._sequence = 0
        self._transport: asyncio.DatagramTransport | None = None
        self._replies: asyncio.Queue[dpb.HeartbeatReply] = asyncio.Queue(maxsize=4)

    @classmethod
    async def connect(cls, address: str, token: str = "") -> HeartbeatSender:
        host, _, port = address.rpartition(":")
        sender = cls(token)
        # The transport as returned: uvloop calls connection_made later.
        sender._transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: sender, remote_addr=(host.strip("[]"), int(port))
        )
        return sender

    def datagram(self, request: dpb.HeartbeatRequest) -> bytes:
        """The next beat's datagram. Its sequence is above this sender's last
        one and at least the clock in nanoseconds, so it also exceeds those of
        an earlier sender of this node (a daemon before its restart)."""
        now = time.time_ns()
        self._sequence = max(self._sequence + 1, now)
        return beat_datagram(self._token, request, self._sequence, now)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        try:
            self._replies.put_nowait(dpb.HeartbeatReply.FromString(data))
        except (DecodeError, asyncio.QueueFull):
            pass

    def error_received(self, exc: Exception) -> None:
        """ICMP port unreachable and the like: the beat simply goes unanswered."""

    async def beat(self, request: dpb.HeartbeatRequest, timeout: float) -> dpb.HeartbeatReply | None:
        """Sends one beat; the answer, or None when none came within ``timeout``."""
        while not self._replies.empty():
            self._replies.get_nowait()  # answers to earlier beats that came late
        assert self._transport is not None
        self._transport.sendto(self.datagram(request))
        try:
            return await asyncio.wait_for(self._replies.get(), timeout)
        except TimeoutError:
            return None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
