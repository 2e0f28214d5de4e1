"""Attacks on a coded exchange's multicast, between real daemons with a token and TLS.

Multicast reaches whoever joins the group: a plain UDP socket on the host
(:class:`Sniffer`) captures what the daemons multicast and sends what it
likes to the group. It must see no sample bytes, and nothing it sends
(replays of an earlier pass, tampered copies, garbage) may change what the
daemons commit or stop a pass; every such datagram is dropped and counted.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import struct
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from polling import wait_until
from test_coded_exchange import multicast_group
from test_exchange import NODES, SAMPLES, SIZES, Nodes, sample_payload

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.auth import new_token_file
from dataquay.server.cli import main as cli_main
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
    reason="openssl is not installed: the tests make their certificates with it",
)

#: Two job names whose xxh3("job/1") agree modulo 4095: passes told apart by a 12-bit hash would share groups.
JOB_A, JOB_B = "coded-a", "coded-b3547"


class SecuredNodes(Nodes):
    """Stubs of a cluster with tokens and TLS, presenting the node token and TLS (they ask as daemons do)."""

    def _stub(self, index: int) -> cache_pb2_grpc.CacheStub:
        ready = self.local.daemons[index].ready
        assert ready is not None
        channel = self.local.node_credentials().channel(ready["tcp"], channel_options())
        self._channels.append(channel)
        return cache_pb2_grpc.CacheStub(channel)

    def after(self, epoch: int) -> np.ndarray:
        """The job's owners in ``epoch``."""
        manifest = Manifest(b"".join(c.data for c in self.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = job_plan(
            self.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=self.job), must_exist=True)), manifest
        )
        found = owners(job, 0)
        for e in range(1, epoch + 1):
            found = owners(job, e, found)
        return found

    def dropped(self) -> dict[str, int]:
        """Datagrams (and packets) every node dropped, by reason."""
        total: dict[str, int] = {}
        for stats in self.stats():
            for reason, count in stats.mcast_datagrams_dropped.items():
                total[reason] = total.get(reason, 0) + count
        return total

    def check_owned(self, epoch: int) -> None:
        """Every node holds its share of ``epoch``, byte for byte."""
        after = self.after(epoch)
        for m in range(NODES):
            mine = np.flatnonzero(after == m)
            assert self.holds(m, mine).all()
            self.read(m, mine)


#: Addresses of the pool the sniffer joins (a socket joins 20 at most by default).
SNIFFED_ADDRESSES = 16


#: Datagrams of one pass the replay test sends again, over and over, during the next.
REPLAYED = 64


