"""The trainer-side client: failing clearly without a daemon, reading through a
real one (also from forked children), and serving itself from the PFS when its
daemon dies mid-run."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import multiprocessing
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from polling import wait_until
from stopping import stopped

import dataquay.client as dq
from dataquay.client.manifest import Manifest, ManifestWriter
from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools.processes import DaemonProcess


def make_files(root: Path, n: int, size: int = 2000) -> None:
    rng = np.random.default_rng(1)
    for i in range(n):
        folder = root / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:04d}.bin").write_bytes(rng.integers(0, 256, size + i, dtype=np.uint8).tobytes())


def expected(manifest: Manifest, ids: list[int] | range) -> list[bytes]:
    """What the PFS holds for ``ids``, read the plain way."""
    out = []
    for i in ids:
        loc = manifest.location(i)
        with open(Path(manifest.root) / loc.path, "rb") as f:
            f.seek(loc.offset)
            out.append(f.read(loc.length))
    return out


@pytest.fixture(autouse=True)
def misses_through_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path these tests are about: misses read by the daemon, as a job's
    reads and a client without access to the files take it."""
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")


@pytest.fixture
def dataset_root(tmp_path: Path) -> Path:
    root = tmp_path / "pfs" / "imgs"
    make_files(root, 48)
    return root


@pytest.fixture
def registered(daemon: DaemonProcess, dataset_root: Path) -> Iterator[dq.Client]:
    channel = grpc.insecure_channel(grpc_target(daemon.address), options=channel_options())
    cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="imgs", root=str(dataset_root)))
    channel.close()
    with dq.connect(daemon.address, timeout=5) as client:
        yield client


def test_connect_to_a_dead_socket_fails_fast_and_says_where(
    tmp_path: Path, dataset_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The data is all there on the PFS; without a daemon there is still no
    # manifest to trust, so connecting must fail instead of limping on.
    writer = ManifestWriter(str(dataset_root), "files")
    for path in sorted(dataset_root.rglob("*.bin")):
        rel = path.relative_to(dataset_root).as_posix()
        writer.add_sample(writer.add_path(rel), 0, path.stat().st_size, rel.split("/")[0])
    assert Manifest(writer.to_bytes()).num_samples == 48

    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))  # a socket file nobody listens on
    for address in (str(dead), str(tmp_path / "missing.sock")):
        started = time.monotonic()
        with pytest.raises(dq.DaemonUnavailableError, match=address):
            dq.connect(address, timeout=0.3)
        assert time.monotonic() - started < 5

    monkeypatch.setenv("DATAQUAY_ADDR", str(dead))
    with pytest.raises(dq.DaemonUnavailableError, match="DATAQUAY_ADDR"):
        dq.connect(timeout=0.2)


def test_batches_come_back_in_request_order_and_from_lmdb_once_staged(registered: dq.Client) -> None:
    client = registered
    assert client.info.max_batch > 0 and client.info.cache_path
    assert [d.name for d in client.datasets()] == ["imgs"]

    ds = client.dataset("imgs")
    ids = [47, 0, 5, 5, 13]
    assert len(ds) == 48 and ds.get_batch(ids) == expected(ds.manifest, ids)
    assert client.stats().samples["pfs"] == len(ids)

    with grpc.insecure_channel(grpc_target(client.address)) as channel:
        *_, progress = cache_pb2_grpc.CacheStub(channel).Stage(pb.StageRequest(dataset="imgs"))
    assert progress.finished and not progress.error
    staged = client.dataset("imgs")
    # A sub-db found missing is looked up again after about a second.
    everything: list[bytes] = []

    def all_local() -> bool:
        nonlocal everything
        before = client.stats().samples["local"]
        everything = staged.get_batch(np.arange(48)[::-1])
        assert everything == expected(ds.manifest, range(47, -1, -1))
        return client.stats().samples["local"] - before == 48

    wait_until(all_local, "staged samples came from the local cache", poll=0.1)
    assert staged[-1] == staged[47] and staged[2:5] == everything[45:42:-1]
    assert staged.label(0) == "class0"
    with staged.views([3, 4]) as views:
        assert [bytes(v) for v in views] == expected(ds.manifest, [3, 4])
    assert list(staged) == expected(ds.manifest, range(48))
    assert client.stats().data_wait_seconds > 0

    # A second client, or a pickled copy, shares this process's LMDB handle.
    with dq.connect(client.address) as other:
        assert other.dataset("imgs").get_batch([7]) == expected(ds.manifest, [7])
        assert other.stats().samples["local"] == 1
    copy = pickle.loads(pickle.dumps(staged))
    assert copy.get_batch([8, 9]) == expected(ds.manifest, [8, 9])
    assert copy.client.stats().samples["local"] == 2


def test_bad_ids_and_names_raise_the_errors_module_types(registered: dq.Client) -> None:
    ds = registered.dataset("imgs")
    with pytest.raises(dq.SampleIdError, match=r"index 48 out of range for dataset 'imgs' \(N=48\)"):
        ds[48]
    with pytest.raises(IndexError, match="-49"):
        ds[-49]
    with pytest.raises(dq.SampleIdError, match="sample id 99 out of range"):
        ds.get_batch([1, 99])
    with pytest.raises(TypeError):
        ds.get_batch([1.5])  # type: ignore[list-item]
    with pytest.raises(dq.UnknownDatasetError, match="nope"):
        registered.dataset("nope")
    assert ds.get_batch([]) == []

    lost = ds.manifest.location(40)
    (Path(ds.manifest.root) / lost.path).unlink()
    with pytest.raises(dq.PfsReadError, match=lost.path):
        ds.get_batch([2, 40])
    assert ds.get_batch([2]) == expected(ds.manifest, [2])


