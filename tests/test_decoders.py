"""Decoders chosen by name and integer labels, against a real daemon: what a
training step gets from each dataset format, byte for byte."""

from __future__ import annotations

import importlib.util
import io
import pickle
from pathlib import Path

import numpy as np
import pytest
from one_daemon import add, files_bytes

import dataquay.client as dq
from dataquay.client.loading import SampleReader
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess


def test_targets_are_integer_classes_indexing_the_sorted_class_names(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    root = tmp_path / "pets"
    for i, name in enumerate(["zebra", "cat", "dog", "cat", "zebra"]):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"{i}.bin").write_bytes(bytes([i]))
    (root / "stray.bin").write_bytes(b"s")  # at the root: no class
    add(daemon, "pets", root)
    ds = client.dataset("pets")
    assert ds.classes == ["cat", "dog", "zebra"] and ds.class_to_idx == {"cat": 0, "dog": 1, "zebra": 2}
    by_name = {ds[i]: (ds.label(i), int(ds.targets[i])) for i in range(len(ds))}
    assert by_name == {
        b"\x00": ("zebra", 2),
        b"\x01": ("cat", 0),
        b"\x02": ("dog", 1),
        b"\x03": ("cat", 0),
        b"\x04": ("zebra", 2),
        b"s": (None, -1),
    }
    labelled = SampleReader(ds, with_labels=True).read(range(len(ds)))
    assert labelled == [(ds[i], int(ds.targets[i])) for i in range(len(ds))]
    with pytest.raises(ValueError, match="read-only"):
        ds.targets[0] = 5


def test_decode_tar_gives_webdataset_dicts_with_their_key(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    root = synthetic.make_tar_dataset(tmp_path / "shards", 12, samples_per_shard=5, seed=3, classes=4)
    add(daemon, "shards", root)
    reader = SampleReader(client.dataset("shards"), "tar")
    samples = reader.read([0, 11, 6])
    assert [s["__key__"] for s in samples] == ["000000000", "000000011", "000000006"]
    assert [s["__url__"] for s in samples] == ["shard_000000.tar", "shard_000002.tar", "shard_000001.tar"]
    assert [s["bin"] for s in samples] == files_bytes(3, [0, 11, 6], (4096,))
    assert [s["cls"] for s in samples] == [b"0", b"3", b"2"]
    assert set(samples[0]) == {"__key__", "__url__", "bin", "cls"}


def test_decode_npy_gives_each_record_as_its_array(daemon: DaemonProcess, client: dq.Client, tmp_path: Path) -> None:
    root = synthetic.make_npy_dataset(tmp_path / "frames", 10, record_shape=(2, 3), dtype="int16", files=3)
    add(daemon, "frames", root)
    expected = np.concatenate([np.load(path) for path in sorted(root.glob("*.npy"))])
    records = SampleReader(client.dataset("frames"), "npy").read([9, 0, 4])
    for got, want in zip(records, expected[[9, 0, 4]]):
        assert got.dtype == np.int16 and got.shape == (2, 3)
        np.testing.assert_array_equal(got, want)


def test_decode_image_gives_pil_images_with_their_pixels(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    if importlib.util.find_spec("PIL") is None:
        pytest.skip("Pillow is not installed: decode='image' needs it")
    from PIL import Image

    pixels = [np.full((4, 6, 3), value, dtype=np.uint8) for value in (10, 200)]
    for i, array in enumerate(pixels):
        (tmp_path / "imgs" / f"c{i}").mkdir(parents=True)
        Image.fromarray(array).save(tmp_path / "imgs" / f"c{i}" / "a.png")
    add(daemon, "imgs", tmp_path / "imgs")
    images = SampleReader(client.dataset("imgs"), "image", with_labels=True).read([1, 0])
    assert [target for _, target in images] == [1, 0]
    for (image, _), want in zip(images, [pixels[1], pixels[0]]):
        np.testing.assert_array_equal(np.asarray(image), want)


def test_a_users_callable_gets_the_bytes_and_a_wrong_name_is_refused_before_reading(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 6, seed=2, classes=2)
    add(daemon, "imgs", tmp_path / "imgs")
    ds = client.dataset("imgs")
    reader = SampleReader(ds, len)
    assert reader.read([3, 1]) == [4096, 4096] and SampleReader(ds, "raw").read([3]) == files_bytes(2, [3], (4096,))
    with pytest.raises(ValueError, match="unknown decoder 'jpeg'"):
        SampleReader(ds, "jpeg")
    with pytest.raises(ValueError, match="decode='npy' needs an npy dataset"):
        SampleReader(ds, "npy")
    with pytest.raises(ValueError, match="decode='tar' needs a tar dataset"):
        SampleReader(ds, "tar")
    with pytest.raises(ValueError, match="on_error must be one of"):
        SampleReader(ds, on_error="ignore")
    copy = pickle.loads(pickle.dumps(SampleReader(ds, "raw", with_labels=True)))
    assert copy.read([5]) == [(files_bytes(2, [5], (4096,))[0], 1)]


def test_on_error_skip_leaves_out_a_sample_that_does_not_decode(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    if importlib.util.find_spec("PIL") is None:
        pytest.skip("Pillow is not installed: decode='image' needs it")
    from PIL import Image

    (tmp_path / "imgs" / "c").mkdir(parents=True)
    buffer = io.BytesIO()
    Image.new("L", (2, 2), 7).save(buffer, "PNG")
    (tmp_path / "imgs" / "c" / "0.png").write_bytes(buffer.getvalue())
    (tmp_path / "imgs" / "c" / "1.png").write_bytes(b"not a png")
    add(daemon, "imgs", tmp_path / "imgs")
    ds = client.dataset("imgs")
    before = client.stats().skipped
    images = SampleReader(ds, "image", on_error="skip").read([0, 1])
    assert [np.asarray(image).tolist() for image in images] == [[[7, 7], [7, 7]]]
    assert client.stats().skipped == before + 1
    with pytest.raises(OSError, match="cannot identify image"):
        SampleReader(ds, "image").read([1])
