"""Building manifests from real trees: id order, labels, formats, refusals."""

from __future__ import annotations

import os
import tarfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from tar_shards import write_tar

from dataquay.client.errors import ManifestError
from dataquay.client.manifest import Manifest, ManifestWriter
from dataquay.server.manifest_build import build_manifest, detect_format
from dataquay.server.tools.synthetic import make_files_dataset, make_npy_dataset, make_tar_dataset


def manifest_of(root: Path, fmt: str | None = None, **kwargs: bool) -> Manifest:
    return Manifest(build_manifest(root, fmt, **kwargs).to_bytes())


def paths_of(m: Manifest) -> list[str]:
    return [m.location(i).path for i in range(m.num_samples)]


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_ids_follow_depth_first_walk_in_name_byte_order(tmp_path: Path) -> None:
    shuffled = ["a0.bin", "é.bin", "a.bin", "a/y.bin", "a/sub/z.bin", "a/x.bin", "_c.bin", "Z.bin"]
    for rel in [*shuffled, "B.bin"]:
        touch(tmp_path / rel)
    assert paths_of(manifest_of(tmp_path)) == [
        "B.bin",
        "Z.bin",
        "_c.bin",
        "a/sub/z.bin",
        "a/x.bin",
        "a/y.bin",
        "a.bin",
        "a0.bin",
        "é.bin",
    ]


def test_rebuilding_the_same_tree_gives_the_same_ids(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 50, sizes=(10, 20, 30), classes=3)
    first, second = manifest_of(tmp_path), manifest_of(tmp_path)
    for name in ("sample_path", "sample_offset", "sample_length", "sample_label"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    assert paths_of(first) == paths_of(second)


def test_synthetic_files_keep_their_ids_and_classes(tmp_path: Path) -> None:
    make_files_dataset(tmp_path, 40, sizes=(7, 9), classes=4)
    m = manifest_of(tmp_path)
    assert m.format == "files"
    assert paths_of(m) == [f"class_{i // 10:03d}/{i:08d}.bin" for i in range(40)]
    assert [m.label(i) for i in range(40)] == [f"class_{i // 10:03d}" for i in range(40)]
    assert m.sample_length.tolist() == [7, 9] * 20
    assert m.sample_offset.tolist() == [0] * 40


def test_labels_are_the_parent_folder_or_none_at_the_root(tmp_path: Path) -> None:
    touch(tmp_path / "top.bin")
    touch(tmp_path / "a/b/deep.bin")
    m = manifest_of(tmp_path)
    assert {m.location(i).path: m.label(i) for i in range(2)} == {"a/b/deep.bin": "a/b", "top.bin": None}


def test_hidden_entries_and_special_files_are_skipped(tmp_path: Path) -> None:
    touch(tmp_path / "cls/img.jpg")
    touch(tmp_path / "cls/.DS_Store")
    touch(tmp_path / "cls/._img.jpg")
    touch(tmp_path / ".git/objects/ab")
    os.mkfifo(tmp_path / "cls/pipe")
    assert paths_of(manifest_of(tmp_path)) == ["cls/img.jpg"]


def test_root_is_stored_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    touch(tmp_path / "data/a.bin")
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert manifest_of(Path("alias")).root == os.path.realpath(tmp_path / "data")


def test_symlinks_inside_the_root_store_their_target(tmp_path: Path) -> None:
    touch(tmp_path / "store/x.bin", b"xx")
    touch(tmp_path / "store/sub/y.bin", b"yyy")
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat/link.bin").symlink_to("../store/x.bin")
    (tmp_path / "dog").symlink_to("store/sub")
    m = manifest_of(tmp_path)
    rows = [(m.location(i).path, m.location(i).length, m.label(i)) for i in range(m.num_samples)]
    assert rows == [
        ("store/x.bin", 2, "cat"),
        ("store/sub/y.bin", 3, "dog"),
        ("store/sub/y.bin", 3, "store/sub"),
        ("store/x.bin", 2, "store"),
    ]


@pytest.mark.parametrize("target_is_dir", [False, True])
def test_symlink_escaping_the_root_is_rejected(tmp_path: Path, target_is_dir: bool) -> None:
    outside = touch(tmp_path / "outside/secret")
    root = tmp_path / "root"
    touch(root / "ok.bin")
    (root / "leak").symlink_to(outside.parent if target_is_dir else outside)
    with pytest.raises(ManifestError, match="leak resolves outside the root"):
        build_manifest(root)


def test_dangling_and_looping_symlinks_are_rejected(tmp_path: Path) -> None:
    touch(tmp_path / "a/ok.bin")
    (tmp_path / "a/loop").symlink_to("..")
    with pytest.raises(ManifestError, match="loops back"):
        build_manifest(tmp_path)
    (tmp_path / "a/loop").unlink()
    (tmp_path / "a/gone").symlink_to("missing.bin")
    with pytest.raises(ManifestError, match="gone is broken"):
        build_manifest(tmp_path)


def test_missing_root_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        build_manifest(tmp_path / "nope")


def test_root_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="is not a directory"):
        build_manifest(touch(tmp_path / "file"))


