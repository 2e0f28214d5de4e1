"""``dataquay simulate``: what a mode and Q cost a job, epoch by epoch, before it runs.

The model is :mod:`dataquay.server.tools.simulate`'s; this module parses the flags,
reports progress on stderr and prints a table or one JSON document.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

import numpy as np

from dataquay.client.job_settings import JobSettings
from dataquay.client.placement import MODES, JobPlan, drawn_fraction, leaving_fraction
from dataquay.server.cli.capacity_advice import JobRoom, job_room
from dataquay.server.cli.common import CliError, add_q, print_table
from dataquay.server.node.exchange.coding import SCHEMES
from dataquay.server.node.exchange.coding_payoff import NodeBytes, Payoff, payoff
from dataquay.server.sizes import format_bytes, parse_size, size_flag
from dataquay.server.tools.coded_traffic import CodedEpoch
from dataquay.server.tools.simulate import (
    SPARE,
    EpochTraffic,
    Estimate,
    Rates,
    Scenario,
    Spread,
    estimate,
    simulate,
    spread,
)

#: Simulations that run longer than this report their progress on stderr,
#: a line at most every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 2.0
PROGRESS_EVERY_S = 1.0

# The fields that the model's ValueErrors name, and the flags that set them.
_FLAGS = {
    "num_samples": "--samples",
    "num_nodes": "--nodes",
    "ranks_per_node": "--ranks-per-node",
    "batch_size": "--per-rank-batch",
    "seed": "--seed",
    "mode": "--mode",
    "q": "--q",
    "q_leaving": "--q-leaving",
    "sample_bytes": "--sample-bytes",
    "cache_bytes": "--cache-bytes",
    "train_rate": "--train-rate",
    "pfs_bandwidth": "--pfs-bandwidth",
    "network_bandwidth": "--network-bandwidth",
    "egress_bandwidth": "--egress-bandwidth",
    "exchange_coding": "--exchange-coding",
    "leave_at": "--leave-at",
    "join_at": "--join-at",
    "read_ahead": "--read-ahead",
}
_RATE_FLAGS = ("train_rate", "pfs_bandwidth", "network_bandwidth")


def _flag_error(exc: ValueError) -> CliError:
    """The model's message with the fields it names replaced by their flags:
    the one it starts with, and any other field with an underscore in its
    name (a plain word such as "mode" is the word as often as the field)."""
    field, space, rest = str(exc).partition(" ")
    rest = re.sub(r"\b[a-z]+_[a-z_]+\b", lambda m: _FLAGS.get(m.group(), m.group()), rest)
    return CliError(f"{_FLAGS.get(field, field)}{space}{rest}")


def _bandwidth(text: str, flag: str) -> int:
    return parse_size(text.removesuffix("/s"), flag)


def _inputs(args: argparse.Namespace) -> tuple[Scenario, Rates | None]:
    given = [name for name in _RATE_FLAGS if getattr(args, name) is not None]
    if given and len(given) < len(_RATE_FLAGS):
        missing = ", ".join(_FLAGS[name] for name in _RATE_FLAGS if name not in given)
        raise CliError(f"the estimate needs --train-rate, --pfs-bandwidth and --network-bandwidth: missing {missing}")
    if args.epochs < 1:
        raise CliError(f"--epochs must be at least 1, not {args.epochs}")
    if args.egress_bandwidth is not None and not given:
        raise CliError("--egress-bandwidth is compared with --network-bandwidth: give the three rates too")
    try:
        q = args.q
        if args.q_leaving is not None:
            q = drawn_fraction(args.q_leaving, max(1, args.nodes))
        settings = JobSettings(
            mode=args.mode,
            q=0.0 if q is None else q,
            seed=args.seed,
            batch_size=args.per_rank_batch,
            ranks_per_node=args.ranks_per_node,
        )
        plan = JobPlan(settings, num_samples=args.samples, num_nodes=args.nodes)
        # A job whose owners move keeps its nodes: the one that joins is the one that left.
        back = MODES[args.mode].owners_move and args.leave_at is not None
        scenario = Scenario(
            plan,
            parse_size(args.sample_bytes, "--sample-bytes"),
            None if args.cache_bytes is None else parse_size(args.cache_bytes, "--cache-bytes"),
            args.exchange_coding,
            args.leave_at,
            args.join_at,
            joiner=plan.nodes[0] if back else SPARE,
            read_ahead=args.read_ahead,
        )
        rates = None
        if given:
            rates = Rates(
                args.train_rate,
                _bandwidth(args.pfs_bandwidth, "--pfs-bandwidth"),
                _bandwidth(args.network_bandwidth, "--network-bandwidth"),
                None if args.egress_bandwidth is None else _bandwidth(args.egress_bandwidth, "--egress-bandwidth"),
            )
    except ValueError as exc:
        raise _flag_error(exc) from None
    return scenario, rates


def _spread_json(s: Spread) -> dict[str, float]:
    return {"min": s.min, "median": s.median, "max": s.max, "mean": s.mean, "balance": s.balance}


def _epoch_json(
    scenario: Scenario, traffic: EpochTraffic, est: Estimate | None, links: tuple[float, float]
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "epoch": traffic.epoch,
        "nodes": traffic.nodes,
        "moved_bytes": traffic.moved_bytes,
        "moved_percent": 100.0 * traffic.moved_bytes / scenario.dataset_bytes,
        "network_bytes": traffic.network_bytes,
        "network_percent": 100.0 * traffic.network_bytes / scenario.dataset_bytes,
        "pfs_bytes": traffic.pfs_bytes,
        "early_read_bytes": traffic.early_read_bytes,
        "sent_bytes_per_node": _spread_json(spread(traffic.sent)),
        "received_bytes_per_node": _spread_json(spread(traffic.received)),
    }
    if traffic.coding is not None:
        entry["coding"] = _coding_json(scenario, traffic.coding, links)
    if traffic.balance is not None:
        median, p90 = np.percentile(traffic.balance.imbalance, [50, 90]).tolist()
        entry["imbalance_percent"] = {"median": median, "p90": p90}
        transfers = traffic.balance.transfers
        entry["transfers_per_batch"] = {"mean": float(transfers.mean()), "max": int(transfers.max())}
    if est is not None:
        entry["estimate_s"] = {
            "training": est.training,
            "pfs": est.pfs,
            "network": est.network,
            "epoch": est.epoch,
            "spill": est.spill,
        }
    return entry


def _payoff(scenario: Scenario, coding: CodedEpoch, links: tuple[float, float]) -> Payoff:
    """The exchange's :class:`Payoff` at (egress, ingress) bytes/s per node."""
    size = scenario.sample_bytes
    uncoded = NodeBytes(coding.uncoded_nodes.sent * size, coding.uncoded_nodes.received * size)
    return payoff(uncoded, NodeBytes(coding.sent * size, coding.received * size), coding.copies, *links)


