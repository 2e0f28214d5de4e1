"""Cache quotas per user and per project (a Unix group), in bytes: parsed from
the operator's config, checked against what each holding is charged to.

A holding (one dataset version's cache) is charged to the user who staged it
first, and counts against that user's quota and the quota of every group the
user was in then: the kernel names both on the daemon's unix socket, so no
caller can charge another. Pure, but for the look-up of names in the user and
group databases when the config is read.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataquay.server.sizes import parse_size

KINDS = ("user", "group")


@dataclass(frozen=True)
class Quota:
    """At most ``limit`` bytes of cache charged to one user or one group.

    Attributes:
        kind: "user" or "group".
        ident: its uid or gid.
        limit: bytes.
        text: as the operator wrote it, for messages that name it.
    """

    kind: str
    ident: int
    limit: int
    text: str


def parse_quotas(text: str) -> tuple[Quota, ...]:
    """Quotas from ``KIND:NAME=SIZE`` items separated by ',' (a name or a numeric id).

    Raises:
        ValueError: naming the item that is not one.
    """
    quotas = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        who, _, size = item.partition("=")
        kind, _, name = who.partition(":")
        if kind not in KINDS or not name or not size:
            raise ValueError(f"{item!r} is not KIND:NAME=SIZE with KIND user or group, like user:alice=200G")
        quotas.append(Quota(kind, _ident(kind, name), parse_size(size), item))
    return tuple(quotas)


def checked_quotas(text: str) -> str:
    """``text`` once :func:`parse_quotas` takes it: the config keeps the operator's words."""
    parse_quotas(text)
    return text


def _ident(kind: str, name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid if kind == "user" else grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"no {kind} named {name!r} on this node") from None


def charged_to(quota: Quota, owner_uid: np.ndarray, owner_gids: Sequence[frozenset[int]]) -> np.ndarray:
    """Which holdings count against ``quota``."""
    if quota.kind == "user":
        return np.asarray(owner_uid, dtype=np.int64) == quota.ident
    return np.fromiter((quota.ident in gids for gids in owner_gids), dtype=bool, count=len(owner_gids))


def exceeded(
    quotas: Sequence[Quota],
    uid: int,
    gids: frozenset[int],
    need: int,
    owner_uid: np.ndarray,
    owner_gids: Sequence[frozenset[int]],
    nbytes: np.ndarray,
) -> tuple[Quota, int] | None:
    """The first quota of the caller's that ``need`` more bytes would pass,
    with the bytes already charged to it; None when every one has room."""
    for quota in quotas:
        if (quota.kind == "user" and quota.ident != uid) or (quota.kind == "group" and quota.ident not in gids):
            continue
        used = int(np.asarray(nbytes, dtype=np.int64)[charged_to(quota, owner_uid, owner_gids)].sum())
        if used + need > quota.limit:
            return quota, used
    return None
