"""Whether a trainer's daemon is taken to be up, and when it is tried again.

A training loop never fails because its daemon died: once a read or a
notice finds the daemon unreachable (or hung past a read's deadline), its
reader reads from the PFS and asks :class:`DaemonHealth` before each batch
whether the daemon may be tried again, which a quick Info call decides once
:data:`RETRY_DAEMON_SECONDS` have passed. Which tier serves a miss is
:class:`dataquay.client.remote.RemoteReader`'s; how a batch travels is
:mod:`dataquay.client.daemon_transports`'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dataquay.client.connection import DaemonConnection
from dataquay.client.errors import DaemonUnavailableError, DataquayError
from dataquay.client.wire.notices import first_to_tell, no_longer
from dataquay.protos import cache_pb2 as pb

log = logging.getLogger("dataquay.client")

#: While the daemon is unreachable, it is tried again this often, with a call
#: that must answer within PROBE_SECONDS: a daemon that hangs costs its
#: trainers that much per retry, not a read's whole deadline.
RETRY_DAEMON_SECONDS = 2.0
PROBE_SECONDS = 0.5


class DaemonHealth:
    """The daemon's reachability as this process saw it last.

    Args:
        connection: the channel to the daemon, probed with Info.
        on_back: called once the daemon answers again, with its Info answer
            where the probe got one (None where a read's answer said so).
    """

    def __init__(self, connection: DaemonConnection, on_back: Callable[[pb.InfoReply | None], None]) -> None:
        self._connection = connection
        self._on_back = on_back
        self._down_until = 0.0
        self._down_reason: str | None = None

    @property
    def _topic(self) -> str:
        return f"daemon down: {self._connection.address}"

    @property
    def down(self) -> bool:
        """Whether the daemon was found unreachable and its retry time has not come."""
        return time.monotonic() < self._down_until

    def mark_down(self, exc: DaemonUnavailableError) -> None:
        """Reads go to the PFS until the daemon answers a probe; ``exc`` says why."""
        if self._down_reason is None:
            # Once for a trainer and its DataLoader workers, not once each.
            told = first_to_tell(self._topic)
            log.log(
                logging.WARNING if told else logging.DEBUG,
                "%s; reading misses from the PFS and trying the daemon again every %.0f s",
                exc,
                RETRY_DAEMON_SECONDS,
            )
        self._down_reason = str(exc)
        self._down_until = time.monotonic() + RETRY_DAEMON_SECONDS

    def usable(self) -> bool:
        """Whether reads may go to the daemon: it was not found unreachable,
        or it answers a quick call once its retry time has come."""
        if self._down_reason is None:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            info = self._connection.call("Info", lambda stub: stub.Info(pb.InfoRequest(), timeout=PROBE_SECONDS))
        except DataquayError:
            self._down_until = time.monotonic() + RETRY_DAEMON_SECONDS
            return False
        self.answered(info)
        return True

    def answered(self, info: pb.InfoReply | None = None) -> None:
        """Marks the daemon reachable again; ``info`` is its answer to Info, if just asked."""
        if self._down_reason is not None:
            self._down_reason = None
            no_longer(self._topic)
            log.info("dataquay daemon at %s answers again; misses go through it", self._connection.address)
            self._on_back(info)
