"""Turning a dataset root on the PFS into a manifest.

Sample ids follow one documented order, so that the same tree always gives
the same ids (a re-registration must not silently reshuffle a dataset whose
ids trainers and caches already use):

* The tree is walked depth first. Within a folder, entries are visited in the
  order of their names' bytes (``"B" < "a" < "a.jpg" < "a0"``), folders and
  files interleaved: a folder's whole subtree comes at the place of its name.
* files: one sample per regular file, in that order.
* tar: shards (``*.tar``) in that order; inside a shard, archive order.
* npy: arrays (``*.npy``) in that order; inside an array, records along axis 0.

Names starting with ``"."`` are skipped, files and folders alike: they are the
droppings of other tools (``.DS_Store``, ``._x`` AppleDouble, ``.nfs*``
silly-renames, ``.ipynb_checkpoints``), never training data. Sockets, FIFOs and
devices are skipped too. Symlinks are followed when their target lies inside
the root; the manifest stores the target's path, so the reader never has to
follow a link. A link that leaves the root, dangles or loops is an error.

The walk streams: it holds one sorted listing per open folder and the writer
holds about 30 bytes per sample plus its path, so a million samples fit in
well under 200 bytes each.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator, Sequence

import numpy as np
from numpy.lib import format as npy_format

from dataquay.client.errors import ManifestError, RootNotAllowedError, SampleTooLargeError
from dataquay.client.manifest import FORMATS, ManifestWriter
from dataquay.client.pfs import tar_member_key
from dataquay.client.units import format_bytes

_EXTENSIONS = {"tar": ".tar", "npy": ".npy"}
_FORMAT_OF_EXTENSION = {ext: fmt for fmt, ext in _EXTENSIONS.items()}


def build_manifest(root: str | os.PathLike[str], fmt: str | None = None, *, tar_grouped: bool = True) -> ManifestWriter:
    """Walks ``root`` and describes every sample of format ``fmt`` in it.

    Args:
        root: the dataset folder; stored resolved, so a later change of the
            working directory or of a symlink above it cannot move the data.
        fmt: "files", "tar" or "npy"; None picks one with :func:`detect_format`.
        tar_grouped: tar only. True makes one sample of all consecutive
            members sharing a WebDataset key (``x.jpg`` + ``x.cls``), which is
            what a trainer consumes; False makes one sample per member.

    Raises:
        ManifestError: with a one-line reason: a missing or empty root, a path
            leaving it, an unreadable file, a broken shard, inconsistent arrays.
    """
    real_root = _real_root(root)
    if fmt is None:
        fmt = detect_format(real_root)
    if fmt not in FORMATS:
        raise ManifestError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "tar":
        writer = _build_tar(real_root, tar_grouped)
    elif fmt == "npy":
        writer = _build_npy(real_root)
    else:
        writer = _build_files(real_root)
    if not writer.num_samples:
        raise ManifestError(f"no samples under {real_root}")
    return writer


def check_sample_sizes(writer: ManifestWriter, dataset: str, largest: int, setting: str) -> None:
    """Refuses a dataset that holds a sample larger than ``largest`` bytes
    (what ``setting`` allows), naming the first such sample and its file."""
    lengths = writer.sample_lengths()
    over = np.flatnonzero(lengths > largest)
    if len(over):
        sample_id = int(over[0])
        others = f"; {len(over) - 1} more are" if len(over) > 1 else ""
        raise SampleTooLargeError(
            f"sample {sample_id} of {dataset!r} ({writer.sample_path(sample_id)}) is "
            f"{too_large(int(lengths[sample_id]), largest, setting)}{others}"
        )


def too_large(size: int, largest: int, setting: str) -> str:
    """The end of a message refusing a sample of ``size`` bytes."""
    return f"{format_bytes(size)} ({size} bytes), larger than the {format_bytes(largest)} a sample may be ({setting})"


def detect_format(root: str | os.PathLike[str]) -> str:
    """The format that the files under ``root`` suggest.

    "tar" when every file is a .tar, "npy" when every file is a .npy, else
    "files". Stops at the first file that settles it, so a large ImageFolder
    tree is not walked twice.

    Raises:
        ManifestError: as :func:`build_manifest`, or when ``root`` has no files.
    """
    real_root = _real_root(root)
    detected: str | None = None
    for f in _walk(real_root):
        fmt = _FORMAT_OF_EXTENSION.get(os.path.splitext(f.rel)[1], "files")
        if fmt == "files" or detected not in (None, fmt):
            return "files"
        detected = fmt
    if detected is None:
        raise ManifestError(f"no samples under {real_root}")
    return detected


def allowed_root(root: str | os.PathLike[str], allowed: Sequence[os.PathLike[str]], setting: str) -> str:
    """The real path of ``root`` when it is one of the ``allowed`` directories
    or lies under one; what a server builds manifests from on a caller's word.

    Symlinks are resolved on both sides before comparing, so a link under an
    allowed root cannot lead out of it, and the check comes before any
    existence check, so a refused caller learns nothing of the paths outside.

    Args:
        root: the ROOT a caller asked to register.
        allowed: the server's --dataset-roots; empty allows nothing.
        setting: how the operator sets them, for the message.

    Raises:
        RootNotAllowedError: ``root`` resolves outside every allowed directory.
        ManifestError: as :func:`build_manifest`, for an allowed but unusable root.
    """
    _check_root_text(root)
    real = os.path.realpath(root)
    if not any(is_under(real, os.path.realpath(top)) for top in allowed):
        allowed_list = ", ".join(os.fspath(top) for top in allowed) or "none"
        raise RootNotAllowedError(
            f"dataset root {os.fspath(root)} is not under an allowed dataset root (allowed: {allowed_list}); "
            f"the operator allows roots with {setting}"
        )
    return _real_root(real)


def is_under(real: str, real_top: str) -> bool:
    """Whether the resolved path ``real`` is ``real_top`` or inside it."""
    return os.path.commonpath((real_top, real)) == real_top


def _check_root_text(root: str | os.PathLike[str]) -> None:
    if not os.fspath(root):
        raise ManifestError("no dataset root given")
    if "\0" in os.fspath(root):
        raise ManifestError(f"dataset root {root!r} contains a NUL character")


def _real_root(root: str | os.PathLike[str]) -> str:
    _check_root_text(root)
    path = os.path.realpath(root)
    if not os.path.exists(path):
        raise ManifestError(f"dataset root {root} does not exist")
    if not os.path.isdir(path):
        raise ManifestError(f"dataset root {root} is not a directory")
    return path


class _File:
    """A regular file found by the walk.

    ``rel`` is where the walk met it (labels come from there); ``real`` is its
    resolved absolute path and ``real_rel`` that path relative to the root
    (what the manifest stores; they differ only below a symlink).
    """

    __slots__ = ("real", "real_rel", "rel")

    def __init__(self, rel: str, real: str, real_rel: str) -> None:
        self.rel = rel
        self.real = real
        self.real_rel = real_rel


def _walk(real_root: str) -> Iterator[_File]:
    """Regular files under ``real_root``, in id order (see the module doc)."""
    prefix_len = len(os.path.join(real_root, ""))
    # Each frame: (real folder, folder rel to root as walked, names left to
    # visit reversed so pop() is cheap, kinds of the non-regular names).
    stack = [_frame(real_root, "")]
    on_path = [real_root]
    while stack:
        real_dir, rel_dir, names, kinds = stack[-1]
        if not names:
            stack.pop()
            on_path.pop()
            continue
        raw = names.pop()
        name = _decode(raw, real_dir)
        rel = rel_dir + name
        real = os.path.join(real_dir, name)
        kind = kinds.get(raw)
        if kind == "link":
            real, kind = _follow(real, real_root)
            if kind == "dir" and real in on_path:
                raise ManifestError(f"symlink {os.path.join(real_root, rel)} loops back to {real}")
        if kind == "dir":
            stack.append(_frame(real, rel + "/"))
            on_path.append(real)
        elif kind is None:
            yield _File(rel, real, real[prefix_len:])


def _frame(real_dir: str, rel_dir: str) -> tuple[str, str, list[bytes], dict[bytes, str]]:
    """Lists one folder: names sorted by bytes, plus which are folders/links.

    Only the few non-regular names get a dict entry, so a folder of a million
    files costs one bytes object per file.
    """
    names: list[bytes] = []
    kinds: dict[bytes, str] = {}
    try:
        with os.scandir(os.fsencode(real_dir)) as entries:
            for entry in entries:
                if entry.name.startswith(b"."):
                    continue
                if entry.is_symlink():
                    kinds[entry.name] = "link"
                elif entry.is_dir(follow_symlinks=False):
                    kinds[entry.name] = "dir"
                elif not entry.is_file(follow_symlinks=False):
                    continue
                names.append(entry.name)
    except OSError as exc:
        raise ManifestError(f"cannot list {real_dir}: {exc.strerror}") from exc
    names.sort(reverse=True)
    return real_dir, rel_dir, names, kinds


def _decode(raw: bytes, real_dir: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ManifestError(f"file name {raw!r} in {real_dir} is not UTF-8") from None


def _follow(link: str, real_root: str) -> tuple[str, str | None]:
    """Resolves a symlink met by the walk: (target, its kind for the walk).

    The kind is "dir", None for a regular file, or "skip" for a target the
    walk ignores like any other special file.
    """
    target = os.path.realpath(link)
    if os.path.commonpath((real_root, target)) != real_root:
        raise ManifestError(f"symlink {link} resolves outside the root, to {target}")
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        raise ManifestError(f"symlink {link} is broken: {exc.strerror}") from exc
    if stat.S_ISDIR(mode):
        return target, "dir"
    if stat.S_ISREG(mode):
        return target, None
    return target, "skip"


def _check_readable(path: str) -> os.stat_result:
    """The status of ``path``, opening it to prove it is readable.

    Opening is the only test that tells the truth on a PFS: ``os.access``
    ignores root squash and some ACLs, and a dataset found unreadable at
    registration beats one found unreadable mid-training. Its size and mtime
    go into the manifest, taken before the file is parsed, so that a file
    that changes while it is being described is refused when read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _label(rel: str) -> str | None:
    cut = rel.rfind("/")
    return None if cut < 0 else rel[:cut]


