"""Sealed memfd segments against a real daemon: what a client may hand over on
the fd socket, and what a client that means harm meets instead (a clear
refusal, never a dead daemon)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from one_daemon import add, cache_stub
from polling import wait_until

from dataquay.client.errors import SegmentRefusedError
from dataquay.client.wire.memfd import CLIENT_SEALS, MemfdSegment, fd_socket_path
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.server.auth import new_token_file
from dataquay.server.node.handoff.fd_socket import MAX_HANDSHAKES
from dataquay.server.node.handoff.segments import MAX_MEMFD_BYTES, MAX_MEMFD_PER_PROCESS
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SIZE = 1 << 20
SAMPLE = 3000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
MFD_HUGETLB = 4


@pytest.fixture
def served(daemon: DaemonProcess, tmp_path: Path) -> DaemonProcess:
    """The daemon, with dataset 'imgs' of 40 samples of SAMPLE bytes."""
    synthetic.make_files_dataset(tmp_path / "imgs", 40, sizes=(SAMPLE,), seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    return daemon


def fd_socket(daemon: DaemonProcess) -> str:
    return fd_socket_path(daemon.address)


def hand_over(daemon: DaemonProcess, message: bytes, fds: list[int]) -> dict[str, str]:
    """What the daemon answers to ``message`` carrying ``fds``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(fd_socket(daemon))
        socket.send_fds(sock, [message], fds)
        answer: dict[str, str] = json.loads(sock.recv(1024))
        return answer


def announce(size: int, token: str = "") -> bytes:
    return json.dumps({"size": size, "token": token}).encode()


@contextmanager
def memfd(size: int = SIZE, seals: int = CLIENT_SEALS, allocate: bool = True, flags: int = 0) -> Iterator[int]:
    fd = os.memfd_create("dataquay-test", os.MFD_ALLOW_SEALING | flags)
    try:
        os.ftruncate(fd, size)
        if allocate:
            os.posix_fallocate(fd, 0, size)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        yield fd
    finally:
        os.close(fd)


def read_into(daemon: DaemonProcess, segment: MemfdSegment, ids: list[int]) -> list[pb.Sample]:
    request = pb.ReadRequest(dataset="imgs", ids=ids, shm_name=segment.name, shm_size=segment.size)
    with cache_stub(daemon) as stub:
        return [s for chunk in stub.Read(request) for s in chunk.samples]


def assert_reads_through_a_segment(daemon: DaemonProcess) -> None:
    """The daemon lives, takes a well-made segment and writes the right bytes into it."""
    assert daemon.process is not None and daemon.process.poll() is None, daemon.log_tail()
    segment = MemfdSegment(SIZE, fd_socket(daemon), "")
    try:
        reply = read_into(daemon, segment, [5, 0, 39])
        assert all(s.in_shm for s in reply)
        got = [segment.map[s.shm_offset : s.shm_offset + s.length] for s in reply]
        assert got == [synthetic.sample_bytes(3, i, SAMPLE) for i in (5, 0, 39)]
        assert all(s.checksum == checksum(g) for s, g in zip(reply, got))
    finally:
        segment.close()


def segment_when_free(daemon: DaemonProcess) -> MemfdSegment:
    """A segment, once the daemon has seen the connections that flooded it end
    (until then it answers "busy" and closes the connection, before or after
    the request arrives, which a client takes as "not this time")."""
    made: list[MemfdSegment] = []

    def attempt() -> bool:
        try:
            made.append(MemfdSegment(SIZE, fd_socket(daemon), ""))
        except (BlockingIOError, ConnectionError):  # refused, reset, or a broken pipe
            return False
        return True

    wait_until(attempt, "the daemon takes segments again")
    return made[0]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def memfd_mappings(pid: int) -> int:
    return Path(f"/proc/{pid}/maps").read_text().count("/memfd:dataquay-")


