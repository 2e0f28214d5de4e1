"""A second `dataquay serve` on a socket another daemon serves exits with one
line and leaves that daemon's sockets where they are: its clients read on."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dataquay.client as dq
from dataquay.client.wire.channels import channel_options
from dataquay.client.wire.memfd import fd_socket_path
from dataquay.client.wire.security import Credentials
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

N = 8
SIZE = 4096


def read_all(address: str) -> bytes:
    with Credentials.from_env().channel(address, channel_options()) as channel:
        request = pb.ReadRequest(dataset="imgs", ids=list(range(N)))
        chunks = cache_pb2_grpc.CacheStub(channel).Read(request, timeout=30)
        return b"".join(sample.data for chunk in chunks for sample in chunk.samples)


def test_a_second_serve_on_a_served_socket_leaves_the_first_daemons_sockets(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    root = make_files_dataset(tmp_path / "pfs", N, sizes=(SIZE,))
    with Credentials.from_env().channel(daemon.address, channel_options()) as channel:
        cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="imgs", root=str(root)), timeout=30)
    expected = b"".join(sample_bytes(0, i, SIZE) for i in range(N))
    assert read_all(daemon.address) == expected
    sockets = [daemon.socket, Path(fd_socket_path(str(daemon.socket)))]
    before = {path: os.stat(path).st_ino for path in sockets if path.exists()}
    assert daemon.socket in before  # the fd socket too, where this kernel seals memfds

    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "serve",
            "--socket",
            str(daemon.socket),
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--cache-dir",
            str(tmp_path / "second" / "cache"),
            "--state-dir",
            str(tmp_path / "second" / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [
        f"dataquay: error: another daemon is serving on socket {daemon.socket}"
    ]

    assert {path: os.stat(path).st_ino for path in before} == before
    assert daemon.ready is not None
    with dq.connect(daemon.address, timeout=5) as client:
        assert client.info.pid == daemon.ready["pid"]
    assert read_all(daemon.address) == expected
