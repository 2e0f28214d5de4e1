"""Bulk peers that stop reading: a send out of the cache's map gives the map
back when it must grow, and a daemon whose reader stalls stages on and still
sends every byte exact."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_bulk import SIZE, bulk_address, make_certificates

from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import new_token_file
from dataquay.server.node.peers.bulk.frames import (
    END,
    HELLO,
    MAC_BYTES,
    MAP_SEND_SECONDS,
    OK,
    SAMPLE,
    client_proof,
    kernel_timeouts,
    read_request,
    recv_all,
    recv_bytes,
    send_all,
)
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes


def short_send_timeout(sock: socket.socket, kind: str) -> None:
    """The two ways a sender out of the map times its sends out: the kernel's, Python's."""
    if kind == "kernel":
        kernel_timeouts(sock, receive=5.0)
    else:
        sock.settimeout(MAP_SEND_SECONDS)


@pytest.mark.parametrize("timeout", ["kernel", "python"])
def test_a_send_out_of_the_map_lets_the_map_go_when_asked_and_the_rest_goes_as_a_copy(timeout: str) -> None:
    payload = np.random.default_rng(5).integers(0, 256, 32 << 20, dtype=np.uint8).tobytes()
    sender, receiver = socket.socketpair()
    with sender, receiver:
        short_send_timeout(sender, timeout)
        asked = []
        rest = send_all(
            sender, [payload[: 1 << 20], memoryview(payload)[1 << 20 :]], 5.0, lambda: asked.append(1) is None
        )
        # Nobody reads: the socket took what its buffers hold, the rest is a copy that outlives the views.
        assert asked and rest and all(isinstance(part, bytes) for part in rest)
        left = sum(map(len, rest))
        assert 0 < left < len(payload)
        got = bytearray(len(payload))

        def read_later() -> None:
            time.sleep(0.1)  # five of the socket's send timeouts go by with nothing sent
            recv_all(receiver, [memoryview(got)])

        reading = threading.Thread(target=read_later)
        reading.start()
        assert send_all(sender, rest, 5.0) == []
        reading.join()
        assert got == payload


@pytest.mark.parametrize("timeout", ["kernel", "python"])
def test_a_send_out_of_the_map_to_a_peer_that_stops_reading_times_out(timeout: str) -> None:
    sender, receiver = socket.socketpair()
    with sender, receiver:
        short_send_timeout(sender, timeout)
        with pytest.raises(TimeoutError):
            send_all(sender, [bytes(32 << 20)], stall=0.2)


@pytest.mark.parametrize(
    "tls",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                reason="openssl is not installed: the test makes its certificates with it",
            ),
        ),
    ],
    ids=["tcp", "tls"],
)
def test_a_token_holder_that_stops_reading_holds_back_neither_the_map_nor_the_bytes(
    cluster: Callable[..., LocalCluster], tmp_path: Path, tls: bool
) -> None:
    """A read's client that takes nothing more pins the cache's map until the
    send stalls out (30 s), and a growth of the map waits on it: every commit
    with it. The daemon must grow the map, stage on, and still send the
    stalled client the exact bytes once it reads."""
    small = make_files_dataset(tmp_path / "pfs" / "small", 100, sizes=(SIZE,))
    large = make_files_dataset(tmp_path / "pfs" / "large", 400, sizes=(SIZE,), seed=1)
    pem = make_certificates(tmp_path / "pki") if tls else None
    local = cluster(1, token_file=new_token_file(tmp_path / "token"), tls=pem)
    with local.credentials().channel(local.daemons[0].address, channel_options()) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)

        def stage(name: str, root: Path, timeout: float) -> None:
            stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root)), timeout=30)
            stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=name, dataset=name)), timeout=30)
            *_, last = stub.Stage(pb.StageRequest(dataset=name, job=name), timeout=timeout)
            assert not last.error

        stage("small", small, 60)
        host, _, port = bulk_address(local, 0).rpartition(":")
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # takes next to nothing
        raw.settimeout(30)
        raw.connect((host, int(port)))
        stalled = raw
        if pem is not None:
            context = ssl.create_default_context(cafile=pem.ca)
            context.load_cert_chain(pem.cert, pem.key)
            stalled = context.wrap_socket(raw, server_hostname=host)

        with stalled:
            _magic, nonce = HELLO.unpack(recv_bytes(stalled, HELLO.size))
            mine = b"\2" * 32
            stalled.sendall(mine + client_proof(local.node_credentials().token, nonce, mine))
            assert len(recv_bytes(stalled, MAC_BYTES)) == MAC_BYTES
            stalled.sendall(read_request("small", "", np.arange(100, dtype=np.int64)))
            time.sleep(0.5)  # the daemon's send fills the socket's buffers and waits

            stage("large", large, 20)  # four times the map the small one needed, well inside the stall

            got: dict[int, bytes] = {}
            while True:
                status, sample_id, length, _ = SAMPLE.unpack(recv_bytes(stalled, SAMPLE.size))
                if status == END:
                    break
                assert status == OK
                got[sample_id] = recv_bytes(stalled, length)
        assert got == {i: sample_bytes(0, i, SIZE) for i in range(100)}
        large_samples = [
            s
            for chunk in stub.Read(pb.ReadRequest(dataset="large", ids=list(range(400)), job="large"), timeout=60)
            for s in chunk.samples
        ]
        assert [s.data for s in large_samples] == [sample_bytes(1, i, SIZE) for i in range(400)]
        assert {s.tier for s in large_samples} == {pb.TIER_CACHE}
