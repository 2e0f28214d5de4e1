"""Nobody but the daemon's user may own or write its socket directory, and a
client sends its token only to a socket of a user it trusts."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import dataquay.client as dq
from dataquay.client.wire.security import (
    CredentialsError,
    check_daemon_socket,
    socket_trust_problem,
    trusted_socket_owners,
)
from dataquay.server.errors import StartupError
from dataquay.server.listen import check_socket_dir
from dataquay.server.tools.processes import DaemonProcess

#: A uid no test process runs as: "another user".
OTHER_UID = 54321


def fake_stat(uid: int, mode: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_socket_dir_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StartupError, match=r"socket dir .*/shared \(owner .*, mode 0777\) must be owned by"):
        check_socket_dir(shared)


def test_a_socket_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, OTHER_UID, -1)
    with pytest.raises(StartupError, match=f"owner uid {OTHER_UID}, mode 0700"):
        check_socket_dir(squatted)


def test_serve_refuses_a_world_writable_socket_dir_with_one_line(tmp_path: Path) -> None:
    squatted = tmp_path / "dataquay-0"
    squatted.mkdir()
    squatted.chmod(0o777)
    result = serve(
        "--socket",
        str(squatted / "dataquay.sock"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dataquay: error: socket dir")
    assert str(squatted) in lines[0] and "mode 0777" in lines[0]
    assert not (squatted / "dataquay.sock").exists()


@pytest.mark.parametrize(
    ("group_flags", "dir_mode"), [((), 0o700), (("--socket-group", grp.getgrgid(os.getgid()).gr_name), 0o750)]
)
def test_the_daemon_creates_its_socket_dir_for_itself_and_its_socket_group(
    tmp_path: Path, group_flags: tuple[str, ...], dir_mode: int
) -> None:
    sock_dir = Path(f"/tmp/dq-trust-{os.getpid()}-{len(group_flags)}")
    daemon = DaemonProcess(tmp_path / "node0", group_flags, socket_path=sock_dir / "dataquay.sock")
    old_umask = os.umask(0o077)
    try:
        daemon.start()
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(sock_dir.stat().st_mode) == dir_mode
        assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
        with dq.connect(daemon.address, timeout=5) as client:
            assert client.address == daemon.address
    finally:
        daemon.stop()
        sock_dir.rmdir()


def test_trusted_owners_are_you_root_and_the_named_daemon_user() -> None:
    assert trusted_socket_owners({}) == {os.geteuid(), 0}
    assert OTHER_UID in trusted_socket_owners({"DATAQUAY_DAEMON_USER": str(OTHER_UID)})
    assert 0 in trusted_socket_owners({"DATAQUAY_DAEMON_USER": "root"})
    with pytest.raises(CredentialsError, match="DATAQUAY_DAEMON_USER='no-such-user-here' names no user"):
        trusted_socket_owners({"DATAQUAY_DAEMON_USER": "no-such-user-here"})


@pytest.mark.parametrize(
    ("sock_uid", "dir_uid", "dir_mode", "problem"),
    [
        (1000, 1000, 0o700, None),
        (0, 0, 0o755, None),
        (1000, 0, 0o1777, None),
        (OTHER_UID, 1000, 0o700, f"it belongs to uid {OTHER_UID}, neither you nor root"),
        (1000, OTHER_UID, 0o755, f"its directory /run/dq belongs to uid {OTHER_UID}"),
        (1000, 1000, 0o777, "its directory /run/dq (mode 0777) is writable by other users"),
        (1000, 1000, 0o770, "(mode 0770) is writable by other users"),
        (None, OTHER_UID, 0o700, f"belongs to uid {OTHER_UID}"),
    ],
)
def test_a_client_trusts_only_sockets_that_no_other_user_could_have_placed(
    sock_uid: int | None, dir_uid: int, dir_mode: int, problem: str | None
) -> None:
    sock = None if sock_uid is None else fake_stat(sock_uid, stat.S_IFSOCK | 0o660)
    found = socket_trust_problem(
        "/run/dq/dataquay.sock", sock, fake_stat(dir_uid, stat.S_IFDIR | dir_mode), frozenset({1000, 0})
    )
    assert found is None if problem is None else problem in (found or "")


def test_a_client_refuses_a_socket_of_another_user_unless_named_the_daemon_user(
    start_daemon: Callable[..., DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = start_daemon()
    os.chown(daemon.socket, OTHER_UID, -1)
    with pytest.raises(CredentialsError, match=f"refusing the daemon socket {daemon.socket}: it belongs to uid"):
        dq.connect(daemon.address, timeout=5)
    with pytest.raises(CredentialsError, match="DATAQUAY_DAEMON_USER"):
        check_daemon_socket(str(daemon.socket))

    monkeypatch.setenv("DATAQUAY_DAEMON_USER", str(OTHER_UID))
    with dq.connect(daemon.address, timeout=5) as client:
        assert client.address == daemon.address