def test_root_without_samples_is_rejected(tmp_path: Path) -> None:
    touch(tmp_path / ".hidden")
    (tmp_path / "empty_dir").mkdir()
    for fmt in (None, "files"):
        with pytest.raises(ManifestError, match="no samples under"):
            build_manifest(tmp_path, fmt)


def test_explicit_format_without_matching_files_is_rejected(tmp_path: Path) -> None:
    touch(tmp_path / "a.jpg")
    with pytest.raises(ManifestError, match=r"no \.npy files under"):
        build_manifest(tmp_path, "npy")
    with pytest.raises(ManifestError, match=r"no \.tar files under"):
        build_manifest(tmp_path, "tar")
    with pytest.raises(ManifestError, match="unknown format 'zip'"):
        build_manifest(tmp_path, "zip")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_rejected_by_name(tmp_path: Path) -> None:
    locked = touch(tmp_path / "cls/locked.jpg")
    locked.chmod(0)
    with pytest.raises(ManifestError, match="cannot read .*locked.jpg"):
        build_manifest(tmp_path)


def test_file_name_that_is_not_utf8_is_rejected(tmp_path: Path) -> None:
    touch(Path(os.fsdecode(bytes(tmp_path) + b"/bad\xff.bin")))
    with pytest.raises(ManifestError, match="not UTF-8"):
        build_manifest(tmp_path)


def test_detect_format(tmp_path: Path) -> None:
    make_tar_dataset(tmp_path / "tar/shards", 3, samples_per_shard=2)
    make_npy_dataset(tmp_path / "npy", 4)
    make_files_dataset(tmp_path / "files", 4)
    touch(tmp_path / "mixed/a.tar")
    touch(tmp_path / "mixed/b.npy")
    expected = {"tar": "tar", "npy": "npy", "files": "files", "mixed": "files"}
    assert {name: detect_format(tmp_path / name) for name in expected} == expected
    assert manifest_of(tmp_path / "tar").format == "tar"


def test_grouped_tar_samples_span_header_to_last_data(tmp_path: Path) -> None:
    make_tar_dataset(tmp_path, 5, samples_per_shard=2, sizes=(100, 1000))
    m = manifest_of(tmp_path)
    assert m.format == "tar" and m.tar_grouped
    assert paths_of(m) == ["shard_000000.tar"] * 2 + ["shard_000001.tar"] * 2 + ["shard_000002.tar"]
    expected = []
    for shard in sorted(tmp_path.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = tar.getmembers()
        for first, last in zip(members[::2], members[1::2]):
            expected.append((first.offset, last.offset_data + last.size - first.offset))
    assert list(zip(m.sample_offset.tolist(), m.sample_length.tolist())) == expected


def test_tar_member_mode_makes_one_sample_per_regular_member(tmp_path: Path) -> None:
    members = [("d/", None), ("d/a.jpg", b"A" * 3), ("README", b"hi"), ("d/a.cls", b"1")]
    write_tar(tmp_path / "s.tar", members)
    m = manifest_of(tmp_path, tar_grouped=False)
    assert not m.tar_grouped
    with tarfile.open(tmp_path / "s.tar") as tar:
        regular = [(t.offset_data, t.size) for t in tar.getmembers() if t.isreg()]
    assert list(zip(m.sample_offset.tolist(), m.sample_length.tolist())) == regular


def test_grouped_tar_skips_members_without_a_key(tmp_path: Path) -> None:
    members: list[tuple[str, bytes | None]] = [("README", b"hi"), ("a.jpg", b"A"), ("a.cls", b"1"), ("b.jpg", b"B")]
    write_tar(tmp_path / "s.tar", members)
    assert manifest_of(tmp_path).num_samples == 2


def test_repeated_member_in_a_tar_sample_is_rejected(tmp_path: Path) -> None:
    write_tar(tmp_path / "s.tar", [("a.jpg", b"1"), ("a.jpg", b"2")])
    with pytest.raises(ManifestError, match="'a.jpg' repeats in sample 'a'"):
        build_manifest(tmp_path)


def test_tar_garbage_is_rejected_by_name(tmp_path: Path) -> None:
    make_tar_dataset(tmp_path, 2)
    touch(tmp_path / "zz_bad.tar", np.random.default_rng(0).bytes(5000))
    with pytest.raises(ManifestError, match="zz_bad.tar"):
        build_manifest(tmp_path)


def test_tar_with_trailing_garbage_is_rejected(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", b"A" * 600)])
    raw = shard.read_bytes()
    shard.write_bytes(raw[:1536] + b"garbage!" * 64 + raw[2048:])
    with pytest.raises(ManifestError, match="s.tar: no valid tar header at offset 1536"):
        build_manifest(tmp_path)


def test_truncated_tar_is_rejected(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "s.tar", [("a.jpg", b"A" * 600), ("b.jpg", b"B" * 5000)])
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(ManifestError, match="s.tar"):
        build_manifest(tmp_path)


def test_npy_records_follow_file_order(tmp_path: Path) -> None:
    np.save(tmp_path / "b.npy", np.zeros((3, 2, 5), dtype="<i2"))
    np.save(tmp_path / "a.npy", np.zeros((2, 2, 5), dtype="<i2"))
    m = manifest_of(tmp_path)
    assert (m.format, m.header["npy_dtype"], m.header["npy_shape"]) == ("npy", "<i2", [2, 5])
    assert paths_of(m) == ["a.npy"] * 2 + ["b.npy"] * 3
    assert set(m.sample_length.tolist()) == {20}
    data_offset = int(m.sample_offset[0])
    assert m.sample_offset.tolist() == [data_offset + 20 * j for j in (0, 1, 0, 1, 2)]


@pytest.mark.parametrize(
    ("second", "difference"),
    [
        (np.zeros((2, 4), dtype="<f8"), r"dtype float32 vs float64"),
        (np.zeros((2, 5), dtype="<f4"), r"record shape \(4,\) vs \(5,\)"),
    ],
)
def test_inconsistent_npy_arrays_are_rejected(tmp_path: Path, second: np.ndarray, difference: str) -> None:
    np.save(tmp_path / "a.npy", np.zeros((3, 4), dtype="<f4"))
    np.save(tmp_path / "b.npy", second)
    with pytest.raises(ManifestError, match=rf"a\.npy and .*b\.npy differ: {difference}"):
        build_manifest(tmp_path)


@pytest.mark.parametrize(
    ("array", "problem"),
    [
        (np.asfortranarray(np.zeros((3, 4))), "Fortran order"),
        (np.array([{"a": 1}, None], dtype=object), "Python objects"),
        (np.float32(1.0), "scalar"),
        (np.zeros((3, 0)), "empty records"),
    ],
)
def test_npy_arrays_that_are_not_records_are_rejected(tmp_path: Path, array: np.ndarray, problem: str) -> None:
    np.save(tmp_path / "a.npy", array, allow_pickle=True)
    with pytest.raises(ManifestError, match=problem):
        build_manifest(tmp_path)


def test_truncated_npy_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((10, 4), dtype="<f4"))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ManifestError, match="a.npy is truncated"):
        build_manifest(tmp_path)