def test_a_sealed_memfd_is_written_by_the_daemon_and_unmapped_when_its_client_exits(served: DaemonProcess) -> None:
    assert served.process is not None
    segment = MemfdSegment(SIZE, fd_socket(served), "")
    reply = read_into(served, segment, list(range(40)))
    assert [s.shm_offset for s in reply] == [i * 3008 for i in range(40)]  # 64-byte aligned, one after another
    assert [segment.map[s.shm_offset : s.shm_offset + s.length] for s in reply] == [
        synthetic.sample_bytes(3, i, SAMPLE) for i in range(40)
    ]
    assert memfd_mappings(served.process.pid) == 1
    segment.close()
    wait_until(lambda: memfd_mappings(served.process.pid) == 0, "the daemon unmaps a segment its client closed")
    reply = read_into(served, segment, [1])  # a name the daemon let go of: inline
    assert not reply[0].in_shm and reply[0].data == synthetic.sample_bytes(3, 1, SAMPLE)

    pid = os.fork()
    if pid == 0:
        MemfdSegment(SIZE, fd_socket(served), "")
        os._exit(0)
    os.waitpid(pid, 0)
    wait_until(lambda: memfd_mappings(served.process.pid) == 0, "the daemon unmaps the segment of a client that exited")

    # A forked child (a DataLoader worker) does not keep its parent's segments mapped.
    segment = MemfdSegment(SIZE, fd_socket(served), "")
    hold, release = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(release)
        os.read(hold, 1)  # until the parent lets go, or ends
        os._exit(0)
    os.close(hold)
    try:
        segment.close()
        wait_until(lambda: memfd_mappings(served.process.pid) == 0, "the daemon unmaps a segment whose owner forked")
    finally:
        os.close(release)
        os.waitpid(pid, 0)
    assert_reads_through_a_segment(served)


def _regular_file(tmp: Path) -> int:
    path = tmp / "plain"
    path.write_bytes(b"\0" * SIZE)
    return os.open(path, os.O_RDWR)


def _dev_shm_file(tmp: Path) -> int:
    path = Path("/dev/shm") / f"dataquay-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    path.unlink()
    os.ftruncate(fd, SIZE)
    return fd


BAD_DESCRIPTORS: list[tuple[str, Callable[[Path], int], str]] = [
    ("a regular file", _regular_file, "not a memfd of the kernel's shared memory"),
    ("a file under /dev/shm", _dev_shm_file, "not a memfd of the kernel's shared memory"),
    ("a pipe", lambda _: os.pipe()[0], "not a memfd of the kernel's shared memory"),
    ("a socket", lambda _: socket.socket(socket.AF_UNIX).detach(), "not a memfd of the kernel's shared memory"),
]


def test_descriptors_that_are_no_sealed_memfd_of_the_size_announced_are_refused_and_the_daemon_serves_on(
    served: DaemonProcess, tmp_path: Path
) -> None:
    for what, make, error in BAD_DESCRIPTORS:
        fd = make(tmp_path)
        try:
            assert error in hand_over(served, announce(SIZE), [fd]).get("error", ""), what
        finally:
            os.close(fd)
    memfds = [
        ("unsealed", dict(seals=0), SIZE, "not sealed against shrinking and growing"),
        ("sealed against shrinking only", dict(seals=fcntl.F_SEAL_SHRINK), SIZE, "not sealed against shrinking"),
        (
            "sealed against the daemon's seals",
            dict(seals=CLIENT_SEALS | fcntl.F_SEAL_SEAL),
            SIZE,
            "sealed against writes or further seals",
        ),
        (
            "sealed against writes",
            dict(seals=CLIENT_SEALS | fcntl.F_SEAL_WRITE),
            SIZE,
            "sealed against writes or further seals",
        ),
        ("of another size than announced", {}, SIZE * 2, f"holds {SIZE} bytes, not the {SIZE * 2} announced"),
        ("announced empty", {}, 0, "a segment of 0 bytes"),
        ("announced negative", {}, -SIZE, f"a segment of {-SIZE} bytes"),
        ("with its pages not allocated", dict(allocate=False), SIZE, f"has 0 of its {SIZE} bytes allocated"),
    ]
    for what, made, announced, error in memfds:
        with memfd(**made) as fd:  # type: ignore[arg-type]
            assert error in hand_over(served, announce(announced), [fd]).get("error", ""), what
    huge = MAX_MEMFD_BYTES * 4
    with memfd(huge, allocate=False) as fd:
        assert f"a segment of {huge} bytes" in hand_over(served, announce(huge), [fd])["error"]
    try:
        with memfd(2 << 20, allocate=False, flags=MFD_HUGETLB) as fd:
            assert "hugetlb" in hand_over(served, announce(2 << 20), [fd])["error"]
    except OSError:
        pass  # no hugetlb memfds on this kernel
    for message, error in [
        (b"{", "malformed"),
        (b"[1]", "malformed"),
        (b'{"size": "1"}', "malformed"),
        (b"x" * 5000, "longer than"),
    ]:
        with memfd() as fd:
            assert error in hand_over(served, message, [fd])["error"]
    assert "exactly one descriptor, not none" in hand_over(served, announce(SIZE), [])["error"]
    assert served.process is not None
    assert memfd_mappings(served.process.pid) == 0
    assert "refused a shared memory segment" in served.log_tail()
    assert_reads_through_a_segment(served)


