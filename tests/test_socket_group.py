"""--socket-group: the members of the group reach the daemon through the
socket directory the daemon creates; anyone else is told at once that
permission is denied, not left to wait for a deadline. The clients run as
other users (setpriv), the daemon as this one."""

from __future__ import annotations

import grp
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.security import Credentials
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs clients as other users: needs root and setpriv"
)

#: The uid (and gid) the clients run as: not the daemon's user.
CLIENT_UID = 54321
N = 8
SIZE = 4096

#: Reads every sample of "imgs" through the daemon's socket and writes them out whole.
READER = """
import sys
import dataquay.client as dq
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.security import Credentials
from dataquay.protos import cache_pb2 as pb, cache_pb2_grpc

with dq.connect(sys.argv[1], timeout=20) as client:
    assert client.info.node
with Credentials.from_env().channel(sys.argv[1], channel_options()) as channel:
    request = pb.ReadRequest(dataset="imgs", ids=list(range(int(sys.argv[2]))))
    for chunk in cache_pb2_grpc.CacheStub(channel).Read(request, timeout=20):
        for sample in chunk.samples:
            sys.stdout.buffer.write(sample.data)
"""


def socket_group() -> grp.struct_group:
    """A group of this host that the daemon's user is not in."""
    for group in grp.getgrall():
        if group.gr_gid not in os.getgroups() and group.gr_gid != os.getgid():
            return group
    pytest.skip("no group here that the test's user is not in")


@pytest.fixture
def group() -> grp.struct_group:
    return socket_group()


@pytest.fixture(params=["created"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path, group: grp.struct_group) -> Iterator[DaemonProcess]:
    """A daemon with --socket-group, "imgs" registered; its socket in a directory
    it creates, or in one made before: ("open") 0755, that anyone may enter,
    ("closed") 0700, that the group may not."""
    sock_dir = Path(f"/tmp/dq-group-{os.getpid()}")
    if request.param != "created":
        sock_dir.mkdir()
        sock_dir.chmod(0o755 if request.param == "open" else 0o700)
    root = make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,))
    started = DaemonProcess(
        tmp_path / "node0",
        ("--socket-group", group.gr_name),
        dataset_roots=(tmp_path,),
        socket_path=sock_dir / "dataquay.sock",
    )
    old_umask = os.umask(0o022)
    try:
        started.start()
    finally:
        os.umask(old_umask)
    try:
        with Credentials.from_env().channel(started.address, channel_options()) as channel:
            cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)), timeout=30)
        yield started
    finally:
        started.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def as_client(groups: list[str], address: str) -> subprocess.CompletedProcess[bytes]:
    """Runs READER as CLIENT_UID with only ``groups`` (``--clear-groups`` when empty)."""
    drop = ["--groups", ",".join(groups)] if groups else ["--clear-groups"]
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={CLIENT_UID}",
            f"--regid={CLIENT_UID}",
            *drop,
            sys.executable,
            "-c",
            READER,
            address,
            str(N),
        ],
        capture_output=True,
        timeout=60,
        cwd="/",
        env={**os.environ, "HOME": "/"},
    )


def test_the_socket_dir_and_socket_belong_to_the_socket_group(daemon: DaemonProcess, group: grp.struct_group) -> None:
    sock_dir = daemon.socket.parent
    for path, mode in ((sock_dir, 0o750), (daemon.socket, 0o660)):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, group.gr_gid), path


def test_a_member_of_the_socket_group_reads_through_the_socket(daemon: DaemonProcess, group: grp.struct_group) -> None:
    result = as_client([str(group.gr_gid)], daemon.address)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"".join(sample_bytes(0, i, SIZE) for i in range(N))


@pytest.mark.parametrize("daemon", ["created", "open"], indirect=True)
def test_a_user_outside_the_socket_group_is_told_permission_is_denied_at_once(daemon: DaemonProcess) -> None:
    began = time.monotonic()
    result = as_client([], daemon.address)
    took = time.monotonic() - began
    assert result.returncode != 0 and not result.stdout
    last = result.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("dataquay.client.wire.security.CredentialsError: ")
    assert f"cannot reach the daemon socket {daemon.socket}: permission denied" in last
    assert took < 10  # the connect's deadline is 20 s


@pytest.mark.parametrize("daemon", ["closed"], indirect=True)
def test_a_socket_dir_made_before_that_the_group_cannot_enter_is_named_in_the_log(
    daemon: DaemonProcess, group: grp.struct_group
) -> None:
    sock_dir = daemon.socket.parent
    warnings = [line for line in daemon.log_path.read_text().splitlines() if "socket group cannot reach" in line]
    assert len(warnings) == 1
    why = f"socket dir {sock_dir} (mode 0700, gid {os.getgid()}) cannot be entered by group {group.gr_name}"
    assert why in warnings[0]
    assert "denied" in as_client([str(group.gr_gid)], daemon.address).stderr.decode()