def _read_in_child(ds: dq.Dataset, ids: list[int], out: multiprocessing.Queue) -> None:
    out.put(ds.get_batch(ids))


def test_forked_children_get_their_own_connection(registered: dq.Client) -> None:
    ds = registered.dataset("imgs")
    want = expected(ds.manifest, range(10))
    assert ds.get_batch(range(5)) == want[:5]

    pid = os.fork()
    if pid == 0:
        try:
            ok = ds.get_batch(range(10)) == want and sum(registered.stats().samples.values()) == 10
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0

    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    children = [ctx.Process(target=_read_in_child, args=(ds, [i, 9 - i], out)) for i in range(3)]
    for child in children:
        child.start()
    results = sorted(out.get(timeout=30) for _ in children)
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    assert results == sorted([want[i], want[9 - i]] for i in range(3))
    assert ds.get_batch([9, 0]) == [want[9], want[0]]


def test_killed_daemon_is_replaced_by_the_pfs_and_local_hits_keep_coming(
    registered: dq.Client, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    client = registered
    ds = client.dataset("imgs")
    want = expected(ds.manifest, range(48))
    ds.get_batch(range(24))  # the daemon reads and caches these

    def first_half_local() -> bool:
        hits = client.stats().samples["local"]
        ds.get_batch(range(24))
        return client.stats().samples["local"] - hits == 24

    wait_until(first_half_local, "the daemon cached the first half", poll=0.1)

    daemon.kill()
    caplog.set_level(logging.WARNING, logger="dataquay.client")
    before = client.stats()
    assert ds.get_batch(np.arange(48)[::-1]) == want[::-1]
    assert ds.get_batch(range(48)) == want
    after = client.stats()
    assert after.samples["local"] - before.samples["local"] == 48
    assert after.samples["fallback"] - before.samples["fallback"] == 48
    assert after.samples["pfs"] == before.samples["pfs"]
    warnings = [r for r in caplog.records if r.name == "dataquay.client"]
    assert len(warnings) == 1 and daemon.address in warnings[0].getMessage()
    with pytest.raises(dq.DaemonUnavailableError):
        client.dataset("imgs")


def _read_misses(ds: dq.Dataset, ids: list[int]) -> None:
    assert ds.get_batch(ids) == expected(ds.manifest, ids)


def test_workers_that_find_the_daemon_dead_warn_once_between_them(
    registered: dq.Client, daemon: DaemonProcess, client_warnings: Path
) -> None:
    ds = registered.dataset("imgs")
    daemon.kill()
    ctx = multiprocessing.get_context("fork")
    for _ in range(2):  # new workers every epoch, as a DataLoader starts them
        workers = [ctx.Process(target=_read_misses, args=(ds, list(range(k, 48, 3)))) for k in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
            assert w.exitcode == 0
    warnings = client_warnings.read_text().splitlines()
    assert len(warnings) == 1 and daemon.address in warnings[0], warnings


def test_a_stopped_daemon_is_read_around_after_the_batch_deadline_then_used_again(
    registered: dq.Client, daemon: DaemonProcess
) -> None:
    # A hung daemon (SIGSTOP, swapping) keeps its socket: only a deadline
    # tells it from a slow one. The batch's deadline is seconds, not minutes.
    client = registered
    ds = client.dataset("imgs")
    want = expected(ds.manifest, range(48))
    assert ds.get_batch(range(8)) == want[:8]
    assert daemon.process is not None
    with stopped(daemon.process.pid, daemon.cache_dir):
        before = client.stats().samples
        assert ds.get_batch(range(24, 48)) == want[24:]
        after = client.stats().samples
        assert after["fallback"] - before["fallback"] == 24 and after["pfs"] == before["pfs"]
        assert client.remote.daemon_down
        # Later batches go straight to the PFS, without waiting out a deadline each.
        assert ds.get_batch(range(8, 24)) == want[8:24]
        assert client.stats().samples["fallback"] - after["fallback"] == 16

    def through_the_daemon() -> bool:
        fallback = client.stats().samples["fallback"]
        assert ds.get_batch(range(24, 48)) == want[24:]
        return client.stats().samples["fallback"] == fallback

    wait_until(through_the_daemon, "reads go through the daemon again after SIGCONT", poll=0.2)


def test_fork_while_other_threads_are_calling_the_daemon(registered: dq.Client) -> None:
    # gRPC's core breaks a child forked in the middle of a call; the client
    # makes the fork wait for its calls in flight.
    ds = registered.dataset("imgs")
    want = expected(ds.manifest, range(6))
    stop = threading.Event()
    errors: list[Exception] = []

    def call_repeatedly() -> None:
        while not stop.is_set():
            try:
                registered.datasets()
            except Exception as exc:  # reported by the assertion below
                errors.append(exc)

    threads = [threading.Thread(target=call_repeatedly) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(25):
            pid = os.fork()
            if pid == 0:
                try:
                    ok = len(registered.datasets()) == 1 and ds.get_batch(range(6)) == want
                finally:
                    os._exit(0 if ok else 1)
            assert os.waitpid(pid, 0)[1] == 0
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors


def test_torch_adapters_need_torch() -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed")
    with pytest.raises(ImportError, match=re.escape("pip install torch")):
        importlib.import_module("dataquay.client.torch")
