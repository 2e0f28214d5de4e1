"""`dataquay config show` gives the cache size a daemon started with the
default really opens with (80% of its file system), not the setting's 0:
the same number as the started daemon's `status --json`, within what the
disk's free space moves by between the two reads (other work shares the disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dataquay.server.tools.processes import DaemonProcess


def cli(*argv: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *argv], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_config_show_gives_the_default_cache_size_the_daemon_opens_with(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    env = {**os.environ, "DATAQUAY_CACHE_DIR": str(daemon.cache_dir)}
    table = cli("config", "show", env=env)
    document = json.loads(cli("config", "show", "--json", env=env))
    opened = json.loads(cli("status", "--json", "--addr", daemon.address, env=env))["cache_capacity_bytes"]

    setting = document["daemon"]["cache_size"]
    assert setting["value"] == 0 and setting["source"] == "default"
    assert abs(setting["effective"] - opened) <= 0.1 * opened
    row = next(line for line in table.splitlines() if line.startswith("cache_size "))
    shown = int(row.split()[1])
    assert abs(shown - opened) <= 0.1 * opened and "80% of the cache file system's free space" in row