def test_a_flood_of_descriptors_and_segments_leaves_the_daemon_bounded_and_serving(served: DaemonProcess) -> None:
    assert served.process is not None
    daemon_pid = served.process.pid
    before = open_fds(daemon_pid)
    with memfd() as fd:
        many = [os.dup(fd) for _ in range(200)]
        try:
            for _ in range(5):
                assert "exactly one descriptor" in hand_over(served, announce(SIZE), many)["error"]
        finally:
            for extra in many:
                os.close(extra)
    assert open_fds(daemon_pid) <= before + 2, "the daemon kept descriptors it was flooded with"

    idle = []
    try:
        for _ in range(MAX_HANDSHAKES + 4):  # connections that send nothing
            idle.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            idle[-1].connect(fd_socket(served))  # blocking: waits while the daemon's backlog is full
            idle[-1].settimeout(10)
        assert json.loads(idle[-1].recv(1024)) == {
            "error": "too many clients handing over segments at once",
            "busy": True,
        }
    finally:
        for conn in idle:
            conn.close()
    segment_when_free(served).close()

    segments = [MemfdSegment(64 << 10, fd_socket(served), "") for _ in range(MAX_MEMFD_PER_PROCESS + 8)]
    try:
        assert memfd_mappings(daemon_pid) == MAX_MEMFD_PER_PROCESS  # one process's oldest went first
        assert not read_into(served, segments[0], [1])[0].in_shm
        assert read_into(served, segments[-1], [1])[0].in_shm
    finally:
        for segment in segments:
            segment.close()
    wait_until(lambda: memfd_mappings(daemon_pid) == 0, "the daemon unmaps the closed segments")
    assert open_fds(daemon_pid) <= before + 2
    assert_reads_through_a_segment(served)


def test_a_client_cannot_punch_holes_in_a_segment_the_daemon_writes_into(served: DaemonProcess) -> None:
    with memfd() as fd, mmap.mmap(fd, SIZE) as writable, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as lease:
        lease.connect(fd_socket(served))
        socket.send_fds(lease, [announce(SIZE)], [fd])
        name = json.loads(lease.recv(1024))["segment"]
        # Sealed by the daemon once mapped: no hole by any way, no new writable mapping, no shrinking.
        libc = ctypes.CDLL(None, use_errno=True)
        punched = libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(0), ctypes.c_long(SIZE))
        assert punched == -1 and ctypes.get_errno() == 1  # EPERM
        with pytest.raises(PermissionError):
            writable.madvise(mmap.MADV_REMOVE)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, SIZE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        assert os.fstat(fd).st_blocks * 512 >= SIZE
        request = pb.ReadRequest(dataset="imgs", ids=list(range(40)), shm_name=name, shm_size=SIZE)
        with cache_stub(served) as stub:
            reply = [s for chunk in stub.Read(request) for s in chunk.samples]
        assert all(s.in_shm for s in reply)
        assert [os.pread(fd, s.length, s.shm_offset) for s in reply] == [
            synthetic.sample_bytes(3, i, SAMPLE) for i in range(40)
        ]
    assert_reads_through_a_segment(served)


def test_the_fd_socket_asks_for_the_cluster_token(start_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    token_file = new_token_file(tmp_path / "token")
    daemon = start_daemon("--token-file", str(token_file), "--node-token-file", str(new_token_file(tmp_path / "node")))
    token = token_file.read_text().strip()
    for sent, error in [("", "needs the cluster token"), ("0" * 64, "missing or wrong cluster token")]:
        with memfd() as fd:
            assert error in hand_over(daemon, announce(SIZE, sent), [fd])["error"]
        with pytest.raises(SegmentRefusedError, match=error):
            MemfdSegment(SIZE, fd_socket(daemon), sent)
    segment = MemfdSegment(SIZE, fd_socket(daemon), token)
    assert segment.name.startswith("memfd:")
    segment.close()
