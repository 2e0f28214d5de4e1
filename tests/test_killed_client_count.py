"""A trainer killed by SIGKILL (or the OOM killer) sends no last report; the
daemon still stops counting it among its open clients as soon as its process
is gone, in `status --json` and `dataquay_clients` alike, and keeps its reads
in the totals."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from one_daemon import add, stage
from polling import wait_until

from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

N = 20

#: Reads every sample, reports, says so and waits to be killed.
TRAINER = """
import sys, time
import dataquay.client as dq
client = dq.connect(sys.argv[1], timeout=20)
client.dataset("imgs").get_batch(list(range(int(sys.argv[2]))))
client.report_stats()
print("read", flush=True)
time.sleep(600)
"""


def counts(daemon: DaemonProcess) -> tuple[int, int, str]:
    """(clients in status --json, samples the trainers read, dataquay_clients on /metrics)."""
    done = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "status", "--json", "--addr", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as reply:
        (metric,) = re.findall(r"^dataquay_clients (\S+)$", reply.read().decode(), re.M)
    return document["clients"], sum(r["samples"] for r in document["client_reads"]), metric


def test_a_sigkilled_trainer_no_longer_counts_as_an_open_client(daemon: DaemonProcess, tmp_path: Path) -> None:
    add(daemon, "imgs", make_files_dataset(tmp_path / "pfs", N, sizes=(1000,)))
    stage(daemon, "imgs")
    with subprocess.Popen(
        [sys.executable, "-c", TRAINER, daemon.address, str(N)], stdout=subprocess.PIPE, text=True
    ) as trainer:
        try:
            assert trainer.stdout is not None and trainer.stdout.readline() == "read\n"
            assert counts(daemon) == (1, N, "1.0")
        finally:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=30)
    # Its process is gone at once; the daemon needs no report, nor a day, to see it.
    wait_until(lambda: counts(daemon)[0] == 0, "the killed trainer no longer counted", timeout=5)
    assert counts(daemon) == (0, N, "0.0")
