"""The client when its dataset changes under it: a dataset replaced or dropped
while open serves its old bytes or fails clearly, never the new ones; opened
again, a replaced dataset serves its new content."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from one_daemon import add, cache_stub, files_bytes, read_locally, stage

import dataquay.client as dq
from dataquay.client.errors import DataquayError, UnknownDatasetError
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

# ------------------------------------------------------------------ helpers


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *args], capture_output=True, text=True, timeout=60
    )


# ------------------------------------------ 1. replaced while open

V_SIZES = (2000, 9000, 40)


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, Path]:
    """Two versions of one dataset: same shape, different bytes."""
    v1 = synthetic.make_files_dataset(tmp_path / "v1", 24, sizes=V_SIZES, seed=21)
    v2 = synthetic.make_files_dataset(tmp_path / "v2", 24, sizes=V_SIZES, seed=22)
    return v1, v2


def test_a_replaced_dataset_opened_again_serves_the_new_content(
    daemon: DaemonProcess, client: dq.Client, versions: tuple[Path, Path]
) -> None:
    v1, v2 = versions
    ids = list(range(24))
    add(daemon, "ds", v1)
    stage(daemon, "ds")
    old = client.dataset("ds")
    assert read_locally(client, old, ids[:12]) == files_bytes(21, ids[:12], V_SIZES)

    replaced = run_cli("dataset", "add", "ds", str(v2), "--replace", "--addr", daemon.address)
    assert replaced.returncode == 0, replaced.stderr

    new = client.dataset("ds")
    assert new.manifest.manifest_id != old.manifest.manifest_id and new.manifest.root == str(v2)
    assert new.get_batch(ids[::-1]) == files_bytes(22, ids[::-1], V_SIZES)
    stage(daemon, "ds")
    assert read_locally(client, new, ids) == files_bytes(22, ids, V_SIZES)
    with dq.connect(daemon.address, timeout=5) as other:
        assert other.dataset("ds").get_batch([5, 0]) == files_bytes(22, [5, 0], V_SIZES)


def test_a_dataset_open_before_a_replace_never_returns_the_new_content(
    daemon: DaemonProcess, client: dq.Client, versions: tuple[Path, Path]
) -> None:
    v1, v2 = versions
    add(daemon, "ds", v1)
    stage(daemon, "ds")
    old = client.dataset("ds")
    assert read_locally(client, old, [0, 1, 2]) == files_bytes(21, [0, 1, 2], V_SIZES)

    add(daemon, "ds", v2, replace=True)
    stale = files_bytes(22, range(24), V_SIZES)
    for i in range(24):
        try:
            got = old[i]
        except DataquayError:
            continue  # refusing is fine
        assert checksum(got) != checksum(stale[i]), f"the Dataset opened on v1 returned sample {i} of v2"
        assert checksum(got) == checksum(files_bytes(21, [i], V_SIZES)[0])


# --------------------------------------------- 2. dropped while open


def test_reads_of_a_dropped_dataset_fail_clearly_or_stay_correct(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    sizes = (4000, 600)
    synthetic.make_files_dataset(tmp_path / "gone", 30, sizes=sizes, seed=31)
    synthetic.make_files_dataset(tmp_path / "kept", 10, sizes=sizes, seed=32)
    add(daemon, "gone", tmp_path / "gone")
    add(daemon, "kept", tmp_path / "kept")
    stage(daemon, "gone")
    ds = client.dataset("gone")
    want = files_bytes(31, range(30), sizes)
    assert read_locally(client, ds, list(range(10))) == want[:10]

    with cache_stub(daemon) as stub:
        assert stub.DropDataset(pb.DropDatasetRequest(name="gone")).freed_samples == 30

    started = time.monotonic()
    failures = 0
    for ids in ([0], [5, 1], list(range(30)), [29, 29]):
        try:
            got = ds.get_batch(ids)
        except UnknownDatasetError as exc:
            assert "gone" in str(exc)
            failures += 1
        else:
            assert got == [want[i] for i in ids]
    try:
        assert ds[3] == want[3]
    except UnknownDatasetError:
        failures += 1
    assert time.monotonic() - started < 10
    with pytest.raises(UnknownDatasetError, match="gone"):
        client.dataset("gone")

    kept = client.dataset("kept")
    assert kept.get_batch([9, 0]) == files_bytes(32, [9, 0], sizes)
    assert [d.name for d in client.datasets()] == ["kept"]
