"""What every command module shares: the error that ends a command, stubs for
the daemon and the directory, and plain tables."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc

from dataquay.client.wire.caller_ticket import ticket_for
from dataquay.client.wire.channels import channel_options, daemon_address
from dataquay.client.wire.security import Credentials, CredentialsError, with_metadata
from dataquay.client.wire.status_codes import error_from_rpc
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc

DIRECTORY_ENV = "DATAQUAY_DIRECTORY"


class CliError(Exception):
    """Ends the command with exit code 1 and this one-line message."""


@contextmanager
def rpc_errors(what: str, address: str, hint: str) -> Iterator[None]:
    """Turns a gRPC error into the domain error the server raised, else a one-line :class:`CliError`."""
    try:
        yield
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise CliError(f"no {what} answers at {address} ({hint})") from None
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise CliError(
                f"the {what} at {address} refused the call: {exc.details()} (set DATAQUAY_TOKEN_FILE)"
            ) from None
        raise error_from_rpc(exc) or CliError(exc.details() or exc.code().name) from None


def open_channel(address: str) -> grpc.Channel:
    """A channel to a daemon or the directory with the credentials the
    environment names (DATAQUAY_TOKEN_FILE, DATAQUAY_TLS_*)."""
    try:
        credentials = Credentials.from_env()
    except CredentialsError as exc:
        raise CliError(str(exc)) from None
    return credentials.channel(address, channel_options())


@contextmanager
def _channel(address: str) -> Iterator[grpc.Channel]:
    """An :func:`open_channel` that also carries, on a daemon's unix socket,
    the caller ticket that names this user to a daemon that keeps its users
    apart (:mod:`dataquay.client.wire.caller_ticket`); both closed after."""
    channel = open_channel(address)
    ticket = ticket_for(address, Credentials.from_env().token)
    try:
        yield with_metadata(channel, ticket.metadata) if ticket is not None else channel
    finally:
        channel.close()
        if ticket is not None:
            ticket.close()


@contextmanager
def daemon_stub(args: argparse.Namespace) -> Iterator[cache_pb2_grpc.CacheStub]:
    """A stub for the daemon at --addr; RPC errors become one-line messages."""
    address = args.addr or daemon_address()
    with _channel(address) as channel, rpc_errors("daemon", address, "is `dataquay serve` running? set DATAQUAY_ADDR"):
        yield cache_pb2_grpc.CacheStub(channel)


@contextmanager
def node_stub(address: str) -> Iterator[cache_pb2_grpc.CacheStub]:
    """A stub for the daemon at ``address``; its RPC errors pass through, for
    commands that word each node's failure themselves."""
    with _channel(address) as channel:
        yield cache_pb2_grpc.CacheStub(channel)


def directory_address(args: argparse.Namespace) -> str | None:
    """--directory, else DATAQUAY_DIRECTORY, else None (no cluster)."""
    return getattr(args, "directory", None) or os.environ.get(DIRECTORY_ENV) or None


@contextmanager
def directory_stub(args: argparse.Namespace) -> Iterator[directory_pb2_grpc.DirectoryStub]:
    """A stub for the directory at --directory; RPC errors become one-line messages.
    Of several replicas (``a:7070,b:7070``), the first that accepts a connection."""
    address = directory_address(args)
    if address is None:
        raise CliError(f"no directory given: pass --directory HOST:PORT or set {DIRECTORY_ENV}")
    address = _first_reachable(address)
    with _channel(address) as channel, rpc_errors("directory", address, "is `dataquay directory` running there?"):
        yield directory_pb2_grpc.DirectoryStub(channel)


#: How long the CLI waits for one directory replica's connection before trying the next.
REPLICA_CONNECT_SECONDS = 1.0


def _first_reachable(addresses: str) -> str:
    """The first of the comma-separated replicas that accepts a connection; the
    last one when none does (its call then fails with the usual message)."""
    replicas = [a.strip() for a in addresses.split(",") if a.strip()]
    for replica in replicas[:-1]:
        channel = open_channel(replica)
        try:
            grpc.channel_ready_future(channel).result(timeout=REPLICA_CONNECT_SECONDS)
            return replica
        except grpc.FutureTimeoutError:
            continue
        finally:
            channel.close()
    return replicas[-1] if replicas else addresses


def add_addr(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", help="daemon address: socket path or HOST:PORT [env DATAQUAY_ADDR]")


def add_directory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--directory", help=f"directory HOST:PORT, or replicas' HOST:PORT,HOST:PORT [env {DIRECTORY_ENV}]"
    )


def add_q(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--q`` and ``--q-leaving``, the two readings of ``partial``'s exchanged fraction."""
    q = parser.add_mutually_exclusive_group()
    q.add_argument(
        "--q",
        type=float,
        help="partial mode: fraction of its samples a node draws into each epoch's pool (0 < q <= 1); "
        "1/M of the draws come back, so q(1 - 1/M) leave it",
    )
    q.add_argument(
        "--q-leaving",
        type=float,
        help="partial mode: fraction of its samples that leaves a node each epoch (Nguyen et al.'s Q, "
        "0 < Q <= 1 - 1/M); sets --q to Q / (1 - 1/M)",
    )


def print_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> None:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
