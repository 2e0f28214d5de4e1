"""Reading samples straight from the parallel file system.

Two callers share this module: the client, when its daemon is gone and it
must serve itself, and the daemon's reader pool, which splits one plan across
threads under a bandwidth cap. Both want the same thing from a PFS: few, large
requests. :func:`plan_reads` is the pure half (which byte ranges to fetch for a
batch of ids); :class:`PfsReader` is the I/O half (fetch one range, cut it into
samples).

Paths come only from a manifest, whose reader already refuses ``..`` and
absolute paths. The final component is opened with ``O_NOFOLLOW`` so that a
sample file swapped for a symlink after registration is refused, not followed,
and with ``O_NONBLOCK`` so that a FIFO swapped in does not park the reading
thread until some writer opens it; whatever is not a regular file (a FIFO, a
device) is refused once opened, before a byte of it is read. The same
``fstat`` compares the file's size and mtime with those the manifest recorded
at registration: a file that changed since is refused, so that a sample is
never served as a prefix of new content or as bytes the caches elsewhere do
not hold. That costs nothing per sample: one open serves a whole range.

:meth:`PfsReader.read_range_cached` reads a range only if the page cache
holds all of it (:mod:`dataquay.client.page_cache`): the daemon caches a
sample a trainer has just read this way, without a second read from the PFS.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, overload

import numpy as np

from dataquay.client import page_cache
from dataquay.client.errors import PfsReadError, SampleIdError
from dataquay.client.manifest import Manifest
from dataquay.client.wire.records import frame_members

DEFAULT_MAX_RANGE_BYTES = 8 << 20
#: Resolved paths a reader keeps: every file of a dataset of 64k files, a few MB.
PATHS_CACHED = 1 << 16
DEFAULT_MAX_GAP = 64 << 10
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: None where the OS cannot read without waiting for storage (not Linux).
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def tar_member_key(name: str) -> tuple[str, str] | None:
    """WebDataset's split of a tar member name into (sample key, extension).

    The key is the name up to the first "." of its last path component, the
    extension is the rest (``"a/b.seg.png"`` -> ``("a/b", "seg.png")``).
    Members with no such dot (``"README"``, ``".hidden"``) belong to no sample,
    as in WebDataset; the manifest builder and the reader both skip them, so a
    grouped sample's bytes mean the same thing on both sides.
    """
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None
    return name[:dot], name[dot + 1 :]


@dataclass(frozen=True, eq=False, slots=True)
class ReadRange:
    """One contiguous read: ``length`` bytes at ``offset`` of path ``path_index``.

    ``ids`` are the samples it covers, unique and in file order. Compared by
    identity: an array field has no single truth value to compare on.
    """

    path_index: int
    offset: int
    length: int
    ids: np.ndarray


class PfsRangeError(PfsReadError):
    """A range read failed; ``sample_ids`` lists every sample of that range.

    The message names the first sample that is actually affected. Callers
    that read ranges (the daemon's pool) retry the listed samples one by one,
    so a single bad file does not fail its neighbours.
    """

    def __init__(self, message: str, sample_ids: Sequence[int]) -> None:
        super().__init__(message)
        self.sample_ids: tuple[int, ...] = tuple(sample_ids)


def plan_reads(
    manifest: Manifest,
    ids: np.ndarray | Sequence[int],
    *,
    max_range_bytes: int = DEFAULT_MAX_RANGE_BYTES,
    max_gap: int = DEFAULT_MAX_GAP,
) -> list[ReadRange]:
    """Groups the samples ``ids`` into as few ranges as the limits allow.

    Samples of one file are sorted by offset; the next sample joins the current
    range when the hole before it is at most ``max_gap`` bytes and no larger
    than the sample itself (reading a small hole is cheaper than another
    request, but a range never reads more than twice the bytes it covers: a
    node that caches every M-th sample of a tar shard must not read the
    whole shard) and the range stays within ``max_range_bytes`` (bounding
    memory per read and keeping work shareable between threads). A sample
    larger than that limit is a range of its own. Repeated ids are planned once.

    Raises:
        SampleIdError: an id outside 0..N-1.
    """
    plan = _Plan(manifest, ids, max_range_bytes, max_gap)
    return [
        ReadRange(path, start, length, plan.wanted[first:stop])
        for path, start, length, first, stop in zip(
            plan.paths.tolist(), plan.starts.tolist(), plan.lengths.tolist(), plan.firsts.tolist(), plan.stops.tolist()
        )
    ]


class _Plan:
    """The ranges of :func:`plan_reads` as arrays, one entry per range.

    ``wanted`` holds the distinct ids in file order; range k covers
    ``wanted[firsts[k]:stops[k]]``, ``lengths[k]`` bytes at ``starts[k]`` of
    path ``paths[k]``. Ranges of one file are consecutive.
    """

    __slots__ = ("firsts", "lengths", "paths", "starts", "stops", "wanted")

    def __init__(self, manifest: Manifest, ids: np.ndarray | Sequence[int], max_range_bytes: int, max_gap: int) -> None:
        wanted = np.sort(np.asarray(ids, dtype=np.int64).ravel())
        if wanted.size:
            wanted = wanted[np.append(True, wanted[1:] != wanted[:-1])]
            n = manifest.num_samples
            if wanted[0] < 0 or wanted[-1] >= n:
                bad = int(wanted[0] if wanted[0] < 0 else wanted[-1])
                raise SampleIdError(f"sample {bad} not in manifest (N={n})")
        paths = manifest.sample_path[wanted]
        starts = manifest.sample_offset[wanted].astype(np.int64)
        order = np.lexsort((starts, paths))
        wanted, paths, starts = wanted[order], paths[order], starts[order]
        lengths = manifest.sample_length[wanted].astype(np.int64)
        ends = starts + lengths

        breaks = np.ones(wanted.size, dtype=bool)
        breaks[1:] = (paths[1:] != paths[:-1]) | (starts[1:] - ends[:-1] > np.minimum(max_gap, lengths[1:]))
        firsts = np.flatnonzero(breaks)
        stops = np.append(firsts[1:], wanted.size)[: firsts.size]
        seg_start = starts[firsts]
        spans = np.maximum.reduceat(ends, firsts) - seg_start if wanted.size else seg_start
        self.wanted = wanted
        self.paths, self.starts, self.lengths = paths[firsts], seg_start, spans
        self.firsts, self.stops = firsts, stops
        if wanted.size and int(spans.max()) > max_range_bytes:
            self._split(starts, ends, max_range_bytes)

    def _split(self, starts: np.ndarray, ends: np.ndarray, max_range_bytes: int) -> None:
        """Cuts the ranges longer than ``max_range_bytes`` at sample boundaries."""
        parts: list[tuple[int, int, int, int, int]] = []
        for path, first, stop, start, span in zip(
            self.paths.tolist(), self.firsts.tolist(), self.stops.tolist(), self.starts.tolist(), self.lengths.tolist()
        ):
            if span <= max_range_bytes:
                parts.append((path, start, span, first, stop))
                continue
            i = first
            while i < stop:
                start = int(starts[i])
                j = max(_first_above(ends, i, stop, start + max_range_bytes), i + 1)
                parts.append((path, start, int(ends[i:j].max()) - start, i, j))
                i = j
        columns = np.array(parts, dtype=np.int64).T
        self.paths, self.starts, self.lengths, self.firsts, self.stops = columns


def _first_above(values: np.ndarray, lo: int, hi: int, limit: int) -> int:
    """First index in lo..hi-1 whose value exceeds ``limit``, else ``hi``.

    Searches in doubling windows so that the cost follows the range found,
    not the segment searched: a segment can hold a million small records.
    """
    step = 256
    while lo < hi:
        hits = np.flatnonzero(values[lo : min(lo + step, hi)] > limit)
        if hits.size:
            return lo + int(hits[0])
        lo += step
        step *= 2
    return hi


class PfsReader:
    """Reads a dataset's samples from the files its manifest names.

    Stateless apart from a cache of resolved paths, so one reader can be
    shared by many threads; ``os.pread`` releases the GIL.

    ``confined`` also refuses a file whose real path left the root (a folder
    swapped for a link after registration): the daemon reads for others and
    must not be led outside the roots it serves. A trainer reading for itself
    (``confined=False``) could open whatever such a link points to anyway,
    and spares that look-up on every open.
    """

    def __init__(self, manifest: Manifest, dataset: str, *, confined: bool = True) -> None:
        self._manifest = manifest
        self._dataset = dataset
        self._grouped = manifest.format == "tar" and manifest.tar_grouped
        self._offsets = manifest.sample_offset
        self._lengths = manifest.sample_length
        self._sizes = manifest.path_size
        self._mtimes = manifest.path_mtime_ns
        root = manifest.root
        self._prefix = root if root.endswith("/") else root + "/"
        self._confined = confined
        self._path = functools.lru_cache(maxsize=PATHS_CACHED)(self._resolve)

    def _resolve(self, path_index: int) -> str:
        return self._prefix + self._manifest.path(path_index)

    def read(self, ids: np.ndarray | Sequence[int]) -> list[bytes]:
        """The bytes of every id, in request order (repeated ids included).

        A batch is planned as arrays, and each file is opened, checked
        against the manifest (kind, size, mtime) and closed once however many
        of the batch's ranges it holds; a range that is one whole sample
        needs no cutting. Whatever goes wrong is read again through
        :meth:`read_range`, whose error names the file and the reason.

        Raises:
            PfsRangeError: a file is missing, unreadable, shorter than the
                manifest says, or changed since the manifest was built.
            SampleIdError: an id outside 0..N-1.
            ManifestError: the manifest names a path that would leave its root.
        """
        flat = np.asarray(ids, dtype=np.int64).ravel()
        plan = _Plan(self._manifest, flat, DEFAULT_MAX_RANGE_BYTES, DEFAULT_MAX_GAP)
        got: list[bytes] = [b""] * len(plan.wanted)
        fd, opened = -1, -1
        try:
            for path_index, size, mtime_ns, start, length, first, stop in zip(
                plan.paths.tolist(),
                self._sizes[plan.paths].tolist(),
                self._mtimes[plan.paths].tolist(),
                plan.starts.tolist(),
                plan.lengths.tolist(),
                plan.firsts.tolist(),
                plan.stops.tolist(),
            ):
                if path_index != opened:
                    if fd >= 0:
                        os.close(fd)
                    opened, fd = path_index, self._open_unchanged(path_index, size, mtime_ns)
                data = _pread_whole(fd, length, start)
                if data is not None and stop - first == 1 and not self._grouped:
                    got[first] = data
                    continue
                r = ReadRange(path_index, start, length, plan.wanted[first:stop])
                cut = self.read_range(r) if data is None else self._cut(data, self._path(path_index), r)
                got[first:stop] = [cast(bytes, cut[i]) for i in r.ids.tolist()]
        finally:
            if fd >= 0:
                os.close(fd)
        by_id = np.argsort(plan.wanted)
        return [got[k] for k in by_id[np.searchsorted(plan.wanted[by_id], flat)].tolist()]

    def _open_unchanged(self, path_index: int, size: int, mtime_ns: int) -> int:
        """The file of ``path_index`` opened if it is a regular file of the
        ``size`` and ``mtime_ns`` the manifest recorded (and, confined, inside
        the root); -1 otherwise, for :meth:`read_range` to name the reason."""
        try:
            fd = os.open(self._path(path_index), _OPEN_FLAGS)
        except OSError:
            return -1
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISREG(st.st_mode)
            and (size < 0 or st.st_size == size)
            and (mtime_ns < 0 or st.st_mtime_ns == mtime_ns)
            and (not self._confined or (_opened_path(fd) or self._prefix).startswith(self._prefix))
        ):
            return fd
        os.close(fd)
        return -1

    def read_range(self, r: ReadRange) -> dict[int, bytes]:
        """Reads one planned range with one ``pread`` and cuts it into samples.

        ``r`` must come from :func:`plan_reads` on this reader's manifest.

        Raises:
            PfsRangeError: as :meth:`read`.
        """
        path = self._path(r.path_index)
        return cast("dict[int, bytes]", self._cut(self._pread(path, r), path, r))  # slices of bytes are bytes

    def read_range_cached(self, r: ReadRange) -> dict[int, bytes | memoryview] | None:
        """Like :meth:`read_range`, from the page cache only: None when it does
        not hold the whole range (or the OS cannot tell), without waiting for
        storage. The payloads are views of one buffer of the range.

        Raises:
            PfsRangeError: as :meth:`read`; a file that changed is refused too.
        """
        if _RWF_NOWAIT is None:
            return None
        path = self._path(r.path_index)
        data = self._pread(path, r, nowait=True)
        return None if data is None else self._cut(data, path, r)

    def _cut(self, data: bytes | memoryview, path: str, r: ReadRange) -> dict[int, bytes | memoryview]:
        """The samples of range ``r`` out of its bytes ``data``."""
        ids = r.ids.tolist()
        if len(ids) == 1:
            i = ids[0]
            start = int(self._offsets[i]) - r.offset
            out = {i: data[start : start + int(self._lengths[i])]}
        else:
            starts = (self._offsets[r.ids].astype(np.int64) - r.offset).tolist()
            lengths = self._lengths[r.ids].tolist()
            out = {i: data[s : s + n] for i, s, n in zip(ids, starts, lengths)}
        if self._grouped:
            return {i: self._unpack_group(i, raw, path, r) for i, raw in out.items()}
        return out

    @overload
    def _pread(self, path: str, r: ReadRange, nowait: Literal[False] = ...) -> bytes: ...

    @overload
    def _pread(self, path: str, r: ReadRange, nowait: Literal[True]) -> memoryview | None: ...

    def _pread(self, path: str, r: ReadRange, nowait: bool = False) -> bytes | memoryview | None:
        """The range's bytes; with ``nowait``, None unless the page cache holds all of them."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise self._error(r, r.ids, path, _reason(exc)) from exc
        try:
            st = os.fstat(fd)
            kind = stat.S_IFMT(st.st_mode)
            if kind != stat.S_IFREG:
                raise self._error(r, r.ids, path, f"is {_FILE_KINDS.get(kind, 'not a regular file')} (refused)")
            self._check_unchanged(st, path, r)
            opened = _opened_path(fd) if self._confined else None
            if opened is not None and not opened.startswith(self._prefix):
                # A folder of the root was swapped for a link after registration.
                raise self._error(r, r.ids, path, f"it resolves to {opened}, outside the dataset's root")
            if nowait:
                return page_cache.read_cached(fd, r.offset, r.length)
            data = os.pread(fd, r.length, r.offset)
            if len(data) < r.length:
                data = _pread_rest(fd, r, data)
        except PfsRangeError:
            raise
        except OSError as exc:
            raise self._error(r, r.ids, path, _reason(exc)) from exc
        finally:
            os.close(fd)
        if len(data) < r.length:
            ends = self._offsets[r.ids] + self._lengths[r.ids]
            short = r.ids[ends > r.offset + len(data)]
            reason = f"truncated: expected {r.length} bytes at offset {r.offset}, got {len(data)}"
            raise self._error(r, short, path, reason)
        return data

    def _check_unchanged(self, st: os.stat_result, path: str, r: ReadRange) -> None:
        """Refuses a file whose size or mtime is not what the manifest recorded."""
        size, mtime_ns = int(self._sizes[r.path_index]), int(self._mtimes[r.path_index])
        if size >= 0 and st.st_size != size:
            change = f"size {st.st_size}, registered {size}"
        elif mtime_ns >= 0 and st.st_mtime_ns != mtime_ns:
            change = f"mtime {st.st_mtime_ns} ns, registered {mtime_ns} ns"
        else:
            return
        reason = (
            f"it changed since the dataset was registered ({change}); "
            f"`dataquay dataset add {self._dataset} {self._manifest.root} --replace` takes the new content"
        )
        raise self._error(r, r.ids, path, reason)

    def _unpack_group(self, sample_id: int, raw: bytes | memoryview, path: str, r: ReadRange) -> bytes:
        """Frames the members of one grouped tar sample, in archive order.

        The range ends at the last member's data, not at the archive's next
        512-byte block, so iteration stops there instead of asking tarfile for
        a header that was never read.
        """
        members: list[tuple[str, memoryview]] = []
        view = memoryview(raw)
        try:
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
                while (info := tar.next()) is not None:
                    end = info.offset_data + info.size
                    if end > len(raw):
                        raise tarfile.ReadError(f"member {info.name!r} runs past the sample")
                    key = tar_member_key(info.name)
                    if info.isreg() and key is not None:
                        members.append((key[1], view[info.offset_data : end]))
                    if end >= len(raw):
                        break
        except tarfile.TarError as exc:
            offset = int(self._offsets[sample_id])
            reason = f"cannot parse tar members at offset {offset}: {exc}"
            raise self._error(r, [sample_id], path, reason) from exc
        return frame_members(members)

    def _error(self, r: ReadRange, affected: np.ndarray | Sequence[int], path: str, reason: str) -> PfsRangeError:
        message = f"sample {int(affected[0])} of {self._dataset!r}: cannot read {path}: {reason}"
        return PfsRangeError(message, r.ids.tolist())


def _opened_path(fd: int) -> str | None:
    """The real path of an open file (Linux /proc); None where it cannot be told."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _pread_whole(fd: int, length: int, offset: int) -> bytes | None:
    """``length`` bytes at ``offset`` of ``fd`` in one call; None for no file
    (-1), a failed read or a short one (which :meth:`PfsReader.read_range`
    finishes or explains)."""
    if fd < 0:
        return None
    try:
        data = os.pread(fd, length, offset)
    except OSError:
        return None
    return data if len(data) == length else None


def _pread_rest(fd: int, r: ReadRange, head: bytes) -> bytes:
    """Finishes a short read; stops early only at the end of the file."""
    chunks, got = [head], len(head)
    while got < r.length:
        more = os.pread(fd, r.length - got, r.offset + got)
        if not more:
            break
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symbolic link (refused)"
    if exc.errno == errno.ENXIO:
        return "is a socket or a device without a driver (refused)"
    return exc.strerror or str(exc)