def _build_files(real_root: str) -> ManifestWriter:
    writer = ManifestWriter(real_root, "files")
    for f in _walk(real_root):
        st = _check_readable(f.real)
        path_index = writer.add_path(f.real_rel, st.st_size, st.st_mtime_ns)
        writer.add_sample(path_index, 0, st.st_size, _label(f.rel))
    return writer


def _matching(real_root: str, fmt: str) -> Iterator[_File]:
    """Files of ``fmt``'s extension; a ManifestError if there are none."""
    found = False
    for f in _walk(real_root):
        if f.rel.endswith(_EXTENSIONS[fmt]):
            found = True
            yield f
    if not found:
        raise ManifestError(f"no {_EXTENSIONS[fmt]} files under {real_root}")


def _build_tar(real_root: str, grouped: bool) -> ManifestWriter:
    writer = ManifestWriter(real_root, "tar", tar_grouped=grouped)
    for f in _matching(real_root, "tar"):
        st = _check_readable(f.real)
        path_index = writer.add_path(f.real_rel, st.st_size, st.st_mtime_ns)
        try:
            with tarfile.open(f.real, mode="r:") as tar:
                members = _tar_members(tar, f.real, st.st_size)
                if grouped:
                    for offset, length in _tar_groups(members, f.real):
                        writer.add_sample(path_index, offset, length)
                else:
                    for info in members:
                        writer.add_sample(path_index, info.offset_data, info.size)
        except (tarfile.TarError, OSError) as exc:
            raise ManifestError(f"cannot parse tar shard {f.real}: {exc}") from exc
    return writer


