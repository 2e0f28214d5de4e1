"""One node's `dataquay status` table counts what the trainers read, local
hits included, with the same figures as `status --json` and /metrics: a
trainer reads a staged dataset (every sample a local hit, served in-process),
and the three places a user looks must agree, sample for sample; once it has
exited, none of them counts it as a client."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from one_daemon import add, stage

from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

N = 40
SIZE = 3000

#: A trainer: reads every sample twice and exits (its client reports at close).
TRAINER = """
import sys
import dataquay.client as dq
with dq.connect(sys.argv[1], timeout=20) as client:
    dataset = client.dataset("imgs")
    for _ in range(2):
        assert sum(map(len, dataset.get_batch(list(range(int(sys.argv[2])))))) == int(sys.argv[2]) * int(sys.argv[3])
"""


def cli(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_single_node_status_counts_the_trainers_reads_as_json_and_metrics_do(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    root = make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,))
    add(daemon, "imgs", root)
    stage(daemon, "imgs")
    ran = subprocess.run(
        [sys.executable, "-c", TRAINER, daemon.address, str(N), str(SIZE)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr

    table = cli("status", "--addr", daemon.address)
    # The trainer has exited: its reads stay in the totals, it no longer counts as a client.
    section = table.split("trainers' reads (0 clients open):\n", 1)[1].splitlines()
    assert section[0].split() == ["TIER", "SAMPLES", "SHARE", "BYTES"]
    shown = {}
    for row in section[1:]:
        if (match := re.match(r"^(\w+)\s+(\d+)\s+[\d.]+%", row)) is None:
            break
        shown[match[1]] = int(match[2])

    document = json.loads(cli("status", "--json", "--addr", daemon.address))
    as_json = {r["tier"]: r["samples"] for r in document["client_reads"]}
    # Plain JSON: integers as numbers, zeros and false present, tiers as the words the table shows.
    assert all(type(r["samples"]) is int and type(r["bytes"]) is int for r in document["client_reads"])
    assert document["pfs_errors"] == 0 and document["cache_full"] is False and type(document["pfs_bytes"]) is int
    assert {r["tier"] for r in document["reads"]} <= {"cache", "peer", "pfs"}

    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as reply:
        page = reply.read().decode()
    metrics = {
        tier: int(float(value))
        for tier, value in re.findall(r'^dataquay_client_reads_total\{tier="(\w+)"\} (\S+)$', page, re.M)
    }

    assert sum(shown.values()) == 2 * N and shown.get("local") == 2 * N
    assert shown == as_json == metrics
    clients = re.findall(r"^dataquay_clients (\S+)$", page, re.M)
    assert document["clients"] == 0 and clients == ["0.0"]
