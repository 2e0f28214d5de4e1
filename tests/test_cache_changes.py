"""A dataset changed on the PFS and registered again (dataset add --replace):
the cache keeps every sample whose file's path, size and mtime and whose
place in it are the same, appended files get ids after the old ones, removed
files are dropped, and staging reads only what changed. A reader still on the
old version is told it was replaced, never served a mix; the same files under
two names are cached once."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from one_daemon import add, cache_stub, cached_samples, daemon_stats, reply_samples

from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

SIZE = 4096
SAMPLES = 40


def stage(daemon: DaemonProcess, name: str) -> pb.StageProgress:
    with cache_stub(daemon) as stub:
        *_, last = stub.Stage(pb.StageRequest(dataset=name))
    assert last.finished and not last.error, last.error
    return last


def read(daemon: DaemonProcess, name: str, ids: list[int], manifest_id: str = "") -> list[bytes]:
    request = pb.ReadRequest(dataset=name, ids=ids, manifest_id=manifest_id)
    with cache_stub(daemon) as stub:
        return [s.data for s in reply_samples(stub.Read(request))]


def test_a_one_file_change_restages_one_file_and_an_appended_one_goes_last(
    tmp_path: Path, daemon: DaemonProcess
) -> None:
    root = make_files_dataset(tmp_path / "pfs" / "imgs", SAMPLES, sizes=(SIZE,), classes=2)
    old = add(daemon, "imgs", root)
    assert stage(daemon, "imgs").read_bytes == SAMPLES * SIZE
    files = sorted(root.rglob("*.bin"))
    before = [f.read_bytes() for f in files]

    changed, removed = files[3], files[10]
    changed.write_bytes(b"c" * SIZE)
    os.utime(changed, ns=(10**18, 10**18))
    removed.unlink()
    appended = root / "class_000" / "00000000-new.bin"  # walked early, numbered last
    appended.write_bytes(b"a" * 1000)
    new = add(daemon, "imgs", root, replace=True)
    assert new.num_samples == SAMPLES and cached_samples(daemon, "imgs") == SAMPLES - 2

    last = stage(daemon, "imgs")
    assert (last.skipped_samples, last.read_bytes) == (SAMPLES - 2, SIZE + 1000)
    assert daemon_stats(daemon).pfs_bytes == SAMPLES * SIZE + SIZE + 1000
    expected = [*before[:3], b"c" * SIZE, *before[4:10], *before[11:], b"a" * 1000]
    assert read(daemon, "imgs", list(range(SAMPLES))) == expected

    with pytest.raises(grpc.RpcError) as refused:
        read(daemon, "imgs", [0], manifest_id=old.manifest_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "replaced" in refused.value.details()


def test_the_same_files_under_two_names_are_cached_once(tmp_path: Path, daemon: DaemonProcess) -> None:
    root = make_files_dataset(tmp_path / "pfs" / "imgs", SAMPLES, sizes=(SIZE,), classes=2)
    add(daemon, "imgs", root)
    add(daemon, "imgs-too", root)
    stage(daemon, "imgs")
    assert stage(daemon, "imgs-too").read_bytes == 0
    assert daemon_stats(daemon).cache_entries == SAMPLES
    with cache_stub(daemon) as stub:
        assert stub.DropDataset(pb.DropDatasetRequest(name="imgs")).freed_samples == 0
    assert cached_samples(daemon, "imgs-too") == SAMPLES
    assert read(daemon, "imgs-too", [0, 39]) == [p.read_bytes() for p in sorted(root.rglob("*.bin"))[::39]]
