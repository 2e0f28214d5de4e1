"""Caches and state dirs are owner/group-only whatever the umask: staged
samples and manifests are not for every user of the node."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from one_daemon import add, stage
from polling import wait_until

from dataquay.server.tools import synthetic
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.processes import DaemonProcess


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The common umask, under which files come out readable by everyone; servers started inherit it."""
    old = os.umask(0o022)
    yield
    os.umask(old)


#: Files for the daemon's user alone: the node's identity key.
DAEMON_ONLY = frozenset({"node.key"})
#: Files the group writes: LMDB's lock file, where the socket group's trainers
#: take reader slots when every caller is trusted (the default, --users one).
GROUP_WRITES = frozenset({"lock.mdb"})


def expected_mode(path: Path) -> int:
    if path.is_dir():
        return 0o750
    return 0o600 if path.name in DAEMON_ONLY else 0o660 if path.name in GROUP_WRITES else 0o640


def open_to_others(*roots: Path) -> dict[str, str]:
    """Every directory and file under ``roots`` whose mode is not the one it is made with, with its mode."""
    found: dict[str, str] = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(path.lstat().st_mode)
            if mode != expected_mode(path):
                found[str(path)] = f"{mode:04o}"
    return found


def test_serve_keeps_its_cache_and_manifests_from_other_users(
    umask_022: None, start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    synthetic.make_files_dataset(tmp_path / "pfs", 20)
    add(daemon, "imgs", tmp_path / "pfs")
    stage(daemon, "imgs")
    state = daemon.home / "state"
    assert {"data.mdb", "lock.mdb"} <= {p.name for p in daemon.cache_dir.iterdir()}
    assert (state / "datasets" / "imgs" / "manifest.dq").is_file()
    assert open_to_others(daemon.cache_dir, state) == {}


def test_a_cache_made_open_to_others_is_closed_on_restart(
    umask_022: None, start_daemon: Callable[..., DaemonProcess]
) -> None:
    daemon = start_daemon()
    daemon.stop()
    daemon.cache_dir.chmod(0o755)
    (daemon.cache_dir / "data.mdb").chmod(0o644)
    daemon.start()
    assert stat.S_IMODE(daemon.cache_dir.stat().st_mode) == 0o750
    assert stat.S_IMODE((daemon.cache_dir / "data.mdb").stat().st_mode) == 0o640


def test_cluster_up_keeps_caches_and_directory_state_from_other_users(
    umask_022: None, cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(2)
    synthetic.make_files_dataset(tmp_path / "pfs", 20)
    add(local.daemons[0], "imgs", tmp_path / "pfs")
    assert local.directory is not None
    directory_state = local.directory.state_dir
    wait_until(lambda: list(directory_state.rglob("manifest.dq")), "the directory holds the manifest")
    roots = [directory_state, *(p for d in local.daemons for p in (d.cache_dir, d.home / "state"))]
    assert open_to_others(*roots) == {}
