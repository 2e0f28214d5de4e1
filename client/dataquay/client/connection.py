"""A trainer process's channel to its node's daemon, and the calls through it.

Trainers are synchronous, so this is the synchronous gRPC API. gRPC channels
must not cross a fork: each process creates its own channel on first use,
from a subchannel pool of its own so that a forked child can never pick up a
connection its parent opened. gRPC's C core also breaks a child forked while
another thread is inside a call, so a fork waits for this process's calls in
flight (at most :data:`FORK_WAIT_SECONDS`) and holds new ones back until it
is done. gRPC's own fork support (GRPC_ENABLE_FORK_SUPPORT) is not needed
and is best left off: with it, children forked while a call is in flight
hang, or (with the wait above) the fork stalls for the whole wait.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

import grpc
import grpc.experimental

from dataquay.client.errors import DaemonUnavailableError, DataquayError
from dataquay.client.wire.caller_ticket import CallerTicket, ticket_for
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.security import Credentials, with_metadata
from dataquay.client.wire.status_codes import UNREACHABLE, error_from_rpc
from dataquay.protos import cache_pb2_grpc

log = logging.getLogger("dataquay.client")

#: How long a fork waits for this process's calls in flight.
FORK_WAIT_SECONDS = 10.0

_T = TypeVar("_T")

# Channels a forked child inherited: never used or closed there (closing could
# shut down a connection its parent still uses), kept so nothing finalises them.
_inherited: list[object] = []


class _CallGate:
    """Counts this process's calls in flight, so that a fork can wait for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls = 0
        self._forking = False

    def __enter__(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._calls += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._calls -= 1
            if not self._calls:
                self._cond.notify_all()

    def hold(self) -> None:
        with self._cond:
            self._forking = True
            if not self._cond.wait_for(lambda: not self._calls, FORK_WAIT_SECONDS):
                log.warning("forking while %d dataquay calls are in flight", self._calls)

    def release(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()


class DaemonConnection:
    """The channel to the daemon at ``address`` in this process, usable from any thread.

    The fork hooks are the owner's to call (the client's, registered once
    for all clients), so that they run in the order the client sets.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._closed = False
        self.credentials = Credentials.from_env()
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self._pid: int | None = None
        self._channel: grpc.Channel | None = None
        self._ticket: CallerTicket | None = None
        self._stub: cache_pb2_grpc.CacheStub | None = None
        self._lock = threading.Lock()
        self._gate = _CallGate()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called; no call goes out after."""
        return self._closed

    @property
    def open_here(self) -> bool:
        """Whether this process has an open channel of its own (an inherited one does not count)."""
        return not self._closed and self._channel is not None and self._pid == os.getpid()

    def call(
        self,
        what: str,
        call: Callable[[cache_pb2_grpc.CacheStub], _T],
        errors: Mapping[grpc.StatusCode, type[DataquayError]] | None = None,
    ) -> _T:
        """Runs one RPC (a stream consumed whole) and maps its status to our errors.

        ``errors`` maps the codes whose meaning depends on the call (NOT_FOUND
        of a job or of a dataset) to the error to raise.
        """
        stub = self._channel_stub()
        try:
            with self._gate:
                return call(stub)
        except grpc.RpcError as exc:
            raise self._error(what, exc, errors or {}) from None

    def close(self) -> None:
        """Closes this process's channel; every later call fails."""
        with self._lock:
            self._closed = True
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            if self._ticket is not None:
                self._ticket.close()  # a child's copy of its parent's connection: the parent's stays open
            self._channel = self._stub = self._ticket = None

    def _channel_stub(self) -> cache_pb2_grpc.CacheStub:
        pid = os.getpid()
        with self._lock:
            if self._closed:
                raise DataquayError(f"client of {self.address} is closed")
            if self._pid != pid:
                if self._channel is not None:
                    _inherited.append(self._channel)
                options = [
                    *channel_options(),
                    # Connections of this channel only: a forked child must
                    # never share a connection with its parent.
                    ("grpc.use_local_subchannel_pool", 1),
                    # A streamed Read is taken in the calling thread, not
                    # through a thread that gRPC starts for each call while
                    # none is in flight: a quarter of the client's CPU in a
                    # peer hit of 110 KiB samples (bench/experiments/wire.py).
                    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
                ]
                if self._ticket is not None:
                    self._ticket.close()  # the parent's, inherited: the child asks for its own
                self._ticket = ticket_for(self.address, self.credentials.token)
                channel = self.credentials.channel(self.address, options)
                self._channel = with_metadata(channel, self._ticket.metadata if self._ticket else ())
                self._stub = cache_pb2_grpc.CacheStub(self._channel)
                self._pid = pid
            assert self._stub is not None
            return self._stub

    def _error(
        self, what: str, exc: grpc.RpcError, errors: Mapping[grpc.StatusCode, type[DataquayError]]
    ) -> DataquayError:
        code, details = exc.code(), exc.details()
        if code in UNREACHABLE:
            return DaemonUnavailableError(
                f"dataquay daemon at {self.address} is unreachable ({code.name}: {details}); "
                "is `dataquay serve` running there, and does DATAQUAY_ADDR name its socket?"
            )
        return error_from_rpc(exc, errors) or DataquayError(f"{what} failed: {code.name}: {details}")

    # --------------------------------------------------------------- fork

    def before_fork(self) -> None:
        """Waits for this process's calls in flight and holds new ones back."""
        self._gate.hold()

    def after_fork_in_parent(self) -> None:
        """Lets the calls held back by :meth:`before_fork` go."""
        self._gate.release()

    def after_fork_in_child(self) -> None:
        """Starts the child without its parent's locks and call count.

        Single-threaded here; locks may have been held by threads that do
        not exist in this process. The inherited channel is set aside on
        first use (pid check), which also covers forks that ran no hooks.
        """
        channel, pid, ticket = self._channel, self._pid, self._ticket
        self._reset_process_state()
        self._channel, self._pid, self._ticket = channel, pid, ticket
