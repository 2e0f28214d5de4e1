"""The client reading from a real daemon: misses through shared memory, every
format, a map that grows under a reader, forked DataLoader-style workers, bad
input, the counters trainers report and batches read ahead."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from one_daemon import add, cache_stub, cached_samples, daemon_stats, files_bytes, read_locally, stage, tiers_read
from open_files import open_files
from polling import wait_until

import dataquay.client as dq
from dataquay.client.errors import PfsReadError, UnknownDatasetError
from dataquay.client.pfs import PfsReader
from dataquay.client.read_ahead import join_read_ahead
from dataquay.client.wire.records import checksum, frame_members
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools import synthetic
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.processes import DaemonProcess

MiB = 1 << 20
SHM_DIR = Path("/dev/shm")


# ------------------------------------------------------------------ helpers


def shm_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"dataquay-{os.getpid()}-*")}


def shm_mappings(pid: int) -> dict[str, bool]:
    """Segments of this process mapped by ``pid``: name -> whether its file is unlinked."""
    prefix = f"/dev/shm/dataquay-{os.getpid()}-"
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return segment_names([line[line.find(prefix) :] for line in lines if prefix in line])


def shm_open_files(pid: int) -> dict[str, bool]:
    """Segments of this process that ``pid`` holds open: name -> whether its file is unlinked."""
    prefix = f"/dev/shm/dataquay-{os.getpid()}-"
    return segment_names([target for target in open_files(pid) if target.startswith(prefix)])


def segment_names(paths: list[str]) -> dict[str, bool]:
    return {path.split()[0].rsplit("/", 1)[1]: path.endswith("(deleted)") for path in paths}


# ------------------------------------------------------ 1. shared memory

SHM_SIZES = (3000, 70_000, 17, 250_000)


@pytest.fixture
def daemon_client(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[dq.Client]:
    """A client whose misses the daemon reads, as for a job's reads."""
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    with dq.connect(daemon.address, timeout=5) as c:
        yield c


def memfd_mappings(pid: int) -> int:
    """How many memfd segments of this process ``pid`` maps."""
    return Path(f"/proc/{pid}/maps").read_text().count(f"/memfd:dataquay-{os.getpid()} ")


