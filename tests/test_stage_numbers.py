"""Every count a user sees of a staged dataset agrees, for every format:
`stage`'s summary and bar, `dataset show`, `status` (table and --json) and
/metrics, after a real stage and a real trainer's reads. The PFS's bytes are
what the PFS served (tar headers and the gaps read between samples
included), the same in `stage` as in ``dataquay_pfs_read_bytes_total``; a
cache that cannot hold a dataset is reported as holding what it holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from one_daemon import add

from dataquay.server.sizes import format_bytes
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset, make_npy_dataset, make_tar_dataset

N = 300

#: A trainer: reads every sample once and exits (its client reports at close).
TRAINER = """
import sys
import dataquay.client as dq
with dq.connect(sys.argv[1], timeout=20) as client:
    assert len(client.dataset(sys.argv[2]).get_batch(list(range(int(sys.argv[3]))))) == int(sys.argv[3])
"""

MAKERS: dict[str, Callable[[Path], Path]] = {
    "files": lambda root: make_files_dataset(root, N, sizes=(3000, 5000)),
    "tar": lambda root: make_tar_dataset(root, N, samples_per_shard=50, sizes=(3000, 5000)),
    "npy": lambda root: make_npy_dataset(root, N, record_shape=(16, 24), files=3),
}


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    # A wide "terminal": tqdm cuts a bar written to a pipe at COLUMNS.
    done = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert done.returncode == 0, done.stderr
    return done


def metric(daemon: DaemonProcess, name: str) -> dict[str, float]:
    """A metric's samples by their label text ("" for none)."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as reply:
        page = reply.read().decode()
    return {labels: float(value) for labels, value in re.findall(rf"^{name}(\{{.*\}})? (\S+)$", page, re.M)}


def show(daemon: DaemonProcess, name: str) -> dict[str, str]:
    out = cli("dataset", "show", name, "--addr", daemon.address).stdout
    return {line[:12].strip(): line[12:].strip() for line in out.splitlines()}


@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_stage_dataset_show_status_and_metrics_agree_after_a_real_run(
    fmt: str, daemon: DaemonProcess, tmp_path: Path
) -> None:
    add(daemon, "ds", MAKERS[fmt](tmp_path / "pfs"))
    pfs_before = metric(daemon, "dataquay_pfs_read_bytes_total")[""]
    staged = cli("stage", "ds", "--addr", daemon.address)
    pfs_read = metric(daemon, "dataquay_pfs_read_bytes_total")[""] - pfs_before

    summary = re.match(
        r"staged 'ds': (\d+)/(\d+) samples cached \((\d+) \w+, (\d+) already [\w ]+\), (.+?) (?:read )?from the PFS "
        r"in [\d.]+ s \((.+/s)\)$",
        staged.stdout.strip(),
    )
    assert summary is not None, staged.stdout
    assert summary.group(1, 2, 3, 4) == (str(N), str(N), str(N), "0")
    # The PFS's bytes: what it served, headers included, as /metrics counts them.
    assert summary[5] == format_bytes(pfs_read)
    # The bar ends full, at the rate the summary names (not tqdm's).
    last_bar = staged.stderr.strip().splitlines()[-1]
    assert "100%|" in last_bar and f"{N}/{N} samples, {summary[6]} from the PFS" in last_bar, staged.stderr

    shown = show(daemon, "ds")
    total = int(shown["bytes"].split()[0])
    assert shown["cached"].startswith(f"{N} samples, ")
    assert pfs_read >= total  # every sample's span read once, nothing left out

    ran = subprocess.run(
        [sys.executable, "-c", TRAINER, daemon.address, "ds", str(N)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    document = json.loads(cli("status", "--json", "--addr", daemon.address).stdout)
    table = cli("status", "--addr", daemon.address).stdout
    reads = {r["tier"]: r for r in document["client_reads"]}
    assert sum(r["samples"] for r in reads.values()) == N
    # A cached sample's size, as `dataset show` gives it, is what the trainer read.
    read_bytes = sum(r["bytes"] for r in reads.values())
    assert f"({read_bytes / N:,.0f} B a sample as trainers read it)" in shown["cached"]
    assert metric(daemon, "dataquay_client_read_bytes_total") == {
        f'{{tier="{tier}"}}': float(r["bytes"]) for tier, r in reads.items()
    }
    # The trainer read nothing from the PFS: its pfs figure is staging's, everywhere.
    assert document["pfs_bytes"] == pfs_read + pfs_before
    assert f"pfs read {format_bytes(document['pfs_bytes'])}," in table


def test_a_stage_the_cache_cannot_hold_reports_what_the_cache_holds(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon("--cache-size", "60M")
    add(daemon, "idle", make_files_dataset(tmp_path / "idle", 400, sizes=(100_000,)))
    add(daemon, "new", make_files_dataset(tmp_path / "new", 400, sizes=(100_000,), seed=1))
    cli("stage", "idle", "--addr", daemon.address)
    staged = cli("stage", "new", "--addr", daemon.address).stdout
    cached = re.match(r"staged 'new': (\d+)/400 samples cached \((\d+) ", staged)
    assert cached is not None, staged
    held = int(show(daemon, "new")["cached"].split()[0])
    assert 0 < held < 400
    assert int(cached[1]) == int(cached[2]) == held
    assert "cache full, the rest will be read from the PFS" in staged
    # The cache that staging found full is full in status, --json and metrics too.
    status = cli("status", "--addr", daemon.address).stdout
    assert re.search(r"^node \S+: cache .* entries \(full\)$", status, re.M), status
    assert json.loads(cli("status", "--json", "--addr", daemon.address).stdout)["cache_full"] is True
    assert metric(daemon, "dataquay_cache_full") == {"": 1.0}
    # Staging into the full cache reads nothing, as it says up front.
    add(daemon, "third", make_files_dataset(tmp_path / "third", 40, sizes=(100_000,), seed=2))
    read_before = metric(daemon, "dataquay_pfs_read_bytes_total")
    third = cli("stage", "third", "--addr", daemon.address)
    assert third.stdout.startswith("staged 'third': 0/40 samples cached"), third.stdout
    assert "staging 'third': 0 B of " in third.stderr, third.stderr
    assert metric(daemon, "dataquay_pfs_read_bytes_total") == read_before
