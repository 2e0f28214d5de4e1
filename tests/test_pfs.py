"""Planning and reading samples from real files on the PFS."""

from __future__ import annotations

import itertools
import os
import re
import socket
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tar_shards import write_tar

from dataquay.client.errors import ManifestError, PfsReadError, SampleIdError
from dataquay.client.manifest import Manifest, ManifestWriter
from dataquay.client.pfs import PfsRangeError, PfsReader, ReadRange, plan_reads
from dataquay.client.wire.records import frame_members
from dataquay.server.manifest_build import build_manifest
from dataquay.server.tools.synthetic import make_files_dataset, make_npy_dataset, make_tar_dataset, sample_bytes

WEBDATASET_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def manifest_of(root: Path, fmt: str | None = None, **kwargs: bool) -> Manifest:
    return Manifest(build_manifest(root, fmt, **kwargs).to_bytes())


def unrecorded(data: bytes) -> bytes:
    """``data`` with every file's size and mtime -1, "not recorded", as in a manifest written by hand."""
    out = bytearray(data)
    for name in ("path_size", "path_mtime_ns"):
        offset, count = Manifest(data).header["arrays"][name]
        out[offset : offset + 8 * count] = b"\xff" * (8 * count)
    return bytes(out)


def read_all(m: Manifest, name: str = "ds") -> list[bytes]:
    return PfsReader(m, name).read(np.arange(m.num_samples))


def test_files_round_trip(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 60, sizes=(0, 1, 4096, 70_000), classes=3, seed=7)
    m = manifest_of(tmp_path)
    got = read_all(m)
    for i in range(m.num_samples):
        with open(tmp_path / m.location(i).path, "rb") as fh:
            assert got[i] == fh.read()
        assert got[i] == sample_bytes(7, i, (0, 1, 4096, 70_000)[i % 4])