def test_million_record_npy_manifest_builds_fast(tmp_path: Path) -> None:
    make_npy_dataset(tmp_path, 1_000_000, record_shape=(2,), dtype="uint8", files=3)
    # CPU time, not wall time: other processes on the machine do not count.
    started = time.process_time()
    writer = build_manifest(tmp_path)
    assert time.process_time() - started < 5
    assert writer.num_samples == 1_000_000


def build_traced(root: Path) -> tuple[ManifestWriter, int]:
    """The manifest writer of ``root`` and the peak bytes traced while building it."""
    tracemalloc.start()
    try:
        writer = build_manifest(root)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return writer, peak


def test_npy_manifest_memory_stays_under_200_bytes_per_record(tmp_path: Path) -> None:
    """Traced on a quarter million: tracing slows each append tenfold, and the
    cost per record does not depend on how many there are."""
    n = 250_000
    make_npy_dataset(tmp_path, n, record_shape=(2,), dtype="uint8", files=3)
    writer, peak = build_traced(tmp_path)
    assert writer.num_samples == n
    assert peak / n < 200


def test_files_manifest_memory_stays_under_200_bytes_per_file(tmp_path: Path) -> None:
    n = 10_000
    for c in range(4):
        folder = tmp_path / f"n{c:08d}"
        folder.mkdir()
        for i in range(c, n, 4):
            (folder / f"ILSVRC2012_val_{i:08d}.JPEG").touch()
    writer, peak = build_traced(tmp_path)
    assert writer.num_samples == n
    assert peak / n < 200


@pytest.mark.parametrize("fmt", ["files", "tar", "npy"])
def test_every_file_records_its_size_and_mtime(tmp_path: Path, fmt: str) -> None:
    if fmt == "files":
        make_files_dataset(tmp_path, 6, sizes=(10, 20), classes=2)
    elif fmt == "tar":
        make_tar_dataset(tmp_path, 6, samples_per_shard=3)
    else:
        make_npy_dataset(tmp_path, 6, files=2)
    m = manifest_of(tmp_path, fmt)
    files = [tmp_path / m.path(p) for p in range(m.num_paths)]
    assert m.header["version"] == 2
    assert m.path_size.tolist() == [f.stat().st_size for f in files]
    assert m.path_mtime_ns.tolist() == [f.stat().st_mtime_ns for f in files]


def test_building_unchanged_files_again_keeps_the_content_id_not_the_manifest_id(tmp_path: Path) -> None:
    root = make_files_dataset(tmp_path / "ds", 20, sizes=(100,))
    first, again = manifest_of(root), manifest_of(root)
    assert first.manifest_id != again.manifest_id
    assert first.content_id() == again.content_id()
    changed = sorted(root.rglob("*.bin"))[3]
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 1))
    assert manifest_of(root).content_id() != first.content_id()