def _coding_json(scenario: Scenario, coding: CodedEpoch, links: tuple[float, float]) -> dict[str, Any]:
    size = scenario.sample_bytes
    uncoded, coded = coding.uncoded, coding.coded
    pays = _payoff(scenario, coding, links)
    return {
        "scheme": coding.scheme,
        "copies_per_sample": coding.copies,
        "uncoded": {"transmissions": uncoded.transmissions, "bytes": uncoded.bytes * size},
        "coded": {
            "packets": coded.packets,
            "fetches": coded.fetches,
            "transmissions": coded.transmissions,
            "bytes": coded.bytes * size,
        },
        "saved_percent": 100.0 * coding.saved,
        "payoff": {
            "pays": pays.pays,
            "bound": pays.bound,
            "uncoded_seconds": pays.uncoded_seconds,
            "coded_seconds": pays.coded_seconds,
            "reason": pays.reason,
        },
    }


def _coding_summary(scenario: Scenario, epochs: list[dict[str, Any]]) -> str:
    """Whether coding paid, over all exchanges, and why not where it did not."""
    codings = [entry["coding"] for entry in epochs if "coding" in entry]
    if not codings:
        return ""
    scheme = codings[0]["scheme"]
    uncoded = sum(c["uncoded"]["bytes"] for c in codings)
    coded = sum(c["coded"]["bytes"] for c in codings)
    saved = 100.0 * (1 - coded / uncoded) if uncoded else 0.0
    copies = max(c["copies_per_sample"] for c in codings)
    line = (
        f"\n{scheme} coding: {format_bytes(coded)} on the wire against {format_bytes(uncoded)} uncoded from the "
        f"same caches over {len(codings)} exchanges ({saved:.1f}% saved); caches hold up to {copies:.2f} copies "
        "of a sample"
    )
    if copies <= 1.0 + 1e-9:
        line += (
            ": no spare copies (each cache holds its share only; a --cache-bytes above the share keeps "
            "given-away samples), so there is nothing to code against"
        )
    last = codings[-1]["payoff"]
    verdict = "pays" if last["pays"] else "does not pay"
    return f"{line}\nin time, coding {verdict} (the last exchange, on the nodes' links): {last['reason']}"


