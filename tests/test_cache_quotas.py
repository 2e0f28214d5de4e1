"""Cache quotas on a daemon shared by users (--users apart), each test the
attack of a uid run through setpriv: staging past its user's quota, or past
its group's with a second member's help, and evicting another user's cache.
The kernel names the caller, so a staging is charged to whoever asked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dataquay.client.connection import DaemonConnection
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes files of other users and runs as them (root)")

ALICE, BOB, CAROL = 4242, 4343, 4444
PROJECT = 5151
SAMPLE = 32 * 1024
SAMPLES = 48
DATASET_BYTES = SAMPLE * SAMPLES  # 1.5 MiB
QUOTAS = f"user:{ALICE}=2M,group:{PROJECT}=2500K"


@dataclass
class Site:
    base: Path
    daemon: DaemonProcess

    def dataset(self, name: str, uid: int, seed: int) -> Path:
        """A dataset only ``uid`` (and root) can read."""
        root = make_files_dataset(self.base / "pfs" / name, SAMPLES, sizes=(SAMPLE,), seed=seed, classes=2)
        for path in [root, *root.rglob("*")]:
            os.chown(path, uid, uid)
            path.chmod(0o700 if path.is_dir() else 0o600)
        return root

    def cli(self, uid: int, *args: str, groups: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                f"--groups={groups}" if groups else "--clear-groups",
                sys.executable,
                "-m",
                "dataquay.server.cli",
                *args,
                "--addr",
                self.daemon.address,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HOME": str(self.base / "out")},
        )

    def add_and_stage(self, uid: int, name: str, seed: int, groups: str = "") -> subprocess.CompletedProcess[str]:
        added = self.cli(uid, "dataset", "add", name, str(self.dataset(name, uid, seed)), groups=groups)
        assert added.returncode == 0, added.stderr
        return self.cli(uid, "stage", name, "--quiet", groups=groups)

    def stats(self) -> pb.StatsReply:
        conn = DaemonConnection(self.daemon.address)
        try:
            return conn.call("Stats", lambda stub: stub.Stats(pb.StatsRequest()))
        finally:
            conn.close()


@pytest.fixture
def site() -> Iterator[Site]:
    base = Path(tempfile.mkdtemp(prefix="dq-quotas-", dir="/tmp"))
    base.chmod(0o755)
    for directory, mode in (("pfs", 0o755), ("run", 0o755), ("out", 0o1777)):
        (base / directory).mkdir()
        (base / directory).chmod(mode)
    daemon = DaemonProcess(
        base / "node",
        ("--users", "apart", "--cache-size", "16M", "--cache-quotas", QUOTAS),
        dataset_roots=(base / "pfs",),
        socket_path=base / "run" / "dataquay.sock",
    ).start()
    for sock in (base / "run").iterdir():  # the daemon's socket and its fd socket, for any uid of these tests
        sock.chmod(0o666)
    try:
        yield Site(base, daemon)
    finally:
        daemon.stop()
        shutil.rmtree(base)


def test_a_user_past_its_quota_is_refused_with_the_quota_named(site: Site) -> None:
    assert site.add_and_stage(ALICE, "first", 1).returncode == 0
    refused = site.add_and_stage(ALICE, "second", 2)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(
        "dataquay: error: staging 'second': 1.5 MiB more of the cache is over the user quota "
        f"user:{ALICE}=2M (cache_quotas): it has 512.0 KiB left of 2.0 MiB"
    ), line
    charges = {(c.kind, c.id): c for c in site.stats().cache_charges}
    assert charges["user", ALICE].bytes == DATASET_BYTES and charges["user", ALICE].quota_bytes == 2 << 20
    held = {",".join(h.datasets): h for h in site.stats().cache_holdings}
    assert held["first"].uid == ALICE and held["first"].samples == SAMPLES
    assert "second" not in held or held["second"].samples == 0
    # Another user without a quota stages as much as the cache holds.
    assert site.add_and_stage(BOB, "bobs", 3).returncode == 0
    metrics = urllib.request.urlopen(site.daemon.metrics_url, timeout=10).read().decode()
    assert sample(metrics, f'dataquay_cache_charged_bytes{{id="{ALICE}",kind="user"}}') == DATASET_BYTES
    assert sample(metrics, f'dataquay_cache_quota_bytes{{id="{ALICE}",kind="user"}}') == 2 << 20


def sample(metrics: str, name: str) -> float:
    found = re.search(re.escape(name) + r" (\S+)", metrics)
    assert found, f"{name} not exported"
    return float(found.group(1))


def test_two_members_of_a_project_share_its_quota(site: Site) -> None:
    assert site.add_and_stage(BOB, "bobs", 4, groups=str(PROJECT)).returncode == 0
    refused = site.add_and_stage(CAROL, "carols", 5, groups=str(PROJECT))
    assert refused.returncode == 1 and f"group quota group:{PROJECT}=2500K" in refused.stderr
    assert site.add_and_stage(CAROL, "carols-own", 6).returncode == 0  # outside the project: not charged to it


def test_a_user_cannot_evict_or_pin_another_users_cache(site: Site) -> None:
    assert site.add_and_stage(BOB, "bobs", 7).returncode == 0
    for action in ("evict", "pin"):
        refused = site.cli(ALICE, "cache", action, "bobs")
        assert refused.returncode == 1 and "only the daemon's own user or root manages the cache" in refused.stderr
    listed = site.cli(ALICE, "cache", "ls")
    assert listed.returncode == 0 and "bobs" in listed.stdout
    held = {",".join(h.datasets): h for h in site.stats().cache_holdings}
    assert held["bobs"].samples == SAMPLES
