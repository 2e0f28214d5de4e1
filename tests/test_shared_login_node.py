"""Two users on one login node each start `dataquay serve` with no port flags:
both daemons serve, on ports of their own, their /metrics on loopback only,
and `dataquay status` tells each user the addresses of their own daemon. The
users are other uids (setpriv), as on a shared host."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs daemons as other users: needs root and setpriv"
)

USERS = (54411, 54412)


def user_env(home: Path) -> dict[str, str]:
    """A login shell's environment: no dataquay settings, the user's own home and runtime dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATAQUAY_", "XDG_"))}
    return {**env, "HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run")}


def as_user(uid: int, home: Path, *argv: str) -> list[str]:
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        sys.executable,
        "-m",
        "dataquay.server.cli",
        *argv,
    ]


@pytest.fixture
def homes() -> Iterator[dict[int, Path]]:
    base = Path(tempfile.mkdtemp(prefix="dq-login-", dir="/tmp"))
    base.chmod(0o755)
    homes = {}
    for uid in USERS:
        home = base / str(uid)
        (home / "run").mkdir(parents=True, mode=0o700)
        for path in (home, home / "run"):
            os.chown(path, uid, uid)
        homes[uid] = home
    try:
        yield homes
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_two_users_start_daemons_with_defaults_on_one_host_without_clashing(homes: dict[int, Path]) -> None:
    daemons = {}
    for uid, home in homes.items():
        with (home / "serve.log").open("wb") as log:
            daemons[uid] = subprocess.Popen(
                as_user(uid, home, "serve", "--cache-size", "64M", "--ready-file", str(home / "ready.json")),
                env=user_env(home),
                cwd=home,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
    try:
        deadline = time.monotonic() + 60
        while not all((home / "ready.json").exists() for home in homes.values()):
            for uid, proc in daemons.items():
                assert proc.poll() is None, (homes[uid] / "serve.log").read_text()
            assert time.monotonic() < deadline, "daemons not ready after 60 s"
            time.sleep(0.05)
        ready = {uid: json.loads((home / "ready.json").read_text()) for uid, home in homes.items()}
        tcp = [r["tcp"] for r in ready.values()]
        metrics = [r["metrics_address"] for r in ready.values()]
        assert len(set(tcp)) == 2 and len(set(metrics)) == 2, ready
        assert all(a.startswith("127.0.0.1:") for a in tcp + metrics), ready
        for address in metrics:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
                assert reply.status == 200 and b"dataquay_" in reply.read()
        for uid, home in homes.items():
            status = subprocess.run(
                as_user(uid, home, "status"), env=user_env(home), cwd=home, capture_output=True, text=True, timeout=60
            )
            assert status.returncode == 0, status.stderr
            line = f"listening on {ready[uid]['tcp']}, metrics http://{ready[uid]['metrics_address']}/metrics"
            assert line in status.stdout.splitlines(), status.stdout
    finally:
        for proc in daemons.values():
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in daemons.values()]
    assert codes == [0, 0]