def _warnings(scenario: Scenario, epochs: list[dict[str, Any]]) -> list[str]:
    """One line per ``partial`` exchange that does not fit into the epoch before it."""
    lines = []
    for entry in epochs:
        est = entry.get("estimate_s")
        if est is not None and est["spill"] > 0:
            e = entry["epoch"]
            lines.append(
                f"the exchange before epoch {e} takes {est['network']:.2f} s but epoch {e - 1} trains for only "
                f"{est['training']:.2f} s ({scenario.iterations} iterations per epoch): {est['spill']:.2f} s "
                f"spill into epoch {e} as peer reads; a lower --q or a faster network hides it"
            )
    return lines


def _room(scenario: Scenario) -> JobRoom:
    """The nodes' caches against their shares. Every sample has the same size,
    so a node's bytes follow its count, which no mode changes: epoch 0 says all."""
    plan = scenario.plan
    sizes = np.full(plan.num_samples, scenario.sample_bytes, dtype=np.int64)
    names = [str(node) for node in range(plan.num_nodes)]
    return job_room(plan, sizes, names, [scenario.cache_bytes] * plan.num_nodes, epochs=1)


def _room_json(room: JobRoom) -> dict[str, Any]:
    largest = max(room.nodes, key=lambda n: n.need)
    return {
        "largest_share_bytes": largest.share,
        "need_bytes": room.need,
        "need_flag": size_flag(room.need),
        "short_nodes": sum(n.short for n in room.nodes),
    }


def _q_text(plan: JobPlan) -> str:
    """partial's q in both readings: drawn into the pool, and leaving each node."""
    q = plan.settings.q
    return (
        f"q {q:g} drawn into the pool; {leaving_fraction(q, plan.num_nodes):.4g} of each node's samples "
        "leave it, Nguyen et al.'s Q"
    )


def _row(entry: dict[str, Any], coding_column: bool, change_columns: bool, early_column: bool) -> list[object]:
    sent, received = entry["sent_bytes_per_node"], entry["received_bytes_per_node"]
    row: list[object] = [
        entry["epoch"],
        *(
            [entry["nodes"], format_bytes(entry["moved_bytes"]), f"{entry['moved_percent']:.2f}"]
            if change_columns
            else []
        ),
        format_bytes(entry["network_bytes"]),
        f"{entry['network_percent']:.2f}",
        format_bytes(entry["pfs_bytes"]),
        *([format_bytes(entry["early_read_bytes"])] if early_column else []),
        " / ".join(format_bytes(sent[k]) for k in ("min", "median", "max")),
        " / ".join(format_bytes(received[k]) for k in ("min", "median", "max")),
        f"{max(sent['balance'], received['balance']):.2f}",
    ]
    if "imbalance_percent" in entry:
        imbalance, transfers = entry["imbalance_percent"], entry["transfers_per_batch"]
        row += [f"{imbalance['median']:.2f}", f"{imbalance['p90']:.2f}", f"{transfers['mean']:.1f}", transfers["max"]]
    if "estimate_s" in entry:
        est = entry["estimate_s"]
        row += [f"{est[k]:.2f}" for k in ("training", "pfs", "network", "epoch")]
    if coding_column:
        coding = entry.get("coding")
        row += (
            [
                format_bytes(coding["uncoded"]["bytes"]),
                format_bytes(coding["coded"]["bytes"]),
                f"{coding['saved_percent']:.1f}",
            ]
            if coding
            else ["", "", ""]
        )
    return row