def test_grouped_tar_round_trip_matches_tarfile_extraction(tmp_path: Path) -> None:
    make_tar_dataset(tmp_path / "shards", 25, samples_per_shard=10, sizes=(10, 5000))
    long_name = "deep/" + "x" * 120
    write_tar(
        tmp_path / "shards/zz_odd.tar",
        [
            ("deep/", None),
            (f"{long_name}.jpg", b"J" * 513),
            ("deep/NOTES", b"not a sample member"),
            (f"{long_name}.seg.png", b"P" * 7),
            ("y.cls", b""),
        ],
    )
    m = manifest_of(tmp_path)
    assert m.num_samples == 27
    expected = []
    for shard in sorted((tmp_path / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            key: str | None = None
            members: list[tuple[str, bytes]] = []
            for info in tar.getmembers():
                match = WEBDATASET_KEY.match(info.name)
                if not info.isreg() or match is None:
                    continue
                if match.group(1) != key and members:
                    expected.append(frame_members(members))
                    members = []
                key = match.group(1)
                extracted = tar.extractfile(info)
                assert extracted is not None
                members.append((match.group(2), extracted.read()))
            expected.append(frame_members(members))
    assert read_all(m) == expected
    assert expected[25] == frame_members([("jpg", b"J" * 513), ("seg.png", b"P" * 7)])


def test_tar_member_mode_round_trip(tmp_path: Path) -> None:
    make_tar_dataset(tmp_path, 12, samples_per_shard=5, sizes=(3, 700), seed=3)
    m = manifest_of(tmp_path, tar_grouped=False)
    expected = []
    for shard in sorted(tmp_path.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                extracted = tar.extractfile(info)
                assert extracted is not None
                expected.append(extracted.read())
    assert read_all(m) == expected


def test_npy_round_trip(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 1001, record_shape=(3, 5), dtype="float64", files=3)
    m = manifest_of(tmp_path)
    records = np.concatenate([np.load(p) for p in sorted(tmp_path.glob("*.npy"))])
    assert read_all(m) == [r.tobytes() for r in records]
    decoded = np.frombuffer(read_all(m)[17], dtype=m.header["npy_dtype"])
    decoded = decoded.reshape(m.header["npy_shape"])
    np.testing.assert_array_equal(decoded, records[17])


def test_read_keeps_request_order_and_repeats(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 100, record_shape=(4,), files=2)
    m = manifest_of(tmp_path)
    everything = read_all(m)
    ids = [99, 3, 3, 50, 0, 99]
    assert PfsReader(m, "ds").read(ids) == [everything[i] for i in ids]
    assert PfsReader(m, "ds").read([]) == []


def test_read_range_returns_every_planned_id(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 64, record_shape=(16,), files=1)
    m = manifest_of(tmp_path)
    (whole,) = plan_reads(m, np.arange(64))
    got = PfsReader(m, "ds").read_range(whole)
    assert sorted(got) == list(range(64))


def test_out_of_range_ids_are_refused(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 10, files=1)
    m = manifest_of(tmp_path)
    with pytest.raises(SampleIdError, match=r"sample 10 not in manifest \(N=10\)"):
        PfsReader(m, "ds").read([3, 10])
    with pytest.raises(SampleIdError, match="sample -1"):
        plan_reads(m, np.array([-1]))


def test_deleted_file_names_dataset_id_and_path(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 6, classes=2)
    m = manifest_of(tmp_path)
    gone = tmp_path / m.location(4).path
    gone.unlink()
    with pytest.raises(PfsReadError) as caught:
        PfsReader(m, "imnet").read([1, 4])
    assert str(caught.value) == (f"sample 4 of 'imnet': cannot read {gone}: No such file or directory")
    assert isinstance(caught.value, PfsRangeError)
    assert caught.value.sample_ids == (4,)


def test_truncated_file_of_an_unrecorded_size_is_an_error_naming_the_first_short_sample(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 10, record_shape=(25,), dtype="uint8", files=1)
    m = Manifest(unrecorded(build_manifest(tmp_path).to_bytes()))
    path = tmp_path / "part_00000.npy"
    os.truncate(path, path.stat().st_size - 30)
    (whole,) = plan_reads(m, np.arange(10))
    with pytest.raises(PfsRangeError) as caught:
        PfsReader(m, "sim").read_range(whole)
    start = int(m.sample_offset[0])
    assert str(caught.value) == (
        f"sample 8 of 'sim': cannot read {path}: truncated: expected 250 bytes at offset {start}, got 220"
    )
    assert caught.value.sample_ids == tuple(range(10))
    assert PfsReader(m, "sim").read([0, 7])


def test_file_replaced_by_a_folder_is_an_error(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 3, classes=1)
    m = manifest_of(tmp_path)
    victim = tmp_path / m.location(2).path
    victim.unlink()
    victim.mkdir()
    with pytest.raises(PfsReadError, match=f"sample 2 of 'ds': cannot read {victim}: is a directory \\(refused\\)"):
        PfsReader(m, "ds").read([0, 2])


def test_file_replaced_by_a_fifo_or_a_socket_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 3, classes=1)
    m = manifest_of(tmp_path)
    fifo, sock = (tmp_path / m.location(i).path for i in (1, 2))
    fifo.unlink()
    os.mkfifo(fifo)
    sock.unlink()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(sock))
        with pytest.raises(PfsReadError) as caught:
            PfsReader(m, "ds").read([0, 1])
        assert str(caught.value) == f"sample 1 of 'ds': cannot read {fifo}: is a FIFO (refused)"
        with pytest.raises(PfsReadError, match=f"sample 2 of 'ds': cannot read {sock}: is a socket"):
            PfsReader(m, "ds").read([2])
    assert PfsReader(m, "ds").read([0]) == [(tmp_path / m.location(0).path).read_bytes()]


def test_file_replaced_by_a_symlink_is_refused(tmp_path: Path) -> None:
    make_files_dataset(tmp_path / "root", 2, classes=1)
    m = manifest_of(tmp_path / "root")
    victim = tmp_path / "root" / m.location(0).path
    victim.unlink()
    (tmp_path / "secret").write_bytes(b"s" * 4096)
    victim.symlink_to(tmp_path / "secret")
    with pytest.raises(PfsReadError, match="sample 0 of 'ds': .* is a symbolic link"):
        PfsReader(m, "ds").read([0])


def test_a_folder_swapped_for_a_link_out_of_the_root_is_refused(tmp_path: Path) -> None:
    make_files_dataset(tmp_path / "root", 2, classes=1)
    m = manifest_of(tmp_path / "root")
    folder = (tmp_path / "root" / m.location(0).path).parent
    outside = tmp_path / "outside"
    folder.rename(outside)
    folder.symlink_to(outside)
    outside_root = f"sample 0 of 'ds': .* resolves to {outside}/.*, outside the dataset's root"
    with pytest.raises(PfsReadError, match=outside_root):
        PfsReader(m, "ds").read([0])


def test_crafted_path_leaving_the_root_is_refused(tmp_path: Path) -> None:
    writer = ManifestWriter(str(tmp_path), "files")
    writer.add_sample(writer.add_path("ab/passwd"), 0, 10)
    m = Manifest(writer.to_bytes().replace(b"ab/passwd", b"../passwd"))
    with pytest.raises(ManifestError, match="leaves or re-enters its root"):
        m.path(0)
    with pytest.raises(ManifestError, match="leaves or re-enters its root"):
        PfsReader(m, "ds").read([0])


def test_adjacent_records_merge_and_large_requests_split(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 5000, record_shape=(256,), dtype="uint8", files=2)
    m = manifest_of(tmp_path)
    assert len(plan_reads(m, np.arange(2500))) == 1
    ranges = plan_reads(m, np.arange(5000), max_range_bytes=100_000)
    assert [len(r.ids) for r in ranges] == [390, 390, 390, 390, 390, 390, 160] * 2
    # Every other record: each hole is one record, no larger than the record after it.
    assert len(plan_reads(m, np.arange(0, 2500, 2))) == 1
    assert len(plan_reads(m, np.arange(0, 2500, 2), max_gap=255)) == 1250
    # Every tenth (a node's share of a shard in mode global on 10 nodes): a
    # hole of 9 records is not read, however large max_gap.
    sparse = plan_reads(m, np.arange(0, 2500, 10), max_gap=10 * 256)
    assert len(sparse) == 250 and sum(r.length for r in sparse) == 250 * 256


def manifest_from(layout: list[tuple[int, int, int]], num_paths: int) -> Manifest:
    writer = ManifestWriter("/nonexistent", "files")
    for p in range(num_paths):
        writer.add_path(f"f{p}")
    for path, offset, length in layout:
        writer.add_sample(path, offset, length)
    return Manifest(writer.to_bytes())


def check_plan(m: Manifest, ids: list[int], ranges: list[ReadRange], max_range_bytes: int) -> None:
    planned = np.concatenate([r.ids for r in ranges]) if ranges else np.array([], dtype=np.int64)
    assert sorted(planned.tolist()) == sorted(set(ids))
    for r in ranges:
        assert r.length <= max_range_bytes or len(r.ids) == 1
        assert set(m.sample_path[r.ids].tolist()) == {r.path_index}
        starts = m.sample_offset[r.ids].astype(np.int64)
        ends = starts + m.sample_length[r.ids].astype(np.int64)
        assert starts.min() == r.offset and ends.max() == r.offset + r.length
        assert np.all(np.diff(starts) >= 0)


sizes = st.integers(0, 5000)
limits = {"max_range_bytes": st.integers(1, 20_000), "max_gap": st.integers(0, 3000)}


@settings(max_examples=100)
@given(
    layout=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50_000), sizes), min_size=1, max_size=60),
    picks=st.lists(st.integers(0, 10**6), max_size=80),
    max_range_bytes=limits["max_range_bytes"],
    max_gap=limits["max_gap"],
)
def test_plan_covers_each_id_once_within_limits_for_any_layout(
    layout: list[tuple[int, int, int]], picks: list[int], max_range_bytes: int, max_gap: int
) -> None:
    m = manifest_from(layout, 3)
    ids = [p % len(layout) for p in picks]
    ranges = plan_reads(m, np.array(ids, dtype=np.int64), max_range_bytes=max_range_bytes, max_gap=max_gap)
    check_plan(m, ids, ranges, max_range_bytes)


