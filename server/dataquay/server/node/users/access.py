"""What the calling user may do on a daemon that keeps its users apart (``--users apart``).

A daemon shared by the users of a node reads files as its own user, so left
alone it would read for anyone whatever it may read itself (a confused
deputy). With ``--users apart`` it acts for a user only where that user could
act itself:

- registration: the caller must be able to read the root itself, checked
  from the modes along its path as the kernel would check them (search on
  each directory above it, read and search on the root), and every name
  under it (read and search on a directory, read on a file); uid 0 passes,
  as it does in the kernel;
- reads (and the manifest, and caching behind): the same check on the
  dataset's root for the caller, remembered for :data:`CHECK_SECONDS` per
  (user, dataset), unless the operator shares the dataset with every user
  of the socket (``--shared-datasets``);
- prep groups: one namespace per user (:meth:`UserAccess.prep_owner`);
- payloads handed over for the cache: only from the daemon's own user or
  root, who could write the cache anyway.

Callers over TCP have no user the kernel names. Peer daemons (the node
token) read every dataset, as they read each other's caches; a caller with
the cluster token alone reads and stages only the shared datasets, and
registers or drops none. The daemon's own
user and root are one trust domain with the daemon and pass every check.
Without ``--users apart`` every caller is trusted, as in a daemon of one user.
POSIX ACLs are not consulted: a root open to a user only through an ACL is
refused (the mode's group bits, the ACL mask, decide).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from dataquay.client.wire.caller_ticket import METADATA_KEY
from dataquay.server.auth import OPEN_METHODS, supplied_credential
from dataquay.server.errors import UnknownCallerError, UserNotAllowedError
from dataquay.server.interceptors import Behavior, reshaped
from dataquay.server.node.users.callers import PEER_DAEMON, REMOTE, Caller, Tickets

if TYPE_CHECKING:
    from dataquay.server.node.datasets import Datasets

#: How long a user's right to read a dataset is remembered.
CHECK_SECONDS = 5.0
#: Longest a permission check may take (a PFS that does not answer a stat).
CHECK_TIMEOUT_SECONDS = 10.0
#: Remembered checks; all are forgotten when there are more.
MAX_REMEMBERED = 4096
_READ, _SEARCH = 4, 1


def readable_by(path: str, uid: int, gids: frozenset[int]) -> bool:
    """Whether user ``uid`` of groups ``gids`` could list or read ``path``
    itself, by the modes along its real path (see the module notes)."""
    if uid == 0:
        return True
    real = os.path.realpath(path)
    try:
        for directory in reversed(_parents(real)):
            if not _allows(os.stat(directory), uid, gids, _SEARCH):
                return False
        found = os.stat(real)
    except OSError:
        return False
    return _allows(found, uid, gids, _READ | _SEARCH if stat.S_ISDIR(found.st_mode) else _READ)


def unreadable_below(root: str, uid: int, gids: frozenset[int]) -> str | None:
    """The first name under directory ``root`` (relative to it) that user
    ``uid`` could not list (a directory) or read (a file, or a symlink's
    target); None when it could read them all. Hidden names are skipped, as
    the manifest build skips them."""
    if uid == 0:
        return None
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in [*dirs, *sorted(files)]:
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            try:
                found = os.stat(path)
            except OSError:
                continue  # a broken link: the build names it
            if not _allows(found, uid, gids, _READ | _SEARCH if stat.S_ISDIR(found.st_mode) else _READ):
                return os.path.relpath(path, root)
    return None


def _parents(path: str) -> list[str]:
    """``path``'s directories from its own parent up to ``/``."""
    out = []
    while (parent := os.path.dirname(path)) != path:
        out.append(parent)
        path = parent
    return out


def _allows(found: os.stat_result, uid: int, gids: frozenset[int], need: int) -> bool:
    """The kernel's rule: the owner's bits for the owner, else the group's for a member, else the others'."""
    mode = found.st_mode
    bits = mode >> 6 if found.st_uid == uid else mode >> 3 if found.st_gid in gids else mode
    return bits & need == need


