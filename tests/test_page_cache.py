"""Reading only what the page cache holds, on real files: asking reads nothing
from storage for the file's owner, and at most one page for a user the kernel
will not tell (a daemon reading other users' datasets)."""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dataquay.client.page_cache import PAGE, cached_pages, pages, read_cached

if sys.platform != "linux":
    pytest.skip("reads that avoid waiting for storage are Linux's", allow_module_level=True)

SIZE = 70_000


@pytest.fixture
def data() -> bytes:
    return os.urandom(SIZE)


@pytest.fixture
def fd(tmp_path: Path, data: bytes) -> Iterator[int]:
    """A file of ``data`` that the page cache does not hold (skips where it must)."""
    path = tmp_path / "sample.bin"
    path.write_bytes(data)
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        held = cached_pages(fd, 0, SIZE)
        if held is None:
            pytest.skip("the kernel does not count cached pages (cachestat, Linux 6.5)")
        if held:
            pytest.skip("the page cache keeps this file (tmpfs)")
        yield fd
    finally:
        os.close(fd)


def read_in(fd: int, offset: int, length: int) -> None:
    """Brings exactly these bytes' pages into the page cache."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    assert len(os.pread(fd, length, offset)) == length


def as_nobody(fd: int, ask: Callable[[int], bytes]) -> bytes:
    """What ``ask(fd)`` returns in a child process that runs as the user nobody
    with this file open, as a daemon reads a dataset it neither owns nor may
    write."""
    if os.geteuid() != 0:
        pytest.skip("taking another user's part needs root")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("there is no user nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(nobody.pw_gid, nobody.pw_gid, nobody.pw_gid)
            os.setresuid(nobody.pw_uid, nobody.pw_uid, nobody.pw_uid)
            os.write(write_end, ask(fd))
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        got = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return got


def test_pages_counts_every_page_a_range_touches() -> None:
    assert [pages(0, 0), pages(0, 1), pages(0, PAGE), pages(0, PAGE + 1), pages(PAGE - 1, 2)] == [0, 1, 1, 2, 2]


def test_the_owner_is_told_not_cached_without_a_read_from_storage(fd: int, data: bytes) -> None:
    assert read_cached(fd, 0, SIZE) is None
    assert cached_pages(fd, 0, SIZE) == 0  # a read with RWF_NOWAIT alone would have read it all ahead

    read_in(fd, 0, PAGE)
    assert read_cached(fd, 0, SIZE) is None  # one page of eighteen is not the range
    assert cached_pages(fd, 0, SIZE) == 1

    read_in(fd, 0, SIZE)
    assert read_cached(fd, 0, SIZE) == data
    assert read_cached(fd, 5000, 100) == data[5000:5100]
    assert read_cached(fd, 123, 0) == b""


def test_a_user_the_kernel_will_not_tell_reads_one_page_at_most_to_learn_it(fd: int, data: bytes) -> None:
    def ask(fd: int) -> bytes:
        assert cached_pages(fd, 0, SIZE) is None  # cachestat answers only the file's owner or writers
        got = read_cached(fd, 2 * PAGE + 10, SIZE - 2 * PAGE - 10)
        return b"not cached" if got is None else bytes(got)

    assert as_nobody(fd, ask) == b"not cached"
    assert cached_pages(fd, 0, SIZE) == 1

    read_in(fd, 0, SIZE)
    assert as_nobody(fd, ask) == data[2 * PAGE + 10 :]
