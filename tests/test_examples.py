"""The training scripts of examples/, unchanged, against a local cluster:
each rank's process trains on its share of a staged dataset, every sample
once an epoch across ranks, every read a hit in the node's cache; and the
frameworks page shows each script as it is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from one_daemon import daemon_stats

from dataquay.server.cli import main as cli_main
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
#: One class a sample, so a class seen once an epoch is a sample seen once.
SAMPLES = 48
EPOCHS = 2
RANKS = 2
SIZES = (256, 4096)


@pytest.fixture
def staged(cluster: Callable[..., LocalCluster], tmp_path: Path) -> LocalCluster:
    """One node with "imgs" (48 samples, one class each) staged whole in its cache."""
    local = cluster(1)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, classes=SAMPLES, sizes=SIZES)
    address = local.daemons[0].address
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", address]) == 0
    assert cli_main(["stage", "imgs", "--quiet", "--addr", address]) == 0
    return local


def run_ranks(local: LocalCluster, commands: list[list[str]], envs: list[dict[str, str]]) -> list[dict]:
    """Runs the commands at once on node 0; the JSON lines they printed, in order."""
    base = {**os.environ, **local.node_env(0), "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(cmd, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for cmd, env in zip(commands, envs)
    ]
    lines = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        lines += json_objects(out)
    return lines


def json_objects(out: str) -> list[dict]:
    """Every JSON object printed in ``out``: ranks that share a pipe (torchrun)
    may write one object before another's newline."""
    decoder, found, at = json.JSONDecoder(), [], out.find("{")
    while at >= 0:
        obj, end = decoder.raw_decode(out, at)
        found.append(obj)
        at = out.find("{", end)
    return found


def script_ranks(local: LocalCluster, script: str, *dataset: str) -> list[dict]:
    """The example run as two ranks (RANK and WORLD_SIZE as srun's launcher gives them)."""
    cmd = [sys.executable, str(EXAMPLES / script), *dataset, "--epochs", str(EPOCHS)]
    return run_ranks(local, [cmd] * RANKS, [{"RANK": str(r), "WORLD_SIZE": str(RANKS)} for r in range(RANKS)])


def assert_every_sample_once_an_epoch(lines: list[dict]) -> None:
    for epoch in range(EPOCHS):
        seen = [sum(counts) for counts in zip(*(line["seen"] for line in lines if line.get("epoch") == epoch))]
        assert seen == [1] * SAMPLES, f"epoch {epoch}"


def assert_every_read_a_local_hit(local: LocalCluster, *, reported: bool = True) -> None:
    """The node's daemon served no sample and read the PFS only to stage,
    so every sample trained on was read from its cache in the rank's own
    process; with ``reported``, the ranks' clients (their DataLoader workers
    too) reported that many local hits."""
    stats = daemon_stats(local.daemons[0])
    assert sum(t.samples for t in stats.reads) == 0
    assert stats.pfs_bytes == sum(SIZES) * SAMPLES // len(SIZES)
    assert stats.cache_behind.page_cache_samples == stats.cache_behind.handed_samples == 0
    if reported:
        reads = {r.tier: r.samples for r in stats.client_reads}
        assert reads.get("local") == sum(reads.values()) == SAMPLES * EPOCHS


def test_the_pytorch_ddp_example_under_torchrun_trains_on_every_sample_once_an_epoch(staged: LocalCluster) -> None:
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    lines = run_ranks(staged, [[*cmd, str(EXAMPLES / "torch_ddp.py"), "imgs", "--epochs", str(EPOCHS)]], [{}])
    assert [line["epoch"] for line in lines if "epoch" in line] == list(range(EPOCHS))  # rank 0's, summed over ranks
    assert_every_sample_once_an_epoch(lines)
    # Each rank's client.stats() counts its forked DataLoader workers' reads.
    ranks = [line["samples"] for line in lines if "rank" in line]
    assert len(ranks) == RANKS and sum(r["local"] for r in ranks) == SAMPLES * EPOCHS
    assert_every_read_a_local_hit(staged)


def test_the_jax_grain_example_trains_on_every_sample_once_an_epoch(staged: LocalCluster) -> None:
    for package in ("jax", "grain"):
        pytest.importorskip(package)
    lines = script_ranks(staged, "jax_grain.py", "--dataset", "imgs")
    assert len([line for line in lines if "epoch" in line]) == RANKS * EPOCHS
    assert_every_sample_once_an_epoch(lines)
    # grain ends its worker processes before they report what they read.
    assert_every_read_a_local_hit(staged, reported=False)


def test_the_tensorflow_example_trains_on_every_sample_once_an_epoch(staged: LocalCluster) -> None:
    pytest.importorskip("tensorflow")
    lines = script_ranks(staged, "tf_keras.py", "imgs")
    assert len([line for line in lines if "epoch" in line]) == RANKS * EPOCHS
    assert_every_sample_once_an_epoch(lines)
    ranks = [line["samples"] for line in lines if "rank" in line]
    assert sum(r["local"] for r in ranks) == SAMPLES * EPOCHS
    assert_every_read_a_local_hit(staged)


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_the_frameworks_page_shows_each_example_as_it_is(script: str) -> None:
    page = (REPO / "docs" / "guides" / "frameworks.md").read_text()
    shown = re.search(rf"`examples/{re.escape(script)}`:\n\n```python\n(.*?)```\n", page, re.S)
    assert shown is not None, f"docs/guides/frameworks.md does not show examples/{script}"
    assert shown.group(1) == (EXAMPLES / script).read_text()