def _print_report(scenario: Scenario, epochs: list[dict[str, Any]], room: JobRoom) -> None:
    plan, settings = scenario.plan, scenario.plan.settings
    setting = _q_text(plan) if settings.mode == "partial" else f"batch {settings.batch_size} per rank"
    largest = max(room.nodes, key=lambda n: n.need)
    headroom = ", plus the exchange's headroom" if largest.need > largest.share else ""
    given = (
        ""
        if scenario.cache_bytes is None
        else f"; --cache-bytes {format_bytes(scenario.cache_bytes)} " + ("is short" if largest.short else "holds it")
    )
    print(
        f"mode {settings.mode} ({setting}): {plan.num_nodes:,} nodes x {settings.ranks_per_node} ranks, "
        f"{plan.num_samples:,} samples of {format_bytes(scenario.sample_bytes)} "
        f"({format_bytes(scenario.dataset_bytes)}), {scenario.iterations:,} iterations per epoch\n"
        f"cache per node: {size_flag(room.need)} holds every share (the largest takes "
        f"{format_bytes(largest.share)} in LMDB{headroom}){given}\n"
    )
    changes = scenario.leave_at is not None or scenario.join_at is not None
    early = any(entry["early_read_bytes"] for entry in epochs)
    header = [
        "EPOCH",
        *(["NODES", "MOVED", "% MOVED"] if changes else []),
        "NETWORK",
        "% DATA",
        "PFS",
        *(["READ EARLY"] if early else []),
        "SEND/NODE min/med/max",
        "RECV/NODE min/med/max",
        "BALANCE",
    ]
    if "imbalance_percent" in epochs[0]:
        header += ["IMB MED %", "IMB P90 %", "XFER MEAN", "XFER MAX"]
    if "estimate_s" in epochs[0]:
        header += ["TRAIN s", "PFS s", "NET s", "EPOCH s"]
    coding = scenario.exchange_coding != "none"
    if coding:
        header += ["UNCODED", "CODED", "SAVED %"]
    print_table([_row(entry, coding, changes, early) for entry in epochs], header)
    if early:
        print(
            "\nREAD EARLY: what ranks read from a peer before the exchange brought it: a cache short of its share "
            "takes a sample once its sender's ranks have read it, and the next epoch's read-ahead asks sooner"
        )
    if coding:
        print(_coding_summary(scenario, epochs))


def _links(rates: Rates | None) -> tuple[float, float]:
    """Each node's (egress, ingress) bytes/s; equal when no rates are given (the verdict is then of bytes alone)."""
    return (1.0, 1.0) if rates is None else (rates.egress, rates.network_bandwidth)