def _tar_members(tar: tarfile.TarFile, path: str, size: int) -> Iterator[tarfile.TarInfo]:
    """Regular members of an open shard, in archive order, without keeping them.

    tarfile remembers every member it lists; a shard can hold millions, so
    the list is dropped as we go. tarfile also ends its listing quietly at the
    first block that is not a header; anything there but zeros is reported.
    """
    while (info := tar.next()) is not None:
        tar.members.clear()  # type: ignore[attr-defined]  # typeshed omits it
        if info.issparse():
            raise ManifestError(f"tar shard {path}: member {info.name!r} is sparse")
        if not info.isreg():
            continue
        if info.offset_data + info.size > size:
            raise ManifestError(f"tar shard {path} is truncated in member {info.name!r}")
        yield info
    assert tar.fileobj is not None
    tar.fileobj.seek(tar.offset)
    if tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):
        raise ManifestError(f"tar shard {path}: no valid tar header at offset {tar.offset}")


def _tar_groups(members: Iterator[tarfile.TarInfo], path: str) -> Iterator[tuple[int, int]]:
    """(offset, length) of each run of consecutive members sharing a key.

    The range starts at the first member's header, so the reader can hand it
    to tarfile, and ends at the last member's data.
    """
    key: str | None = None
    start = end = 0
    extensions: set[str] = set()
    for info in members:
        split = tar_member_key(info.name)
        if split is None:
            continue
        if split[0] != key:
            if key is not None:
                yield start, end - start
            key, start, extensions = split[0], info.offset, set()
        if split[1] in extensions:
            raise ManifestError(f"tar shard {path}: member {info.name!r} repeats in sample {key!r}")
        extensions.add(split[1])
        end = info.offset_data + info.size
    if key is not None:
        yield start, end - start


