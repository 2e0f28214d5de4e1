"""The coded exchange in a job: 4 daemons on loopback, `--exchange-coding none` against `coded` and `uber`.

A ``partial`` job (q = 1) on a files dataset; the daemons keep given-away
samples as spare copies (``--spare-copies-fill 1``), so caches overlap more
each epoch. Per scheme, a fresh cluster runs the exchanges into epochs 1-3
(each started when every node reports the epoch before) and reports, per
exchange: the bytes the coded pass multicast, the bytes the streams sent,
the samples the pass decoded, and the longest of the nodes' exchange times.
Schemes run one after another, in rotating order per round; medians over
rounds. Writes bench/results/coded_exchange.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its shared modules

from common import RESULTS, machine, progress

from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.errors import StartupError
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

SCHEMES = ("none", "coded", "uber")
JOB = "coded-bench"


def multicast_group() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"239.255.{random.randrange(255)}.{random.randrange(1, 255)}:{port}"  # its pool of 256 stays multicast


def run(scheme: str, args: argparse.Namespace, scratch: Path) -> list[dict[str, object]]:
    base = scratch / f"{scheme}-{time.monotonic_ns()}"
    root = make_files_dataset(base / "pfs", args.samples, sizes=args.sizes)
    for attempt in range(3):
        # The directory takes the UDP port of its TCP one, which another process may hold: try again.
        try:
            local = LocalCluster(
                base / f"cluster{attempt}",
                args.nodes,
                ("--spare-copies-fill", "1", "--exchange-multicast", multicast_group()),
                dataset_roots=(base,),
            ).start()
            break
        except StartupError:
            if attempt == 2:
                raise
    try:
        assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
        assert (
            cli_main(
                [
                    "stage",
                    "imgs",
                    "--job",
                    JOB,
                    "--mode",
                    "partial",
                    "--q",
                    "1",
                    "--exchange-coding",
                    scheme,
                    "--ranks-per-node",
                    "1",
                    "--quiet",
                    "--directory",
                    local.directory_address,
                ]
            )
            == 0
        )
        channels = [grpc.insecure_channel(d.ready["tcp"], options=channel_options()) for d in local.daemons if d.ready]
        stubs = [cache_pb2_grpc.CacheStub(c) for c in channels]
        rows = []
        for epoch in range(args.epochs):
            for stub in stubs:
                stub.ReportEpoch(jpb.ReportEpochRequest(job_id=JOB, epoch=epoch), timeout=10)
            while True:
                runs = [
                    next(
                        (
                            x
                            for x in stub.Stats(pb.StatsRequest(), timeout=10).exchanges
                            if x.job == JOB and x.epoch == epoch + 1
                        ),
                        None,
                    )
                    for stub in stubs
                ]
                if all(r is not None and r.finished for r in runs):
                    break
                time.sleep(0.1)
            done = [r for r in runs if r is not None]
            rows.append(
                {
                    "scheme": scheme,
                    "into_epoch": epoch + 1,
                    "moved_bytes": sum(r.total_bytes for r in done),
                    "coded_bytes": sum(r.coded_bytes_sent for r in done),
                    "stream_bytes": sum(r.sent_bytes for r in done),
                    "decoded": sum(r.coded_samples_decoded for r in done),
                    "notes": sorted({r.coded_note for r in done if r.coded_note}),
                    "seconds": max(r.elapsed_seconds for r in done),
                    "load_average": os.getloadavg(),
                }
            )
        for channel in channels:
            channel.close()
        return rows
    finally:
        local.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16 << 10, 24 << 10, 32 << 10])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for scheme in SCHEMES[round_ % 3 :] + SCHEMES[: round_ % 3]:
                progress(f"round {round_ + 1}, {scheme}")
                rows += [{"round": round_, **row} for row in run(scheme, args, Path(scratch))]
    summary = []
    for epoch in range(1, args.epochs + 1):
        base = statistics.median(r["seconds"] for r in rows if r["scheme"] == "none" and r["into_epoch"] == epoch)  # type: ignore[misc]
        for scheme in SCHEMES:
            mine = [r for r in rows if r["scheme"] == scheme and r["into_epoch"] == epoch]
            line = {
                "scheme": scheme,
                "into_epoch": epoch,
                **{
                    k: statistics.median(r[k] for r in mine)  # type: ignore[misc]
                    for k in ("moved_bytes", "coded_bytes", "stream_bytes", "decoded", "seconds")
                },
            }
            line["seconds_vs_none"] = line["seconds"] / base
            summary.append(line)
            print(json.dumps(line), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "coded_exchange.json").write_text(
        json.dumps(
            {
                "benchmark": "coded_exchange",
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