def cmd_simulate(args: argparse.Namespace) -> None:
    scenario, rates = _inputs(args)
    links = _links(rates)
    epochs = []
    started = time.monotonic()
    next_report = started + PROGRESS_AFTER_S
    for traffic in simulate(scenario, args.epochs):
        est = None if rates is None else estimate(scenario, traffic, rates)
        epochs.append(_epoch_json(scenario, traffic, est, links))
        now = time.monotonic()
        if now >= next_report:
            done = traffic.epoch + 1
            print(f"simulated {done}/{args.epochs} epochs in {now - started:.0f} s", file=sys.stderr, flush=True)
            next_report = now + PROGRESS_EVERY_S
    room = _room(scenario)
    warnings = _warnings(scenario, epochs)
    if scenario.cache_bytes is not None:
        warnings += room.warnings("--cache-bytes", per_node=False)
    if args.json:
        inputs = {
            name: getattr(args, name)
            for name in (
                "nodes",
                "ranks_per_node",
                "samples",
                "per_rank_batch",
                "mode",
                "q",
                "q_leaving",
                "seed",
                "epochs",
                "exchange_coding",
                "leave_at",
                "join_at",
                "read_ahead",
            )
        }
        inputs.update(sample_bytes=scenario.sample_bytes, cache_bytes=scenario.cache_bytes)
        inputs.update({name: getattr(rates, name) if rates else None for name in _RATE_FLAGS})
        inputs["egress_bandwidth"] = rates.egress_bandwidth if rates else None
        document = {
            "inputs": inputs,
            "dataset_bytes": scenario.dataset_bytes,
            "iterations_per_epoch": scenario.iterations,
            "q": {
                "drawn": scenario.plan.settings.q,
                "leaving": leaving_fraction(scenario.plan.settings.q, scenario.plan.num_nodes),
            },
            "cache": _room_json(room),
            "epochs": epochs,
            "warnings": warnings,
        }
        print(json.dumps(document, indent=2))
    else:
        _print_report(scenario, epochs, room)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="bytes over the network and from the PFS per epoch for a mode and q, by running placement",
        description="Runs the real placement of a job's sizes and reports, per epoch, the bytes over the network "
        "and from the PFS, how evenly nodes send and receive, and (with all three rates) an epoch-time estimate.",
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes M (one daemon and cache each)")
    p.add_argument("--samples", type=int, required=True, help="samples N in the dataset")
    p.add_argument("--sample-bytes", required=True, help="size of each sample (e.g. 110K)")
    p.add_argument("--per-rank-batch", type=int, required=True, help="samples each rank reads per step (b)")
    p.add_argument("--ranks-per-node", type=int, required=True, help="ranks per node (g, usually the GPUs)")
    p.add_argument("--mode", required=True, help=f"placement mode: {', '.join(MODES)}")
    add_q(p)
    p.add_argument("--epochs", type=int, default=3, help="epochs to simulate, staging epoch 0 included (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the job's shuffle seed (default 0)")
    p.add_argument("--cache-bytes", help="cache capacity per node (e.g. 200G); default: all a node owns fits")
    p.add_argument("--train-rate", type=float, help="samples per second one node trains on (for the estimate)")
    p.add_argument("--pfs-bandwidth", help="PFS bytes/s for the whole job, e.g. 20G (for the estimate)")
    p.add_argument("--network-bandwidth", help="bytes/s each node sends and receives, e.g. 12G (for the estimate)")
    p.add_argument(
        "--egress-bandwidth",
        help="bytes/s each node sends, where it is less than --network-bandwidth (an oversubscribed uplink; for "
        "the estimate): coding pays only where senders' egress bounds the exchange",
    )
    p.add_argument(
        "--exchange-coding",
        default="none",
        choices=list(SCHEMES),
        help="code partial's exchanges: caches keep spare copies up to --cache-bytes and XOR packets are multicast "
        "(coded: Lee et al.'s tables; uber: UberShuffle); reports the coded load against the uncoded one "
        "(default none)",
    )
    p.add_argument(
        "--leave-at",
        type=int,
        metavar="EPOCH",
        help="a node is lost before EPOCH: the others hold its share, read once from the PFS, and nothing else "
        "moves; in mode partial every rank reads on as before (reports the bytes whose holder changed)",
    )
    p.add_argument(
        "--join-at",
        type=int,
        metavar="EPOCH",
        help="a spare node joins before EPOCH and takes its share from the nodes that held it; in mode partial "
        "after --leave-at, the node that was lost comes back and takes its share",
    )
    p.add_argument(
        "--read-ahead",
        type=int,
        default=2,
        metavar="BATCHES",
        help="batches each rank reads ahead of the one it trains on (default 2, as Dataset.batches): with caches "
        "short of the share, the next epoch's first reads come before the exchange brings them",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.set_defaults(func=cmd_simulate)