def _build_npy(real_root: str) -> ManifestWriter:
    first: tuple[str, np.dtype, tuple[int, ...]] | None = None
    files: list[tuple[str, os.stat_result, int, int]] = []
    for f in _matching(real_root, "npy"):
        st, dtype, shape, data_offset = _npy_header(f.real)
        if first is None:
            first = (f.real, dtype, shape[1:])
        elif (dtype, shape[1:]) != first[1:]:
            what = f"dtype {first[1]} vs {dtype}" if dtype != first[1] else f"record shape {first[2]} vs {shape[1:]}"
            raise ManifestError(f"{first[0]} and {f.real} differ: {what}")
        files.append((f.real_rel, st, data_offset, shape[0]))
    assert first is not None
    path, dtype, record_shape = first
    reclen = dtype.itemsize * int(np.prod(record_shape, dtype=np.int64))
    if not reclen:
        raise ManifestError(f"{path} has empty records (dtype {dtype}, shape {record_shape})")
    writer = ManifestWriter(real_root, "npy", npy_dtype=npy_format.dtype_to_descr(dtype), npy_shape=list(record_shape))
    add = writer.add_sample
    for rel, st, data_offset, count in files:
        path_index = writer.add_path(rel, st.st_size, st.st_mtime_ns)
        for offset in range(data_offset, data_offset + count * reclen, reclen):
            add(path_index, offset, reclen)
    return writer


def _npy_header(path: str) -> tuple[os.stat_result, np.dtype, tuple[int, ...], int]:
    """(status, dtype, shape, offset of the data) of a .npy file, checked for records."""
    st = _check_readable(path)
    try:
        with open(path, "rb") as fh:
            version = npy_format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = npy_format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = npy_format.read_array_header_2_0(fh)
            else:
                raise ValueError(f"unsupported .npy version {version[0]}.{version[1]}")
            data_offset = fh.tell()
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read .npy header of {path}: {exc}") from exc
    if not shape:
        raise ManifestError(f"{path} holds a scalar, not records along axis 0")
    if fortran and len(shape) > 1:
        raise ManifestError(f"{path} is in Fortran order; records need C order")
    if dtype.hasobject:
        raise ManifestError(f"{path} holds Python objects (dtype {dtype}), not fixed-size records")
    expected = data_offset + dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if st.st_size < expected:
        raise ManifestError(f"{path} is truncated: {st.st_size} bytes, header needs {expected}")
    return st, dtype, tuple(shape), data_offset
