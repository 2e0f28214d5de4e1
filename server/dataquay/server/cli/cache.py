"""``dataquay cache ls|evict|pin|unpin``: the operator's view of a node's cache
and its hands on it (see node/cache/manager.py)."""

from __future__ import annotations

import argparse
import time

from dataquay.protos import cache_pb2 as pb
from dataquay.server.cli.common import add_addr, daemon_stub, print_table
from dataquay.server.sizes import format_bytes, format_duration


def holding_rows(holdings: list[pb.CacheHolding], now: float) -> list[tuple[object, ...]]:
    """One row per cached dataset version: what `cache ls` and `status` print."""
    return [
        (
            ",".join(h.datasets) or "(replaced)",
            h.cache_db,
            h.samples,
            format_bytes(h.bytes),
            format_duration(now - h.last_use_unix) + " ago" if h.last_use_unix else "never",
            h.uid if h.uid >= 0 else "-",
            ",".join(h.pinned_by) or "-",
        )
        for h in sorted(holdings, key=lambda h: h.last_use_unix)
    ]


HOLDING_HEADER = ("DATASET", "CACHE_DB", "SAMPLES", "BYTES", "LAST_USE", "UID", "PINNED_BY")


def charge_rows(charges: list[pb.CacheCharge]) -> list[tuple[object, ...]]:
    return [
        (c.kind, c.id, format_bytes(c.bytes), f"{format_bytes(c.quota_bytes)} ({c.quota})" if c.quota_bytes else "-")
        for c in charges
    ]


CHARGE_HEADER = ("KIND", "ID", "BYTES", "QUOTA")


def eviction_lines(evictions: list[pb.CacheEviction], dry_run: bool) -> list[str]:
    verb = "would evict" if dry_run else "evicted"
    return [
        f"{verb} {','.join(e.datasets) or e.cache_db}: {format_bytes(e.bytes)}" + ("" if e.whole else " (part)")
        for e in evictions
    ]


def cmd_cache(args: argparse.Namespace) -> None:
    request = pb.ManageCacheRequest(
        action=args.cache_action,
        name=getattr(args, "name", "") or "",
        dry_run=getattr(args, "dry_run", False),
        force=getattr(args, "force", False),
    )
    with daemon_stub(args) as stub:
        reply = stub.ManageCache(request)
    if args.cache_action == "evict":
        for line in eviction_lines(list(reply.evictions), request.dry_run) or ["nothing to evict"]:
            print(line)
        return
    if args.cache_action in ("pin", "unpin"):
        print(f"{args.cache_action}ned {args.name!r}")
        return
    print(
        f"cache {format_bytes(reply.used_bytes)} of {format_bytes(reply.capacity_bytes)}; datasets unused for "
        f"{format_duration(reply.evict_min_age_seconds)} and pinned by no live job give way, oldest use first"
    )
    print_table(holding_rows(list(reply.holdings), time.time()), HOLDING_HEADER)
    if reply.charges:
        print_table(charge_rows(list(reply.charges)), CHARGE_HEADER)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser("cache", help="a node's cached datasets: list, evict, pin (operators)")
    csub = cache.add_subparsers(dest="cache_action", required=True, metavar="ACTION")
    ls = csub.add_parser("ls", help="each cached dataset version: bytes, last use, user charged, pins; each quota")
    evict = csub.add_parser(
        "evict", help="evict a dataset's cache (its registration stays); with no name, all the policy lets go"
    )
    evict.add_argument("name", nargs="?", default="", help="a dataset or a CACHE_DB of `cache ls`")
    evict.add_argument("--dry-run", action="store_true", help="say what would be evicted, evict nothing")
    evict.add_argument("--force", action="store_true", help="evict it though a job or the operator pins it")
    pin = csub.add_parser("pin", help="keep a dataset's cache from eviction, as a live job does")
    unpin = csub.add_parser("unpin", help="undo `cache pin`")
    for p in (pin, unpin):
        p.add_argument("name", help="a dataset or a CACHE_DB of `cache ls`")
    for p in (ls, evict, pin, unpin):
        add_addr(p)
        p.set_defaults(func=cmd_cache)
