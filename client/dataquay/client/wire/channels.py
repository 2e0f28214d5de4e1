"""Every gRPC channel and server option dataquay sets, in one place.

Defaults are gRPC's unless a comment says why not.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

MiB = 1 << 20

#: Largest message either side accepts. Reads and exchanges send about
#: READ_CHUNK_BYTES of payload per message, and a larger payload in pieces
#: of that size (dataquay.client.wire.pieces), so a message holds at most two
#: chunks' worth; the rest is room for requests of many ids.
MAX_MESSAGE_BYTES = 64 * MiB

#: Target payload per streamed read message: big enough that the 50-100 us cost
#: of a message is small, small enough that the first samples arrive early.
READ_CHUNK_BYTES = 4 * MiB

#: The slowest rate a healthy daemon is allowed to stream a batch at, to a
#: trainer or to a peer daemon.
SLOWEST_READ_BYTES_PER_SECOND = 100e6


def batch_deadline(floor: float, nbytes: int) -> float:
    """Deadline of a streamed Read of ``nbytes``: ``floor`` plus the bytes at
    :data:`SLOWEST_READ_BYTES_PER_SECOND`.

    A fixed deadline either cuts off large batches or lets a hung daemon
    (stopped, swapping) hold its caller for minutes; one that grows with the
    batch finds a hung daemon out within seconds and never a slow-but-alive one.
    """
    return floor + nbytes / SLOWEST_READ_BYTES_PER_SECOND


def channel_options() -> list[tuple[str, int | str]]:
    """Options for every channel a client or a peer daemon opens."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Detect a dead peer within seconds even when no call is in flight.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Fail fast and let the caller fall back to another tier instead of
        # queueing behind a reconnect back-off of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.enable_retries", 0),
    ]


def closed_under_the_call() -> bool:
    """Whether the ``asyncio.CancelledError`` being handled says the call's
    channel was closed, not that the task making the call was cancelled.

    Closing a grpc.aio channel ends every call still on it with
    ``CancelledError``, as if its task had been cancelled. A client that moves
    to another replica or endpoint and closes the old channel would otherwise
    end, silently and for good, every background loop whose call was in
    flight there: such a call is made again on the new channel instead.
    """
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def server_options() -> list[tuple[str, int | str]]:
    """Options for the daemon's and the directory's servers."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Clients ping every 10 s (above); allow that without a GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        # Two processes must never share a port by accident.
        ("grpc.so_reuseport", 0),
    ]


def default_socket_path() -> Path:
    """The daemon's unix socket when neither flag nor env names one."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "dataquay" / "dataquay.sock"
    return Path(f"/tmp/dataquay-{os.getuid()}") / "dataquay.sock"


def grpc_target(address: str) -> str:
    """A gRPC target for ``address``: a socket path, ``unix:PATH`` or ``HOST:PORT``."""
    if address.startswith("unix:"):
        return address
    if address.startswith("/") or address.startswith("."):
        return "unix:" + str(Path(address).absolute())
    return address


def daemon_address() -> str:
    """The local daemon's address: DATAQUAY_ADDR, else the default socket."""
    return os.environ.get("DATAQUAY_ADDR") or str(default_socket_path())


def directory_address() -> str | None:
    """The directory's HOST:PORT from DATAQUAY_DIRECTORY (replicas' separated by commas), or None when unset."""
    return os.environ.get("DATAQUAY_DIRECTORY", "").strip() or None