@settings(max_examples=100)
@given(
    files=st.lists(
        st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 5000)), min_size=1, max_size=30), min_size=1, max_size=3
    ),
    data=st.data(),
    max_range_bytes=limits["max_range_bytes"],
    max_gap=limits["max_gap"],
)
def test_plan_merges_every_neighbour_it_may(
    files: list[list[tuple[int, int]]], data: st.DataObject, max_range_bytes: int, max_gap: int
) -> None:
    layout = []
    for path, samples in enumerate(files):
        pos = 0
        for gap, length in samples:
            layout.append((path, pos + gap, length))
            pos += gap + length
    layout = data.draw(st.permutations(layout))
    m = manifest_from(layout, len(files))
    ids = data.draw(st.lists(st.integers(0, len(layout) - 1), max_size=80))
    ranges = plan_reads(m, ids, max_range_bytes=max_range_bytes, max_gap=max_gap)
    check_plan(m, ids, ranges, max_range_bytes)
    for r in ranges:
        starts = m.sample_offset[r.ids].astype(np.int64)
        ends = starts + m.sample_length[r.ids].astype(np.int64)
        assert np.all(starts[1:] - ends[:-1] <= np.minimum(max_gap, m.sample_length[r.ids[1:]]))
        assert r.length <= 2 * int(m.sample_length[r.ids].sum())
    for a, b in itertools.pairwise(ranges):
        if a.path_index != b.path_index:
            continue
        gap = b.offset - (a.offset + a.length)
        first_of_b = int(m.sample_length[b.ids[0]])
        assert gap >= 0
        assert gap > min(max_gap, first_of_b) or b.offset + first_of_b - a.offset > max_range_bytes


def test_a_file_changed_since_registration_is_refused_naming_the_change(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 10, record_shape=(25,), dtype="uint8", files=1)
    m = manifest_of(tmp_path)
    path = tmp_path / "part_00000.npy"
    size = path.stat().st_size
    os.truncate(path, size - 30)
    with pytest.raises(PfsRangeError) as caught:
        PfsReader(m, "sim").read([0])
    assert str(caught.value) == (
        f"sample 0 of 'sim': cannot read {path}: it changed since the dataset was registered "
        f"(size {size - 30}, registered {size}); `dataquay dataset add sim {m.root} --replace` takes the new content"
    )


def test_a_manifest_of_an_unknown_version_is_refused(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 2, sizes=(10,), classes=1)
    data = build_manifest(tmp_path).to_bytes().replace(b'"version": 2', b'"version": 3', 1)
    with pytest.raises(ManifestError, match="manifest version 3 is not one this dataquay reads"):
        Manifest(data)
