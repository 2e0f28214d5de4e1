"""Decoders chosen by name: a sample's bytes to what a training step takes.

Every framework adapter takes ``decode=`` as one of :data:`DECODERS`' names
or as a callable of its own. A name is resolved against the dataset's
manifest once (an npy record's dtype and shape live there), giving a
function of ``(sample_id, data)``; a user's callable gets the bytes alone,
as torchvision's transforms do.

Pure and framework-free: the image decoder imports Pillow only when chosen.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np

from dataquay.client.manifest import Manifest
from dataquay.client.wire.records import unframe_members

#: ``(sample_id, data) -> sample``, as the adapters call it (``data`` a
#: memoryview where the adapter was made with ``copy=False``).
SampleDecoder = Callable[[int, bytes | memoryview], Any]


def _raw(manifest: Manifest) -> SampleDecoder:
    return lambda sample_id, data: data


def _npy(manifest: Manifest) -> SampleDecoder:
    dtype, shape = manifest.record_dtype, manifest.record_shape
    if dtype is None or shape is None:
        raise ValueError(f"decode='npy' needs an npy dataset, not a {manifest.format} one")
    return lambda sample_id, data: np.frombuffer(data, dtype).reshape(shape)


def _image(manifest: Manifest) -> SampleDecoder:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("decode='image' needs Pillow: pip install pillow") from exc

    def decode(sample_id: int, data: bytes | memoryview) -> Any:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: the buffer is not kept, and a bad file fails here, in its sample
        return image

    return decode


def _tar(manifest: Manifest) -> SampleDecoder:
    if manifest.format != "tar" or not manifest.tar_grouped:
        raise ValueError("decode='tar' needs a tar dataset registered with its members grouped into samples")

    def decode(sample_id: int, data: bytes | memoryview) -> dict[str, Any]:
        shard = manifest.path(int(manifest.sample_path[sample_id]))
        return tar_sample(data, key=f"{sample_id:09d}", url=shard)

    return decode


def tar_sample(data: bytes | memoryview, *, key: str, url: str) -> dict[str, Any]:
    """A grouped tar sample as WebDataset yields it: each member's bytes
    under its extension (``"cls"``, ``"seg.png"``), with ``__key__`` and
    ``__url__`` (its shard, relative to the dataset's root).

    A cached sample keeps its members' extensions, not their names, so the
    ``__key__`` the ``tar`` decoder gives is the sample id, zero-padded to 9
    digits: unique, and sorting as the shards' order does.
    """
    sample: dict[str, Any] = {"__key__": key, "__url__": url}
    for extension, value in unframe_members(data).items():
        sample[extension] = bytes(value)
    return sample


#: The decoders by name: each, given the manifest, makes the per-sample function.
DECODERS: dict[str, Callable[[Manifest], SampleDecoder]] = {"raw": _raw, "npy": _npy, "image": _image, "tar": _tar}


def sample_decoder(decode: str | Callable[[bytes], Any] | None, manifest: Manifest) -> SampleDecoder:
    """The ``(sample_id, data)`` function for ``decode``: a name of
    :data:`DECODERS`, a callable of the bytes, or None (the bytes as read).

    Raises:
        ValueError: an unknown name, or one that does not fit the dataset's format.
        ImportError: the decoder's library is not installed.
    """
    if decode is None:
        return _raw(manifest)
    if callable(decode):
        user = decode
        # A memoryview with copy=False: documented there; a callable of bytes reads it alike.
        return lambda sample_id, data: user(data)  # type: ignore[arg-type]
    if decode not in DECODERS:
        raise ValueError(f"unknown decoder {decode!r}; expected a callable or one of {', '.join(DECODERS)}")
    return DECODERS[decode](manifest)