class Sniffer:
    """A plain UDP socket on every address of the daemons' multicast pool: anyone on the network."""

    def __init__(self, group_port: str) -> None:
        group, _, port = group_port.rpartition(":")
        self.group, self.port = group, int(port)
        self.captured: list[bytes] = []
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("", self.port))
        # A 4-node plan has at most 14 sets of receivers: the snapshots' address and 14 more carry them all.
        for slot in range(SNIFFED_ADDRESSES):
            address = str(ipaddress.IPv4Address(group) + slot)
            self._listen.setsockopt(
                socket.IPPROTO_IP,
                socket.IP_ADD_MEMBERSHIP,
                struct.pack("4s4s", socket.inet_aton(address), socket.inet_aton("127.0.0.1")),
            )
        self._listen.settimeout(0.05)
        self._send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        self._send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._capture, daemon=True)]
        self._threads[0].start()

    def _capture(self) -> None:
        while not self._stop.is_set():
            try:
                self.captured.append(self._listen.recv(1 << 16))
            except TimeoutError:
                continue

    def inject(self, make: Callable[[], list[bytes]]) -> None:
        """Multicasts ``make()``'s datagrams to the group, again and again, until :meth:`close`."""

        def loop() -> None:
            while not self._stop.is_set():
                for datagram in make():
                    self._send.sendto(datagram, (self.group, self.port))
                self._stop.wait(0.002)

        thread = threading.Thread(target=loop, daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._listen.close()
        self._send.close()


@pytest.fixture
def secured(
    cluster: Callable[..., LocalCluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalCluster, str]]:
    """4 daemons with a token and TLS and a multicast group for coded passes; dataset "imgs" registered."""
    from test_auth import make_certificates

    group = multicast_group()
    local = cluster(
        NODES,
        daemon_args=("--exchange-multicast", group),
        token_file=new_token_file(tmp_path / "token"),
        tls=make_certificates(tmp_path / "pki"),
    )
    for name, value in local.node_env(0).items():
        monkeypatch.setenv(name, value)
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    yield local, group


def stage(local: LocalCluster, job: str, seed: int = 0) -> None:
    assert (
        cli_main(
            [
                "stage",
                "imgs",
                "--job",
                job,
                "--mode",
                "partial",
                "--q",
                "1",
                "--exchange-coding",
                "uber",
                "--ranks-per-node",
                "2",
                "--seed",
                str(seed),
                "--quiet",
                "--directory",
                local.directory_address,
            ]
        )
        == 0
    )


def assert_coded(runs: list[pb.ExchangeProgress]) -> None:
    """Every node's pass ran to its end and the pass decoded samples."""
    assert [(run.coded_note, run.error) for run in runs] == [("", "")] * NODES
    assert sum(run.coded_samples_decoded for run in runs) > 0


def test_a_sniffer_on_the_group_sees_no_sample_bytes(secured: tuple[LocalCluster, str]) -> None:
    local, group = secured
    stage(local, JOB_A)
    nodes = SecuredNodes(local, JOB_A)
    sniffer = Sniffer(group)
    try:
        nodes.report(0)
        assert_coded(nodes.wait_exchanged(1))
        moved = np.flatnonzero(nodes.after(0) != nodes.after(1)).tolist()
    finally:
        sniffer.close()
        nodes.close()
    captured = b"\n".join(sniffer.captured)
    assert len(sniffer.captured) > 0
    seen = [i for i in moved if any(window in captured for window in (sample_payload(i)[:32], sample_payload(i)[-32:]))]
    assert seen == []


def test_a_datagram_captured_in_one_pass_is_refused_and_counted_in_the_next(secured: tuple[LocalCluster, str]) -> None:
    local, group = secured
    stage(local, JOB_A)
    nodes = SecuredNodes(local, JOB_A)
    sniffer = Sniffer(group)
    try:
        nodes.report(0)
        assert_coded(nodes.wait_exchanged(1))
        wait_until(lambda: len(sniffer.captured) > 0, "the sniffer captured pass 1", poll=0.05)
        # A sample of the pass is enough: replaying all of it over and over only costs CPU.
        first_pass = sniffer.captured[:REPLAYED]
        sniffer.inject(lambda: first_pass)
        nodes.report(1)
        assert_coded(nodes.wait_exchanged(2))
        wait_until(lambda: nodes.dropped().get("unknown_pass", 0) > 0, "pass 2 counted the replays", poll=0.1)
        nodes.check_owned(2)
    finally:
        sniffer.close()
        nodes.close()
    scraped = [urllib.request.urlopen(d.metrics_url, timeout=10).read().decode() for d in local.daemons]
    assert any('dataquay_mcast_datagrams_dropped_total{reason="unknown_pass"}' in text for text in scraped)


def test_tampered_and_garbage_datagrams_are_counted_and_the_pass_goes_on(secured: tuple[LocalCluster, str]) -> None:
    local, group = secured
    stage(local, JOB_A)
    nodes = SecuredNodes(local, JOB_A)
    sniffer = Sniffer(group)
    rng = random.Random(7)

    def forged() -> list[bytes]:
        latest = sniffer.captured[-8:]
        # The pass's own datagrams, one byte of each flipped past the clear header.
        tampered = [d[:40] + bytes([d[40] ^ 0x55]) + d[41:] for d in latest if len(d) > 41]
        garbage = [os.urandom(rng.randrange(0, 1500)) for _ in range(4)]
        return tampered + garbage + [b"DQ\x02" + os.urandom(60), b"", b"DQ"]

    try:
        sniffer.inject(forged)
        nodes.report(0)
        assert_coded(nodes.wait_exchanged(1))
        dropped = nodes.dropped()
        assert dropped.get("unauthenticated", 0) > 0 and dropped.get("malformed", 0) > 0, dropped
        nodes.check_owned(1)
    finally:
        sniffer.close()
        nodes.close()


def test_two_jobs_coded_at_once_on_the_same_daemons_both_finish_byte_exact(secured: tuple[LocalCluster, str]) -> None:
    local, _ = secured
    stage(local, JOB_A)
    stage(local, JOB_B, seed=1)
    jobs = [SecuredNodes(local, JOB_A), SecuredNodes(local, JOB_B)]
    try:
        threads = [threading.Thread(target=nodes.report, args=(0,)) for nodes in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for nodes in jobs:
            assert_coded(nodes.wait_exchanged(1))
        for nodes in jobs:
            nodes.check_owned(1)
    finally:
        for nodes in jobs:
            nodes.close()


def test_an_exchange_that_fails_shows_in_stats_and_status(
    secured: tuple[LocalCluster, str], capsys: pytest.CaptureFixture[str]
) -> None:
    local, _ = secured
    stage(local, JOB_A)
    nodes = SecuredNodes(local, JOB_A)
    try:
        assert cli_main(["dataset", "drop", "imgs", "--addr", local.daemons[0].address]) == 0
        # Each node drops its copy, and its cached samples, once it hears of the drop.
        wait_until(lambda: all(s.cache_entries == 0 for s in nodes.stats()), "every node dropped imgs", poll=0.1)
        nodes.report(0)
        runs: list[pb.ExchangeProgress | None] = []

        def reported() -> bool:
            runs[:] = [nodes.exchange(m, 1) for m in range(NODES)]
            return all(run is not None for run in runs)

        wait_until(reported, "every node reported its exchange into epoch 1", poll=0.1)
        for run in runs:
            assert run is not None and run.failed and run.finished
            assert "imgs" in run.error and run.error.startswith("failed: ")
        capsys.readouterr()
        assert cli_main(["status", "--directory", local.directory_address]) == 0
        status = capsys.readouterr().out
        assert status.count(f"{JOB_A}") >= NODES and "failed: " in status
    finally:
        nodes.close()


def test_a_node_of_the_job_cannot_take_another_nodes_part_in_leading_a_pass(secured: tuple[LocalCluster, str]) -> None:
    local, _ = secured
    stage(local, JOB_A)
    nodes = SecuredNodes(local, JOB_A)
    try:
        first = nodes.stubs[0].CodedPass(pb.CodedPassRequest(job=JOB_A, epoch=1), timeout=10).pass_id
        assert first == nodes.stubs[0].CodedPass(pb.CodedPassRequest(job=JOB_A, epoch=1), timeout=10).pass_id
        assert first != nodes.stubs[0].CodedPass(pb.CodedPassRequest(job=JOB_A, epoch=2), timeout=10).pass_id
        with pytest.raises(grpc.RpcError) as refused:
            nodes.stubs[1].CodedPass(pb.CodedPassRequest(job=JOB_A, epoch=1), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as unknown:
            nodes.stubs[0].CodedPass(pb.CodedPassRequest(job="nosuchjob", epoch=1), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        nodes.close()