def test_misses_come_through_a_sealed_memfd_that_the_daemon_unmaps_when_the_client_closes(
    daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    synthetic.make_files_dataset(tmp_path / "imgs", 40, sizes=SHM_SIZES, seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    assert daemon.process is not None
    files_before = shm_files()
    with dq.connect(daemon.address, timeout=5) as client:
        ds = client.dataset("imgs")
        ids = [39, 0, 7, 7, 12, 3, 38]
        got, tiers = tiers_read(client, lambda: ds.get_batch(ids))
        assert got == files_bytes(3, ids, SHM_SIZES)
        assert tiers["pfs"] == len(ids) and tiers["local"] == 0 and tiers["fallback"] == 0
        assert memfd_mappings(daemon.process.pid) == 1 and shm_files() == files_before
        more = list(range(20, 30))
        assert ds.get_batch(more) == files_bytes(3, more, SHM_SIZES)
        assert memfd_mappings(daemon.process.pid) == 1  # the same segment, reused
    wait_until(lambda: memfd_mappings(daemon.process.pid) == 0, "the daemon unmaps a closed segment")


def test_without_the_fd_socket_misses_come_through_dev_shm_and_leave_no_segment_file(
    daemon: DaemonProcess, daemon_client: dq.Client, tmp_path: Path
) -> None:
    client = daemon_client
    synthetic.make_files_dataset(tmp_path / "imgs", 40, sizes=SHM_SIZES, seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    os.unlink(daemon.address + ".fds")  # as with a daemon whose kernel cannot seal memfds
    ds = client.dataset("imgs")
    files_before = shm_files()

    ids = [39, 0, 7, 7, 12, 3, 38]
    got, tiers = tiers_read(client, lambda: ds.get_batch(ids))
    assert got == files_bytes(3, ids, SHM_SIZES)
    assert tiers["pfs"] == len(ids) and tiers["local"] == 0 and tiers["fallback"] == 0

    assert shm_files() - files_before == set(), "the client left its segment's file in /dev/shm"
    # The segment was used: the client maps it, the daemon holds it open, and its file is gone.
    mine = shm_mappings(os.getpid())
    assert daemon.process is not None
    used = set(mine) & set(shm_open_files(daemon.process.pid))
    assert used and all(mine[name] for name in used)

    more = list(range(20, 30))
    assert ds.get_batch(more) == files_bytes(3, more, SHM_SIZES)
    assert shm_files() - files_before == set()


def test_a_client_whose_segment_the_daemon_refuses_warns_and_reads_through_dev_shm(
    daemon: DaemonProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    synthetic.make_files_dataset(tmp_path / "imgs", 40, sizes=SHM_SIZES, seed=3)
    add(daemon, "imgs", tmp_path / "imgs")
    fd_socket = daemon.address + ".fds"
    os.unlink(fd_socket)
    refuser = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    refuser.bind(fd_socket)
    refuser.listen(4)

    def refuse() -> None:
        fds: list[int] = []
        while not fds:  # a caller ticket's request carries none: refused as well
            conn, _ = refuser.accept()
            with conn:
                _, fds, _, _ = socket.recv_fds(conn, 1024, 1)
                for fd in fds:
                    os.close(fd)
                conn.send(b'{"error": "this kernel seals nothing"}')

    answering = threading.Thread(target=refuse)
    answering.start()
    try:
        with dq.connect(daemon.address, timeout=5) as client:
            ds = client.dataset("imgs")
            for ids in ([39, 0, 7, 7], list(range(20, 30))):
                assert ds.get_batch(ids) == files_bytes(3, ids, SHM_SIZES)
            assert daemon.process is not None
            assert shm_open_files(daemon.process.pid) and memfd_mappings(daemon.process.pid) == 0
    finally:
        answering.join(10)
        refuser.close()
    refused = [r.getMessage() for r in caplog.records if "sealed shared memory refused" in r.getMessage()]
    assert refused == ["sealed shared memory refused (this kernel seals nothing); samples come through /dev/shm"]


def test_batches_larger_than_the_segment_come_back_exact_and_in_order(
    daemon: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = (100_000, 23_000, 300_000, 5)  # one sample alone is larger than the segment
    synthetic.make_files_dataset(tmp_path / "big", 48, sizes=sizes, seed=4)
    add(daemon, "big", tmp_path / "big")
    monkeypatch.setenv("DATAQUAY_SHM_BYTES", "65536")
    monkeypatch.setenv("DATAQUAY_MISS_READS", "daemon")
    files_before = shm_files()
    with dq.connect(daemon.address, timeout=5) as client:
        ds = client.dataset("big")
        ids = [*range(47, -1, -1), 2, 1, 2]  # ~5 MB, more than one streamed message
        got, tiers = tiers_read(client, lambda: ds.get_batch(ids))
        assert got == files_bytes(4, ids, sizes)
        assert tiers["pfs"] == len(ids)
        assert shm_files() - files_before == set()
        small = [1, 3, 5, 3]  # fits the segment whole
        assert ds.get_batch(small) == files_bytes(4, small, sizes)
        assert shm_files() - files_before == set()


# ------------------------------------------------------------ 2. formats


def make_format(fmt: str, root: Path) -> Callable[[int], bytes]:
    """Writes a small dataset of ``fmt`` under ``root``; returns sample id -> its bytes."""
    sizes = (100, 5000, 70_000, 1)
    if fmt == "files":
        synthetic.make_files_dataset(root, 30, sizes=sizes, classes=3, seed=5)
        return lambda i: synthetic.sample_bytes(5, i, sizes[i % len(sizes)])
    if fmt == "tar":
        synthetic.make_tar_dataset(root, 30, samples_per_shard=8, sizes=sizes, classes=3, seed=5)
        return lambda i: frame_members(
            [("bin", synthetic.sample_bytes(5, i, sizes[i % len(sizes)])), ("cls", str(i * 3 // 30).encode())]
        )
    synthetic.make_npy_dataset(root, 50, record_shape=(7, 3), dtype="float32", files=3, seed=5)
    records = np.concatenate([np.load(path) for path in sorted(root.glob("*.npy"))])
    return lambda i: records[i].tobytes()


@pytest.mark.parametrize("fmt", ["files", "tar", "npy"])
def test_every_format_reads_the_same_bytes_as_the_pfs_cached_or_not(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path, fmt: str
) -> None:
    truth = make_format(fmt, tmp_path / fmt)
    info = add(daemon, fmt, tmp_path / fmt)
    assert info.format == {"files": pb.FORMAT_FILES, "tar": pb.FORMAT_TAR, "npy": pb.FORMAT_NPY}[fmt]
    ds = client.dataset(fmt)
    n = len(ds)
    pfs = PfsReader(ds.manifest, fmt)
    ids = [*np.random.default_rng(0).permutation(n).tolist(), 0, n - 1, 0]
    want = pfs.read(ids)
    assert want == [truth(i) for i in ids]

    uncached, tiers = tiers_read(client, lambda: ds.get_batch(ids))
    assert uncached == want
    assert tiers["pfs"] == len(ids) and tiers["local"] == 0

    stage(daemon, fmt)
    assert read_locally(client, ds, ids) == want
    assert ds[n - 1] == truth(n - 1) and list(ds) == pfs.read(range(n))


# ---------------------------------------------------- 3. a growing map


def test_the_daemon_grows_its_map_while_a_client_reads_and_every_byte_stays_exact(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    a_sizes, a_n = (256 * 1024,), 160  # 40 MiB
    b_sizes, b_n = (MiB,), 300  # 300 MiB: past the daemon's initial map of 256 MiB
    synthetic.make_files_dataset(tmp_path / "a", a_n, sizes=a_sizes, seed=10)
    synthetic.make_files_dataset(tmp_path / "b", b_n, sizes=b_sizes, seed=11)
    add(daemon, "a", tmp_path / "a")
    stage(daemon, "a")
    a = client.dataset("a")
    want_a = files_bytes(10, range(a_n), a_sizes)
    assert read_locally(client, a, list(range(0, a_n, 5))) == want_a[::5]
    assert daemon_stats(daemon).cache_used_bytes < 256 * MiB

    # A reader keeps going through the map while staging B makes it grow.
    staging_done = threading.Event()
    problems: list[str] = []
    passes = [0]

    def keep_reading() -> None:
        try:
            while True:
                for start in range(0, a_n, 32):
                    ids = list(range(start, min(start + 32, a_n)))
                    if a.get_batch(ids) != want_a[start : start + 32]:
                        problems.append(f"wrong bytes in A[{start}:{start + 32}]")
                passes[0] += 1
                if staging_done.is_set():
                    return
        except Exception as exc:  # reported by the test thread
            problems.append(repr(exc))

    reader = threading.Thread(target=keep_reading)
    reader.start()
    try:
        add(daemon, "b", tmp_path / "b")
        stage(daemon, "b")
    finally:
        staging_done.set()
        reader.join(60)
    assert not reader.is_alive() and not problems and passes[0] >= 1
    assert daemon_stats(daemon).cache_used_bytes > 256 * MiB

    b = client.dataset("b")
    before = client.stats().samples
    for start in range(0, a_n, 40):
        ids = list(range(start, min(start + 40, a_n)))
        assert a.get_batch(ids) == want_a[start : start + 40]
    for start in range(0, b_n, 25):
        ids = list(range(start, min(start + 25, b_n)))
        assert b.get_batch(ids) == files_bytes(11, ids, b_sizes), f"wrong bytes in B[{start}:{start + 25}]"
    after = client.stats().samples
    served = {tier: after[tier] - before[tier] for tier in after}
    assert sum(served.values()) == a_n + b_n
    assert served["fallback"] == 0 and served["pfs"] == 0
    assert served["local"] >= 0.9 * (a_n + b_n), served


# --------------------------------------------------- 4. forked workers


def _worker(ds: dq.Dataset, worker: int, ids: list[int], out: multiprocessing.Queue) -> None:
    before = ds.client.stats().samples
    got = ds.get_batch(ids)
    after = ds.client.stats().samples
    out.put((worker, [checksum(x) for x in got], {t: after[t] - before[t] for t in after}))


def test_forked_workers_read_their_slices_of_cached_and_uncached_ids(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    sizes = (3000, 12_000, 70)
    n, cached_n = 60, 30
    synthetic.make_files_dataset(tmp_path / "imgs", n, sizes=sizes, seed=41)
    add(daemon, "imgs", tmp_path / "imgs")
    ds = client.dataset("imgs")
    want = files_bytes(41, range(n), sizes)
    assert ds.get_batch(range(cached_n)) == want[:cached_n]  # the daemon caches these
    wait_until(lambda: cached_samples(daemon, "imgs") >= cached_n, "the daemon cached the samples it read")

    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    slices = {k: list(range(k, n, 3))[::-1] for k in range(3)}  # half cached, half not
    workers = [ctx.Process(target=_worker, args=(ds, k, ids, out)) for k, ids in slices.items()]
    for w in workers:
        w.start()
    results = {worker: (sums, tiers) for worker, sums, tiers in (out.get(timeout=60) for _ in workers)}
    for w in workers:
        w.join(30)
        assert w.exitcode == 0

    for k, ids in slices.items():
        sums, tiers = results[k]
        assert sums == [checksum(want[i]) for i in ids], f"worker {k} read wrong bytes"
        assert tiers["local"] == sum(i < cached_n for i in ids)
        assert tiers["pfs"] == sum(i >= cached_n for i in ids)
    assert ds.get_batch([n - 1, 0]) == [want[n - 1], want[0]]


# ------------------------------------------------------- 5. bad input


def test_bad_input_raises_clearly_and_the_client_keeps_serving(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    sizes = (1500, 800)
    synthetic.make_files_dataset(tmp_path / "imgs", 20, sizes=sizes, seed=51)
    add(daemon, "imgs", tmp_path / "imgs")
    stage(daemon, "imgs")
    ds = client.dataset("imgs")
    want = files_bytes(51, range(20), sizes)

    def still_serves() -> None:
        assert ds.get_batch([3, 19, 3]) == [want[3], want[19], want[3]]
        assert ds[-1] == want[19]
        assert daemon_stats(daemon).cache_entries == 20

    with pytest.raises(IndexError) as err:
        ds[20]
    assert "20" in str(err.value) and "N=20" in str(err.value) and "'imgs'" in str(err.value)
    still_serves()
    with pytest.raises(IndexError, match=r"-21 .*'imgs' \(N=20\)"):
        ds[-21]
    still_serves()
    with pytest.raises(IndexError, match=r"-1 .*'imgs'"):
        ds.get_batch([0, -1])
    still_serves()
    with pytest.raises(IndexError, match=r"20 .*'imgs' \(N=20\)"):
        ds.get_batch([1, 20])
    still_serves()
    assert ds.get_batch([]) == [] and ds.get_batch(np.array([], dtype=np.int64)) == []
    still_serves()
    with pytest.raises(UnknownDatasetError, match="nope"):
        client.dataset("nope")
    still_serves()
    assert client.dataset("imgs").get_batch([7]) == [want[7]]


# ------------------------------------------------------ client counters


def test_trainers_report_their_local_hits_and_data_wait_to_the_node(daemon: DaemonProcess, tmp_path: Path) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 30, sizes=(1000,))
    add(daemon, "imgs", tmp_path / "imgs")
    stage(daemon, "imgs")
    with dq.connect(daemon.address, timeout=5) as first, dq.connect(daemon.address, timeout=5) as second:
        read_locally(first, first.dataset("imgs"), list(range(30)))
        ds = second.dataset("imgs")
        read_locally(second, ds, list(range(10)))
        second.report_stats()
        second.report_stats()  # cumulative: a repeated report adds nothing
        stats = daemon_stats(daemon)
        assert stats.clients == 1
        assert {r.tier: r.samples for r in stats.client_reads}["local"] == second.stats().samples["local"]
        expected = {t: first.stats().samples[t] + second.stats().samples[t] for t in first.stats().samples}
        expected_wait = first.stats().data_wait_seconds + second.stats().data_wait_seconds
    stats = daemon_stats(daemon)  # both reported again as they closed: counted, no longer clients
    assert stats.clients == 0
    assert {r.tier: r.samples for r in stats.client_reads} == expected
    assert {r.tier: r.bytes for r in stats.client_reads}["local"] == 1000 * expected["local"]
    assert stats.client_data_wait_seconds == pytest.approx(expected_wait)
    metrics = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert f'dataquay_client_reads_total{{tier="local"}} {float(expected["local"])}' in metrics
    assert "dataquay_client_data_wait_seconds_total" in metrics

    with cache_stub(daemon) as stub, pytest.raises(grpc.RpcError) as unnamed:
        stub.ReportClientStats(pb.ClientStatsReport())
    assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _read_and_exit(ds: dq.Dataset, ids: list[int]) -> None:
    ds.get_batch(ids)  # no close, no epoch: as a DataLoader worker, its counters go out as it ends


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_process_that_just_exits_has_its_reads_counted(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path, method: str
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 40, sizes=(1000,))
    add(daemon, "imgs", tmp_path / "imgs")
    stage(daemon, "imgs")
    ds = client.dataset("imgs")
    read_locally(client, ds, list(range(40)))
    client.report_stats()
    before = {r.tier: r.samples for r in daemon_stats(daemon).client_reads}["local"]
    ctx = multiprocessing.get_context(method)
    workers = [ctx.Process(target=_read_and_exit, args=(ds, list(range(k, 40, 2)))) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    stats = daemon_stats(daemon)
    assert {r.tier: r.samples for r in stats.client_reads}["local"] == before + 40
    assert {r.tier: r.bytes for r in stats.client_reads}["local"] == 1000 * (before + 40)


def test_batches_read_ahead_give_the_same_bytes_keep_the_cursor_and_stop_cleanly(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 50, sizes=(1500, 2500))
    add(daemon, "imgs", tmp_path / "imgs")
    ds = client.dataset("imgs")
    sampler = ds.sampler(seed=3)
    order = sampler.indices().tolist()
    expected = files_bytes(0, order, (1500, 2500))
    for read_ahead in (0, 1, 3):
        batches = list(ds.batches(sampler, 16, read_ahead=read_ahead))
        assert [len(b) for b in batches] == [16, 16, 16, 2]
        assert [s for b in batches for s in b] == expected
        assert sampler.position == 0
    epochs = client.stats().epochs
    assert [(e.epoch, e.batches) for e in epochs] == [(0, 4)] * 3
    assert all(0 < e.data_wait_seconds <= e.wall_seconds and 0 < e.stall_percent <= 100 for e in epochs)

    wait_until(
        lambda: not any(t.name == "dataquay-read-ahead" for t in threading.enumerate()),
        "the read ahead into the next epoch ended by itself",
    )
    threads = threading.active_count()
    reader = ds.batches(sampler, 16, read_ahead=2)
    next(reader)
    next(reader)
    assert sampler.state_dict()["position"] == 32
    reader.close()  # the training loop stopped early: the read-ahead thread goes too
    assert threading.active_count() == threads

    resumed = ds.sampler(seed=3)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(0)
    assert [s for b in ds.batches(resumed, 16) for s in b] == expected[32:]

    synthetic.make_files_dataset(tmp_path / "uncached", 50, sizes=(1500, 2500))
    add(daemon, "uncached", tmp_path / "uncached")
    fresh = client.dataset("uncached")
    (tmp_path / "uncached" / fresh.manifest.location(order[40]).path).unlink()
    got = []
    with pytest.raises(PfsReadError, match=f"sample {order[40]} of 'uncached'"):
        for batch in fresh.batches(fresh.sampler(seed=3), 16, read_ahead=2):
            got.append(batch)
    assert [s for b in got for s in b] == expected[:32]  # every batch before the broken one
    assert client.stats().data_wait_seconds > 0


def test_batches_read_the_next_epochs_first_batches_ahead_and_the_next_epoch_takes_them_over(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    synthetic.make_files_dataset(tmp_path / "imgs", 50, sizes=(1500, 2500))
    add(daemon, "imgs", tmp_path / "imgs")
    ds = client.dataset("imgs")
    sampler = ds.sampler(seed=3)

    def epoch(batch_size: int) -> list[bytes]:
        return [s for b in ds.batches(sampler, batch_size, read_ahead=2) for s in b]

    def reads_reach(count: int, what: str) -> None:
        wait_until(lambda: sum(client.stats().samples.values()) >= count, what)
        assert sum(client.stats().samples.values()) == count

    for e in range(2):
        sampler.set_epoch(e)
        assert epoch(16) == files_bytes(0, sampler.indices().tolist(), (1500, 2500))
        # Epoch e + 1's first 2 batches were read once epoch e's were all
        # handed out; epoch 1 took over those read during epoch 0.
        reads_reach(50 * (e + 1) + 32, f"epoch {e + 1}'s first batches were read ahead")
    # Another batch size drops them and reads the epoch from its start.
    sampler.set_epoch(2)
    assert epoch(10) == files_bytes(0, sampler.indices().tolist(), (1500, 2500))
    reads_reach(100 + 32 + 50 + 20, "epoch 3's first batches were read ahead")


def own_memfd_sizes() -> list[int]:
    """Bytes of each sealed memfd segment this process maps."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    spans = [line.split()[0].split("-") for line in lines if f"/memfd:dataquay-{os.getpid()} " in line]
    return [int(end, 16) - int(start, 16) for start, end in spans]


def test_a_rank_reads_its_first_batches_once_it_joins_a_job_of_a_known_batch_size(
    cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    local = cluster(1)
    synthetic.make_files_dataset(tmp_path / "imgs", 50, sizes=(1500, 2500))
    add(local.daemons[0], "imgs", tmp_path / "imgs")
    with dq.connect(local.daemons[0].address, timeout=10) as client:
        ds = client.dataset("imgs")
        sampler = ds.sampler(job="run-1", mode="global", batch_size=16, rank=0, world_size=1)
        # Nothing asked for yet: the first 2 batches are read in the background,
        # through one segment sized to a batch, not to DATAQUAY_SHM_BYTES.
        wait_until(lambda: sum(client.stats().samples.values()) == 32, "the first batches were read at join")
        assert own_memfd_sizes() == [MiB]
        assert [s for b in ds.batches(sampler, 16) for s in b] == files_bytes(
            0, sampler.indices().tolist(), (1500, 2500)
        )
        # The epoch took them over: 50 samples read, and epoch 1's first 32 ahead.
        wait_until(lambda: sum(client.stats().samples.values()) >= 82, "epoch 1's first batches were read ahead")
        assert sum(client.stats().samples.values()) == 82


def test_bad_read_settings_in_the_environment_are_named(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAQUAY_JOIN_READ_AHEAD", "two")
    with pytest.raises(ValueError, match="DATAQUAY_JOIN_READ_AHEAD='two': expected a number of batches"):
        join_read_ahead()
    monkeypatch.setenv("DATAQUAY_MISS_READS", "peers")
    with pytest.raises(ValueError, match="DATAQUAY_MISS_READS='peers': use client or daemon"):
        dq.connect(daemon.address, timeout=5).close()
