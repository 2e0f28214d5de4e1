"""A daemon whose callers are all trusted (--users one) with its socket given
to a group, as on a node where one project trains: the trainers of that
group, each under a uid of its own (setpriv), read local hits from the map
in their own processes, as the daemon's own user does. A daemon whose users
are kept apart keeps them out of the map, which holds every user's samples,
and serves them their samples from it.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataquay.server.cli import main as cli_main
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs trainers as other uids (root)")

TRAINER = 4242
SAMPLES = 24
CALLS = Path(__file__).with_name("user_calls.py")


def _group() -> tuple[str, int]:
    """A group that exists here, not root's: the trainers' group of these tests."""
    for name in ("users", "nogroup", "daemon"):
        try:
            return name, grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    pytest.skip("no group but root's to give the socket to")


@pytest.fixture(params=["one", "apart"])
def node(request: pytest.FixtureRequest) -> Iterator[tuple[str, DaemonProcess, Path, int]]:
    group, gid = _group()
    base = Path(tempfile.mkdtemp(prefix="dq-group-", dir="/tmp"))
    base.chmod(0o755)
    for name in ("pfs", "run", "node"):
        (base / name).mkdir(mode=0o755)
    daemon = DaemonProcess(
        base / "node",
        ("--users", request.param, "--socket-group", group),
        dataset_roots=(base / "pfs",),
        socket_path=base / "run" / "dataquay.sock",
    ).start()
    try:
        yield request.param, daemon, base, gid
    finally:
        daemon.stop()
        shutil.rmtree(base)


def trainer_reads(daemon: DaemonProcess, gid: int, name: str, ids: list[int]) -> dict[str, object]:
    as_trainer = ["setpriv", f"--reuid={TRAINER}", f"--regid={TRAINER}", f"--groups={gid}"]
    done = subprocess.run(
        [*as_trainer, sys.executable, str(CALLS), "--addr", daemon.address, "trainer", name, *map(str, ids)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_socket_groups_trainers_read_local_hits_from_the_map_only_when_all_are_trusted(
    node: tuple[str, DaemonProcess, Path, int],
) -> None:
    users, daemon, base, gid = node
    root = make_files_dataset(base / "pfs" / "imgs", SAMPLES, sizes=(2000, 6000), seed=3, classes=2)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", daemon.address]) == 0
    assert cli_main(["stage", "imgs", "--quiet", "--addr", daemon.address]) == 0
    files = sorted(p for p in root.rglob("*") if p.is_file())
    expected = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]

    read = trainer_reads(daemon, gid, "imgs", list(range(SAMPLES)))

    lock = (daemon.cache_dir / "lock.mdb").stat()
    assert read["ok"] == expected
    samples = read["samples"]
    assert isinstance(samples, dict)
    if users == "one":
        assert samples.get("local") == SAMPLES  # every hit from the map, in the trainer's process
        assert (lock.st_gid, stat.S_IMODE(lock.st_mode)) == (gid, 0o660)
    else:
        # Every sample through the daemon, from its cache: a client that cannot
        # look in the map does not take a sample for a miss and read the PFS.
        assert samples.get("cache") == SAMPLES and sum(samples.values()) == SAMPLES
        assert lock.st_gid != gid and stat.S_IMODE(lock.st_mode) == 0o640
