"""Coded shuffling on the wire: a loopback cluster runs one exchange per scheme, the coded ones over
the multicast transport, the uncoded baseline over TCP streams as jobs run it.

Each round starts one process per node (:mod:`dataquay.server.tools.coded_wire`)
in a network namespace of its own (loopback with a multicast route and the
MTU the datagrams are sized for; needs root), all computing the same
synthetic dataset, caches with spare copies, new owners and plan, then
sending and decoding over
:class:`~dataquay.server.node.exchange.mcast.MulticastEndpoint` (``coded``,
``uber``: each group of receivers on its own address of a pool of 256) or
over one TCP stream per receiver (``tcp``: the uncoded plan, as the
exchange's streams ship it); every decoded sample is checked against its
checksum. Per scheme and round:

- ``fabric_sent_bytes``: what IP put on the fabric: every datagram the
  senders multicast or resent, and every tail and acknowledgement, with 28
  bytes of IPv4 and UDP each; for TCP, the payload with 52 bytes of IPv4 and
  TCP (timestamps on) per segment the kernel sent, pure acknowledgements
  included (``Tcp: OutSegs``);
- ``fabric_received_bytes``: what the fabric delivered to the nodes: a
  multicast datagram once per node that joined its address (the nodes'
  own counts; the kernel's ``Udp: InDatagrams`` beside them also counts a
  sender's own datagrams looped back where its group shares an address it
  joined, and datagrams still queued when a node closed); for TCP, what was
  sent;
- ``fabric_link_bytes``: the two together, what every link of a switched
  fabric carries in all (a byte crosses its sender's uplink once and each
  receiver's downlink once; the switch replicates a multicast): coding
  lowers the first term only;
- ``busiest_sent_bytes``, ``busiest_received_bytes``: the busiest node's
  link out and in, which bound the exchange's time on a real fabric
  (:mod:`~dataquay.server.node.exchange.coding_payoff`'s model);
- ``cpu_s_per_gb``: the nodes' CPU seconds (user and system, from the start
  to each holding its samples) per GB of samples delivered;
- ``*_vs_tcp``: those against the TCP baseline's;
- ``cpu_s_per_gb_vs_raw_stream``: the CPU per GB against a raw TCP stream
  (bench/cpu_baselines.py: one process sends the bytes the TCP exchange
  delivered, as files of the mean sample size, to another, which receives
  each into a buffer of its own and checks nothing) over the same loopback
  at the same MTU, run once a round after the schemes: the cost of moving
  the bytes at all;

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
from cpu_baselines import raw_stream

from dataquay.server.config import MULTICAST_POOL
from dataquay.server.node.exchange import mcast

SCHEMES = ("tcp", "coded", "uber")
#: Bytes of IPv4 and TCP headers (with timestamps) per segment.
IP_TCP_BYTES = 52
NAMESPACE = f"dqbench{os.getpid()}"
IP_UDP_BYTES = 28
#: What each scheme's summary puts beside the TCP baseline's.
COMPARED = (
    "fabric_sent_bytes",
    "fabric_received_bytes",
    "fabric_link_bytes",
    "busiest_sent_bytes",
    "busiest_received_bytes",
    "wall_s",
    "cpu_s_per_gb",
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def kernel_counts() -> dict[str, int]:
    """The namespace's UDP and TCP counters (``/proc/net/snmp``), as ``Udp.InDatagrams`` and so on."""
    text = subprocess.run(
        ["ip", "netns", "exec", NAMESPACE, "cat", "/proc/net/snmp"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.splitlines()
    counts: dict[str, int] = {}
    for names, values in zip(text[::2], text[1::2], strict=True):
        kind = names.split(":")[0]
        for name, value in zip(names.split()[1:], values.split()[1:], strict=True):
            counts[f"{kind}.{name}"] = int(value)
    return counts


def one_run(rundir: Path, args: argparse.Namespace, scheme: str, payload_bytes: int) -> dict[str, object]:
    shutil.rmtree(rundir, ignore_errors=True)
    rundir.mkdir()
    how = ["--scheme", "none", "--tcp"] if scheme == "tcp" else ["--scheme", scheme]
    command = [
        "ip",
        "netns",
        "exec",
        NAMESPACE,
        sys.executable,
        "-m",
        "dataquay.server.tools.coded_wire",
        "--nodes",
        str(args.nodes),
        "--samples",
        str(args.samples),
        "--mean-bytes",
        str(args.mean_bytes),
        "--spares",
        str(args.spares),
        *how,
        "--seed",
        str(args.seed),
        "--token",
        "bench",
        "--payload-bytes",
        str(payload_bytes),
        "--window-bytes",
        str(args.window_bytes),
        "--rundir",
        str(rundir),
        "--pool",
        str(args.pool),
    ]
    before = kernel_counts()
    processes = [subprocess.Popen([*command, "--node", str(n)]) for n in range(args.nodes)]
    for process in processes:
        if process.wait(timeout=600) != 0:
            raise RuntimeError(f"a node of the {scheme} exchange failed")
    after = kernel_counts()
    kernel = {k: after[k] - before[k] for k in ("Udp.InDatagrams", "Udp.OutDatagrams", "Tcp.OutSegs")}
    results = [json.loads((rundir / f"result.{n}.json").read_text()) for n in range(args.nodes)]
    for result in results:
        if (
            result["checksum_failures"]
            or result["committed"] != result["lacked"]
            or (result["digest"] != result["expected_digest"])
        ):
            raise RuntimeError(f"node {result['node']} of the {scheme} exchange lacks samples")
    stats = [result["stats"] for result in results]
    planned = results[0]["planned_bytes"]
    wall = max(r["received_all"] for r in results) - min(r["started"] for r in results)
    cpu = {"cpu_s": sum(r["cpu_s"] for r in results), "delivered_bytes": sum(r["committed_bytes"] for r in results)}
    cpu["cpu_s_per_gb"] = cpu["cpu_s"] / (cpu["delivered_bytes"] / 1e9)
    if scheme == "tcp":
        payload = sum(s["payload_bytes_sent"] for s in stats)
        sent = payload + IP_TCP_BYTES * kernel["Tcp.OutSegs"]
        # Headers spread over the nodes in proportion to their payload.
        per_node = [s["payload_bytes_sent"] * sent / payload for s in stats]
        into = [s["payload_bytes_received"] * sent / payload for s in stats]
        return {
            "scheme": scheme,
            "payload_bytes_per_datagram": payload_bytes,
            "planned_bytes": planned,
            "planned_transmissions": results[0]["planned_transmissions"],
            "payload_bytes": payload,
            "fabric_sent_bytes": sent,
            "fabric_received_bytes": sent,
            "fabric_link_bytes": 2 * sent,
            "busiest_sent_bytes": max(per_node),
            "busiest_received_bytes": max(into),
            "kernel": kernel,
            "wall_s": wall,
            **cpu,
            "load_average": os.getloadavg(),
        }
    payload = sum(s["packet_bytes_sent"] for s in stats)
    first = sum(s["wire_bytes_sent"] + IP_UDP_BYTES * s["datagrams_sent"] for s in stats)
    resent = sum(s["resent_bytes"] + IP_UDP_BYTES * s["datagrams_resent"] for s in stats)
    control = sum(s["control_bytes_sent"] + IP_UDP_BYTES * s["control_datagrams_sent"] for s in stats)
    per_node = [
        s["wire_bytes_sent"]
        + s["resent_bytes"]
        + s["control_bytes_sent"]
        + IP_UDP_BYTES * (s["datagrams_sent"] + s["datagrams_resent"] + s["control_datagrams_sent"])
        for s in stats
    ]
    into = [s["bytes_received"] + IP_UDP_BYTES * s["datagrams_received"] for s in stats]
    received = sum(into)
    return {
        "scheme": scheme,
        "payload_bytes_per_datagram": payload_bytes,
        "planned_transmissions": results[0]["planned_transmissions"],
        "planned_bytes": planned,
        "payload_bytes": payload,
        "first_sent_bytes": first,
        "resent_bytes": resent,
        "control_bytes": control,
        "resent": sum(s["datagrams_resent"] for s in stats),
        "payload_vs_plan": payload / planned,
        "sent_vs_plan": first / planned,
        "all_vs_plan": (first + resent + control) / planned,
        "fabric_sent_bytes": first + resent + control,
        "fabric_received_bytes": received,
        "fabric_link_bytes": first + resent + control + received,
        "busiest_sent_bytes": max(per_node),
        "busiest_received_bytes": max(into),
        "foreign_datagrams": sum(s["foreign_datagrams"] for s in stats),
        "kernel": kernel,
        "datagrams_received": sum(s["datagrams_received"] for s in stats),
        "wall_s": wall,
        **cpu,
        "load_average": os.getloadavg(),
    }


def raw_stream_run(scratch: Path, delivered_bytes: int, mean_bytes: int, payload_bytes: int) -> dict[str, object]:
    """The raw TCP stream of ``delivered_bytes`` in the namespace (see the docstring)."""
    files = scratch / "raw-stream-files"
    count = max(1, round(delivered_bytes / mean_bytes))
    if not files.is_dir() or len(list(files.iterdir())) != count:
        shutil.rmtree(files, ignore_errors=True)
        files.mkdir()
        for index in range(count):
            (files / f"{index}.bin").write_bytes(os.urandom(mean_bytes))
    home = scratch / "raw-stream"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    paths = [str(files / f"{index}.bin") for index in range(count)]
    measured = raw_stream(paths, home, prefix=("ip", "netns", "exec", NAMESPACE))
    return {
        "scheme": "raw_stream",
        "payload_bytes_per_datagram": payload_bytes,
        "delivered_bytes": count * mean_bytes,
        "cpu_s_per_gb": measured["cpu_s_per_GB"],
        "wall_s": measured["wall_s"],
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
    parser.add_argument(
        "--pool",
        type=int,
        default=MULTICAST_POOL,
        help="multicast addresses the groups spread over (1: every group on one, as one per daemon)",
    )
    parser.add_argument(
        "--mtu",
        type=int,
        nargs="+",
        default=[9000, 1500],
        help="the loopback's MTU, which sizes datagrams and TCP segments: jumbo frames, then Ethernet",
    )
    args = parser.parse_args()
    ip("netns", "add", NAMESPACE)
    rows: list[dict[str, object]] = []
    try:
        ip("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up")
        ip("netns", "exec", NAMESPACE, "ip", "route", "add", "224.0.0.0/4", "dev", "lo")
        with tempfile.TemporaryDirectory() as scratch:
            for mtu in args.mtu:
                ip("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "mtu", str(mtu))
                payload_bytes = mcast.payload_bytes(mtu)
                for round_ in range(args.rounds):
                    order = SCHEMES[round_ % 3 :] + SCHEMES[: round_ % 3]
                    for scheme in order:
                        progress(f"{payload_bytes} B datagrams, round {round_ + 1}, {scheme}")
                        rows.append({"round": round_, **one_run(Path(scratch) / "run", args, scheme, payload_bytes)})
                    progress(f"{payload_bytes} B datagrams, round {round_ + 1}, raw stream")
                    delivered = int(rows[-len(order) :][order.index("tcp")]["delivered_bytes"])  # type: ignore[call-overload]
                    rows.append(
                        {"round": round_, **raw_stream_run(Path(scratch), delivered, args.mean_bytes, payload_bytes)}
                    )
    finally:
        ip("netns", "del", NAMESPACE)
    summary = []
    for mtu in args.mtu:
        runs = {
            s: [r for r in rows if r["scheme"] == s and r["payload_bytes_per_datagram"] == mcast.payload_bytes(mtu)]
            for s in SCHEMES
        }

        raw = [
            r
            for r in rows
            if r["scheme"] == "raw_stream" and r["payload_bytes_per_datagram"] == mcast.payload_bytes(mtu)
        ]
        raw_cpu = statistics.median(float(r["cpu_s_per_gb"]) for r in raw)  # type: ignore[arg-type]

        def median(scheme: str, key: str) -> float:
            return float(statistics.median(float(r[key]) for r in runs[scheme]))  # type: ignore[arg-type]

        for scheme, mine in runs.items():
            line = {
                "scheme": scheme,
                "mtu": mtu,
                "payload_bytes_per_datagram": mcast.payload_bytes(mtu),
                "planned_bytes": mine[0]["planned_bytes"],
                "planned_transmissions": mine[0]["planned_transmissions"],
                **{k: median(scheme, k) for k in COMPARED},
                **{f"{k}_vs_tcp": median(scheme, k) / median("tcp", k) for k in COMPARED},
                "raw_stream_cpu_s_per_gb": raw_cpu,
                "cpu_s_per_gb_vs_raw_stream": median(scheme, "cpu_s_per_gb") / raw_cpu,
            }
            if scheme != "tcp":
                line |= {
                    k: median(scheme, k)
                    for k in ("payload_vs_plan", "sent_vs_plan", "all_vs_plan", "resent", "foreign_datagrams")
                }
            summary.append(line)
            print(json.dumps(line))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "coded_wire.json").write_text(
        json.dumps(
            {
                "benchmark": "coded_wire",
                "machine": machine(),
                "argv": sys.argv,
                "settings": vars(args),
                "summary": summary,
                "runs": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
