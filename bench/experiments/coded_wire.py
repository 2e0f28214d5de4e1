"""Coded shuffling on the wire: a loopback cluster runs one exchange per scheme over the multicast transport.

Each round starts one process per node (:mod:`dataquay.server.tools.coded_wire`)
in a network namespace of its own (loopback with a multicast route; needs
root), all computing the same synthetic dataset, caches with spare copies,
new owners and plan, then sending and decoding over
:class:`~dataquay.server.node.exchange.mcast.MulticastEndpoint`; every decoded
sample is checked against its checksum. Per scheme and round:

- ``payload_vs_plan``: packet and fetch bytes the senders multicast, against
  the planner's :attr:`~dataquay.server.node.exchange.coding.Load.bytes`;
- ``sent_vs_plan``: the datagrams of those packets as IP puts them on the
  wire (our header and signature, and 28 bytes of IPv4 and UDP each), and
  ``all_vs_plan`` with resends (of datagrams lost, mostly to a full socket
  buffer of a receiver short of CPU), acknowledgements and tail
  announcements added (their IP and UDP headers left out);
- ``wall_s``: from the nodes' common start to the last node holding every
  sample it owns with every member of its groups having acknowledged.

Schemes run interleaved, rounds rotating their order; ratios are of medians.
Writes bench/results/coded_wire.json with the load average of each round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import RESULTS, machine, progress

SCHEMES = ("none", "coded", "uber")
NAMESPACE = f"dqbench{os.getpid()}"
IP_UDP_BYTES = 28


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def one_run(rundir: Path, args: argparse.Namespace, scheme: str, payload_bytes: int) -> dict[str, object]:
    shutil.rmtree(rundir, ignore_errors=True)
    rundir.mkdir()
    command = ["ip", "netns", "exec", NAMESPACE, sys.executable, "-m", "dataquay.server.tools.coded_wire",
               "--nodes", str(args.nodes), "--samples", str(args.samples), "--mean-bytes", str(args.mean_bytes),
               "--spares", str(args.spares), "--scheme", scheme, "--seed", str(args.seed), "--token", "bench",
               "--payload-bytes", str(payload_bytes), "--window-bytes", str(args.window_bytes), "--rundir", str(rundir)]
    processes = [subprocess.Popen([*command, "--node", str(n)]) for n in range(args.nodes)]
    for process in processes:
        if process.wait(timeout=600) != 0:
            raise RuntimeError(f"a node of the {scheme} exchange failed")
    results = [json.loads((rundir / f"result.{n}.json").read_text()) for n in range(args.nodes)]
    for result in results:
        if result["checksum_failures"] or result["committed"] != result["lacked"] or (
                result["digest"] != result["expected_digest"]):
            raise RuntimeError(f"node {result['node']} of the {scheme} exchange lacks samples")
    stats = [result["stats"] for result in results]
    planned = results[0]["planned_bytes"]
    payload = sum(s["packet_bytes_sent"] for s in stats)
    first = sum(s["wire_bytes_sent"] + IP_UDP_BYTES * s["datagrams_sent"] for s in stats)
    resent = sum(s["resent_bytes"] + IP_UDP_BYTES * s["datagrams_resent"] for s in stats)
    control = sum(s["control_bytes_sent"] for s in stats)
    return {
        "scheme": scheme, "payload_bytes_per_datagram": payload_bytes,
        "planned_transmissions": results[0]["planned_transmissions"], "planned_bytes": planned,
        "payload_bytes": payload, "first_sent_bytes": first, "resent_bytes": resent, "control_bytes": control,
        "resent": sum(s["datagrams_resent"] for s in stats),
        "payload_vs_plan": payload / planned, "sent_vs_plan": first / planned,
        "all_vs_plan": (first + resent + control) / planned,
        "wall_s": max(r["received_all"] for r in results) - min(r["started"] for r in results),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--mean-bytes", type=int, default=32 << 10)
    parser.add_argument("--spares", type=int, default=1000, help="random spares per cache (1000: 3 copies at 8 nodes)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-bytes", type=int, default=256 << 10)
    parser.add_argument("--payload-bytes", type=int, nargs="+", default=[8900, 1400],
                        help="packet bytes per datagram: jumbo frames (MTU 9000), then Ethernet's 1500")
    args = parser.parse_args()
    ip("netns", "add", NAMESPACE)
    rows: list[dict[str, object]] = []
    try:
        ip("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up")
        ip("netns", "exec", NAMESPACE, "ip", "route", "add", "224.0.0.0/4", "dev", "lo")
        with tempfile.TemporaryDirectory() as scratch:
            for payload_bytes in args.payload_bytes:
                for round_ in range(args.rounds):
                    order = SCHEMES[round_ % 3:] + SCHEMES[:round_ % 3]
                    for scheme in order:
                        progress(f"{payload_bytes} B datagrams, round {round_ + 1}, {scheme}")
                        rows.append({"round": round_, **one_run(Path(scratch) / "run", args, scheme, payload_bytes)})
    finally:
        ip("netns", "del", NAMESPACE)
    summary = []
    for payload_bytes in args.payload_bytes:
        runs = {s: [r for r in rows if r["scheme"] == s and r["payload_bytes_per_datagram"] == payload_bytes]
                for s in SCHEMES}
        base = statistics.median(r["wall_s"] for r in runs["none"])  # type: ignore[misc]
        for scheme, mine in runs.items():
            wall = statistics.median(r["wall_s"] for r in mine)  # type: ignore[misc]
            line = {"scheme": scheme, "payload_bytes_per_datagram": payload_bytes,
                    "planned_bytes": mine[0]["planned_bytes"],
                    "planned_transmissions": mine[0]["planned_transmissions"],
                    **{k: statistics.median(r[k] for r in mine)  # type: ignore[misc]
                       for k in ("payload_vs_plan", "sent_vs_plan", "all_vs_plan", "resent")},
                    "wall_s": wall, "wall_vs_uncoded": wall / base}
            summary.append(line)
            print(json.dumps(line))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "coded_wire.json").write_text(json.dumps(
        {"benchmark": "coded_wire", "machine": machine(), "argv": sys.argv, "settings": vars(args),
         "summary": summary, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
