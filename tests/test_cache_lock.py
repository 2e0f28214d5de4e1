"""One daemon per cache dir: a second one exits naming the first, and a
killed daemon's cache is free again for its restart."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from one_daemon import add, daemon_stats, stage

from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess


def test_a_second_daemon_on_a_cache_dir_exits_naming_the_first(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    first = start_daemon()
    assert first.process is not None
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "serve",
            "--socket",
            str(tmp_path / "second.sock"),
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--state-dir",
            str(tmp_path / "second-state"),
            "--cache-dir",
            str(first.cache_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dataquay: error:")
    assert f"cache dir {first.cache_dir} is in use by another daemon (pid {first.process.pid})" in lines[0]
    assert not (tmp_path / "second.sock").exists()

    synthetic.make_files_dataset(tmp_path / "pfs", 20)
    add(first, "imgs", tmp_path / "pfs")
    assert stage(first, "imgs").done_samples == 20
    assert daemon_stats(first).cache_entries == 20


def test_a_killed_daemons_cache_dir_is_free_for_its_restart(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    first = start_daemon()
    synthetic.make_files_dataset(tmp_path / "pfs", 20)
    add(first, "imgs", tmp_path / "pfs")
    stage(first, "imgs")
    first.kill()

    restarted = start_daemon(
        "--cache-dir", str(first.cache_dir), "--state-dir", str(first.home / "state"), name="node1"
    )
    assert restarted.process is not None
    assert daemon_stats(restarted).cache_entries == 20
    assert (first.cache_dir / "daemon.lock").read_text().strip() == str(restarted.process.pid)