class UserAccess:
    """The rules above for one daemon; ``apart`` False trusts every caller."""

    def __init__(
        self,
        apart: bool,
        datasets: Datasets,
        shared: tuple[str, ...] = (),
        count_refusal: Callable[[str], None] = lambda rule: None,
        node_token: str = "",
    ) -> None:
        self.apart = apart
        self._node_bearer = f"Bearer {node_token}".encode() if node_token else b""
        self.datasets = datasets
        self.shared = frozenset(shared)
        #: Counts a refusal by its rule: register, read, drop, segment, hand_over, no_ticket.
        self.count_refusal = count_refusal
        self.tickets = Tickets()
        self._daemon_uid = os.getuid()
        self._checked: dict[tuple[int, frozenset[int], str], tuple[bool, float]] = {}

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """Who makes this gRPC call: the user of its ticket on the unix socket;
        over TCP :data:`PEER_DAEMON` with the node token, else :data:`REMOTE`.

        Raises:
            UnknownCallerError: a call on the unix socket with no valid ticket while users are kept apart.
        """
        if not (context.peer() or "").startswith("unix:"):
            return PEER_DAEMON if self._holds_node_token(context) else REMOTE
        ticket = next((v for k, v in context.invocation_metadata() or () if k == METADATA_KEY), "")
        found = self.tickets.caller(ticket if isinstance(ticket, str) else "")
        if found is not None:
            return found
        if self.apart:
            self.count_refusal("no_ticket")
            raise UnknownCallerError(
                "this daemon keeps its users apart (--users apart): a call on its unix socket must carry a "
                "caller ticket from its fd socket; use a dataquay client of this version"
                + (" (the ticket given is not, or no longer, valid)" if ticket else "")
            )
        return Caller()

    def _holds_node_token(self, context: grpc.aio.ServicerContext) -> bool:
        if not self._node_bearer:
            return False
        return hmac.compare_digest(supplied_credential(context.invocation_metadata()), self._node_bearer)

    def trusted(self, caller: Caller) -> bool:
        """Whether ``caller`` is in the daemon's trust domain: every caller unless users are kept apart."""
        return not self.apart or caller.uid in (0, self._daemon_uid)

    async def check_root(self, caller: Caller, root: str) -> None:
        """Refuses to register ``root`` for a caller who could not read it itself.

        Raises:
            UserNotAllowedError: naming the rule.
        """
        if self.trusted(caller):
            return
        self._local_only(caller, "registered", "register")
        if not await self._readable(caller, root):
            self.count_refusal("register")
            raise UserNotAllowedError(
                f"uid {caller.uid} may register only a root it can read itself: read and search permission on "
                "the root and search permission on every directory above it"
            )
        uid = caller.uid
        assert uid is not None
        below = await asyncio.get_running_loop().run_in_executor(None, unreadable_below, root, uid, caller.gids)
        if below is not None:
            self.count_refusal("register")
            raise UserNotAllowedError(
                f"uid {caller.uid} may register only a root it can read itself, every file under it included; "
                f"it cannot read {below!r} there"
            )

    async def check_read(self, caller: Caller, dataset: str) -> None:
        """Refuses reads of ``dataset`` to a caller who could not read its root and with whom it is not shared.

        Raises:
            UserNotAllowedError: naming the rule.
            UnknownDatasetError: no such dataset.
        """
        if self.trusted(caller) or caller.node or dataset in self.shared:
            return
        if caller.remote:
            self.count_refusal("read")
            raise UserNotAllowedError(
                f"dataset {dataset!r} is not shared (--shared-datasets): over TCP, where no user is known, the "
                "cluster token reads only shared datasets; read it through your node's daemon socket"
            )
        entry = await self.datasets.entry(dataset)
        if not await self._readable(caller, entry.record.root):
            self.count_refusal("read")
            raise UserNotAllowedError(
                f"uid {caller.uid} may not read dataset {dataset!r}: a user reads only datasets whose root it "
                "can read itself, or those the operator shares (--shared-datasets)"
            )

    async def check_drop(self, caller: Caller, dataset: str) -> None:
        """Refuses to drop ``dataset`` for a caller who could not read its root;
        a shared dataset is the operator's to drop.

        Raises:
            UserNotAllowedError: naming the rule.
            UnknownDatasetError: no such dataset.
        """
        if self.trusted(caller):
            return
        self._local_only(caller, "dropped", "drop")
        if dataset in self.shared:
            self.count_refusal("drop")
            raise UserNotAllowedError(
                f"dataset {dataset!r} is shared with every user (--shared-datasets): only the daemon's own user "
                "or root drops it"
            )
        await self.check_read(caller, dataset)

    def check_segment(self, caller: Caller, owner: int | None) -> None:
        """Refuses to write a read's payloads into a segment of another user
        than the caller (``owner``, None for none the daemon knows).

        Raises:
            UserNotAllowedError: naming the rule.
        """
        if self.trusted(caller) or owner is None or owner == caller.uid:
            return
        self.count_refusal("segment")
        raise UserNotAllowedError(
            "the daemon writes a read's payloads only into a segment of the caller's own user (--users apart)"
        )

    def check_operator(self, caller: Caller, done: str) -> None:
        """Refuses what only the node's operator does (evict, pin) to every other user.

        Raises:
            UserNotAllowedError: naming the rule.
        """
        if self.trusted(caller):
            return
        self.count_refusal("operator")
        raise UserNotAllowedError(
            f"uid {caller.uid} may not {done}: only the daemon's own user or root manages the cache of a daemon "
            "that keeps its users apart"
        )

    def may_hand_over(self, caller: Caller) -> bool:
        """Whether payloads ``caller`` hands over may go into the cache: the daemon's own user's or root's only."""
        if self.trusted(caller):
            return True
        self.count_refusal("hand_over")
        return False

    def prep_owner(self, caller: Caller) -> int | None:
        """Whose namespace of prep groups ``caller`` uses: its uid; None (one for all) unless users are apart."""
        return caller.uid if self.apart else None

    def _local_only(self, caller: Caller, done: str, rule: str) -> None:
        """Refuses over TCP what users do only where the kernel names them."""
        if caller.remote:
            self.count_refusal(rule)
            raise UserNotAllowedError(
                f"this daemon keeps its users apart (--users apart): datasets are {done} through its unix socket, "
                "where the kernel names the caller, not over TCP"
            )

    async def _readable(self, caller: Caller, path: str) -> bool:
        assert caller.uid is not None
        key = (caller.uid, caller.gids, path)
        now = time.monotonic()
        remembered = self._checked.get(key)
        if remembered is not None and now - remembered[1] < CHECK_SECONDS:
            return remembered[0]
        check = asyncio.get_running_loop().run_in_executor(None, readable_by, path, caller.uid, caller.gids)
        try:
            allowed = await asyncio.wait_for(check, CHECK_TIMEOUT_SECONDS)
        except TimeoutError:
            raise UserNotAllowedError(
                f"cannot check within {CHECK_TIMEOUT_SECONDS:.0f} s whether uid {caller.uid} may read the root "
                "(its file system does not answer)"
            ) from None
        if len(self._checked) >= MAX_REMEMBERED:
            self._checked.clear()
        self._checked[key] = (allowed, now)
        return allowed


class CallerCheck(grpc.aio.ServerInterceptor):
    """Ends every call on the unix socket that carries no valid caller ticket
    with UNAUTHENTICATED, before the method runs: installed while users are
    kept apart, so that no method answers a caller the daemon cannot name."""

    def __init__(self, access: UserAccess) -> None:
        self._access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        access = self._access

        def unary(behavior: Behavior) -> Behavior:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await _known(access, context)
                return await behavior(request, context)

            return call

        def streaming(behavior: Behavior) -> Behavior:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await _known(access, context)
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:
                    await result

            return call

        return reshaped(handler, unary, streaming)


async def _known(access: UserAccess, context: grpc.aio.ServicerContext) -> None:
    try:
        access.caller(context)
    except UnknownCallerError as exc:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
