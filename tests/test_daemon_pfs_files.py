"""The daemon against PFS files that stop behaving after registration: a FIFO
in a sample's place, a read that never returns, a file that changed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from one_daemon import add, cache_stub, files_bytes
from polling import wait_until

import dataquay.client as dq
from dataquay.client.errors import PfsReadError
from dataquay.client.manifest import Manifest
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.manifest_build import build_manifest
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SIZES = (3000,)
#: A deadline for calls that, unfixed, would wait on a parked thread forever.
CALL_DEADLINE = 60.0


def test_a_fifo_in_a_samples_place_fails_its_read_by_name_and_the_daemon_serves_on_and_stops(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon("--pfs-threads", "2")
    root = synthetic.make_files_dataset(tmp_path / "imgs", 20, sizes=SIZES, classes=2, seed=1)
    add(daemon, "imgs", root)
    manifest = Manifest(build_manifest(root).to_bytes())
    fifo = root / manifest.location(7).path
    fifo.unlink()
    os.mkfifo(fifo)

    with cache_stub(daemon) as stub:
        for _ in range(4):  # more reads than PFS threads: none of them stays parked
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Read(pb.ReadRequest(dataset="imgs", ids=[6, 7]), timeout=CALL_DEADLINE))
            assert caught.value.code() == grpc.StatusCode.DATA_LOSS
            assert f"sample 7 of 'imgs': cannot read {fifo}: is a FIFO (refused)" in str(caught.value.details())
    with dq.connect(daemon.address, timeout=5) as client:
        ds = client.dataset("imgs")
        with pytest.raises(PfsReadError, match="is a FIFO"):
            ds.get_batch([7])
        others = [i for i in range(20) if i != 7]
        assert ds.get_batch(others) == files_bytes(1, others, SIZES)
    assert daemon.stop(timeout=CALL_DEADLINE) == 0, daemon.log_tail()


#: A process whose only PFS read never returns: the pool's wait gives up
#: after its timeout, and the process still exits.
STUCK_READ = """
import asyncio, sys, threading
import numpy as np
from dataquay.client.errors import PfsReadError
from dataquay.client.manifest import Manifest
from dataquay.client.pfs import PfsReader
from dataquay.server.manifest_build import build_manifest
from dataquay.server.node.reads.pfs import PfsPool

PfsReader.read_range = lambda self, r: threading.Event().wait()  # an NFS server that never answers
pool = PfsPool(threads=2, read_timeout=0.2)
manifest = Manifest(build_manifest(sys.argv[1]).to_bytes())
try:
    asyncio.run(pool.read("imgs", manifest, np.array([3, 4])))
except PfsReadError as exc:
    print(exc, flush=True)
pool.close()
"""


def test_a_pfs_read_that_never_returns_fails_its_batch_and_does_not_hold_the_exit(tmp_path: Path) -> None:
    root = synthetic.make_files_dataset(tmp_path / "imgs", 8, sizes=SIZES, classes=1)
    done = subprocess.run(
        [sys.executable, "-c", STUCK_READ, str(root)], capture_output=True, text=True, timeout=CALL_DEADLINE
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "PFS reads of 'imgs' (from sample 3) made no progress in 0.2 s (--pfs-read-timeout): "
        "the file system does not answer\n"
    )


def changed_message(name: str, sample_id: int, path: Path, root: Path, change: str) -> str:
    """What a read of a file that changed since registration says."""
    return (
        f"sample {sample_id} of {name!r}: cannot read {path}: it changed since the dataset was registered "
        f"({change}); `dataquay dataset add {name} {os.path.realpath(root)} --replace` takes the new content"
    )


def read_bytes(stub: cache_pb2_grpc.CacheStub, name: str, ids: list[int]) -> list[bytes]:
    reply = stub.Read(pb.ReadRequest(dataset=name, ids=ids), timeout=CALL_DEADLINE)
    return [s.data for chunk in reply for s in chunk.samples]


def read_error(stub: cache_pb2_grpc.CacheStub, name: str, ids: list[int]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Read(pb.ReadRequest(dataset=name, ids=ids), timeout=CALL_DEADLINE))
    return caught.value


def test_a_file_changed_after_registration_fails_its_reads_and_staging_by_name_until_replaced(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
    root = synthetic.make_files_dataset(tmp_path / "imgs", 20, sizes=SIZES, classes=2, seed=1)
    add(daemon, "imgs", root)
    manifest = Manifest(build_manifest(root).to_bytes())
    grown, touched = (root / manifest.location(i).path for i in (7, 12))
    with grown.open("ab") as fh:
        fh.write(b"appended after registration")
    mtime_ns = touched.stat().st_mtime_ns
    os.utime(touched, ns=(mtime_ns, mtime_ns + 1_000_000_000))

    with cache_stub(daemon) as stub:
        err = read_error(stub, "imgs", [6, 7])
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert changed_message("imgs", 7, grown, root, f"size {SIZES[0] + 27}, registered {SIZES[0]}") == err.details()
        err = read_error(stub, "imgs", [12])
        assert err.code() == grpc.StatusCode.DATA_LOSS
        change = f"mtime {mtime_ns + 1_000_000_000} ns, registered {mtime_ns} ns"
        assert changed_message("imgs", 12, touched, root, change) == err.details()
        *_, progress = stub.Stage(pb.StageRequest(dataset="imgs"), timeout=CALL_DEADLINE)
        assert progress.finished and progress.failed_samples == 2
        assert "changed since the dataset was registered" in progress.first_failure
    others = [i for i in range(20) if i not in (7, 12)]
    with dq.connect(daemon.address, timeout=5) as client:
        ds = client.dataset("imgs")
        assert ds.get_batch(others) == files_bytes(1, others, SIZES)
        with pytest.raises(PfsReadError, match="changed since the dataset was registered"):
            ds.get_batch([7])

    add(daemon, "imgs", root, replace=True)
    with dq.connect(daemon.address, timeout=5) as client:
        ds = client.dataset("imgs")
        wait_until(
            lambda: ds.get_batch([7, 12]) == [grown.read_bytes(), touched.read_bytes()],
            "the replaced dataset serves the new content",
        )


@pytest.mark.parametrize("fmt", ["tar", "npy"])
def test_a_shard_changed_after_registration_fails_the_reads_of_its_samples_only(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, fmt: str
) -> None:
    daemon = start_daemon()
    if fmt == "tar":
        root = synthetic.make_tar_dataset(tmp_path / fmt, 20, samples_per_shard=10, sizes=SIZES)
    else:
        root = synthetic.make_npy_dataset(tmp_path / fmt, 20, record_shape=(16,), files=2)
    add(daemon, fmt, root)
    manifest = Manifest(build_manifest(root).to_bytes())
    shard = root / manifest.path(1)
    with cache_stub(daemon) as stub:
        before = read_bytes(stub, fmt, list(range(10)))
        size = shard.stat().st_size
        with shard.open("ab") as fh:
            fh.write(b"\0" * 512)
        for sample in (10, 19):
            err = read_error(stub, fmt, [sample])
            assert err.code() == grpc.StatusCode.DATA_LOSS
            assert changed_message(fmt, sample, shard, root, f"size {size + 512}, registered {size}") == err.details()
        assert read_bytes(stub, fmt, list(range(10))) == before
