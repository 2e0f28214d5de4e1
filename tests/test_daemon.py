"""The daemon end to end over its gRPC API: real processes, LMDB and files."""

from __future__ import annotations

import grp
import mmap
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from dataquay.client.wire.channels import channel_options, grpc_target
from dataquay.client.wire.records import checksum
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess


def make_files(root: Path, n: int, size: int = 3000, seed: int = 0) -> list[bytes]:
    """n files in two class folders; returns their bytes in id order."""
    rng = np.random.default_rng(seed)
    payloads = []
    for i in range(n):
        folder = root / f"class{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        data = rng.integers(0, 256, size + i % 7, dtype=np.uint8).tobytes()
        (folder / f"{i:05d}.bin").write_bytes(data)
        payloads.append(data)
    # ids follow the sorted walk: class0's files, then class1's
    return [payloads[i] for i in range(0, n, 2)] + [payloads[i] for i in range(1, n, 2)]


def stub_for(daemon: DaemonProcess) -> cache_pb2_grpc.CacheStub:
    channel = grpc.insecure_channel(grpc_target(daemon.address), options=channel_options())
    return cache_pb2_grpc.CacheStub(channel)


def read(stub: cache_pb2_grpc.CacheStub, dataset: str, ids: list[int]) -> list[pb.Sample]:
    return [s for chunk in stub.Read(pb.ReadRequest(dataset=dataset, ids=ids)) for s in chunk.samples]


def stage(stub: cache_pb2_grpc.CacheStub, dataset: str) -> pb.StageProgress:
    *_, last = stub.Stage(pb.StageRequest(dataset=dataset))
    return last


def stats(stub: cache_pb2_grpc.CacheStub) -> pb.StatsReply:
    return stub.Stats(pb.StatsRequest())


@pytest.fixture
def pfs(tmp_path: Path) -> tuple[Path, list[bytes]]:
    root = tmp_path / "pfs" / "imgs"
    return root, make_files(root, 60)


def add(stub: cache_pb2_grpc.CacheStub, root: Path, name: str = "imgs") -> pb.DatasetInfo:
    return stub.AddDataset(pb.AddDatasetRequest(name=name, root=str(root)))


def staged(daemon: DaemonProcess, root: Path) -> cache_pb2_grpc.CacheStub:
    """Registers ``root`` as "imgs" on ``daemon`` and stages it."""
    stub = stub_for(daemon)
    add(stub, root)
    stage(stub, "imgs")
    return stub


def test_reads_come_from_pfs_then_from_cache_with_exact_bytes(
    daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = stub_for(daemon)
    info = add(stub, root)
    assert info.num_samples == len(payloads)
    assert info.total_bytes == sum(map(len, payloads))

    ids = list(range(len(payloads)))[::-1]
    first = read(stub, "imgs", ids)
    assert [s.id for s in first] == ids
    assert [s.data for s in first] == [payloads[i] for i in ids]
    assert all(s.tier == pb.TIER_PFS and s.checksum == checksum(s.data) for s in first)

    stage(stub, "imgs")  # flushes the inserts the reads queued
    second = read(stub, "imgs", ids + ids[:5])
    assert [s.data for s in second] == [payloads[i] for i in ids + ids[:5]]
    assert {s.tier for s in second} == {pb.TIER_CACHE}
    reads = {t.tier: t.samples for t in stats(stub).reads}
    assert reads[pb.TIER_PFS] == len(payloads)
    assert reads[pb.TIER_CACHE] == len(payloads) + 5


def test_stage_caches_everything_and_a_second_stage_reads_nothing(
    daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = stub_for(daemon)
    add(stub, root)
    first = stage(stub, "imgs")
    assert first.finished and not first.error
    assert first.done_samples == len(payloads) and first.skipped_samples == 0
    assert first.read_bytes == sum(map(len, payloads))
    second = stage(stub, "imgs")
    assert second.skipped_samples == len(payloads) and second.read_bytes == 0
    assert stats(stub).cache_entries == len(payloads)
    assert stats(stub).pfs_bytes == sum(map(len, payloads))


def test_bad_requests_get_clear_status_codes_and_the_daemon_keeps_serving(
    start_daemon: Callable[..., DaemonProcess], pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = stub_for(start_daemon("--max-batch", "16"))
    add(stub, root)
    cases = [
        (lambda: read(stub, "nope", [0]), grpc.StatusCode.NOT_FOUND, "unknown dataset 'nope'"),
        (
            lambda: read(stub, "imgs", [1, 60]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sample id 60 out of range for dataset 'imgs' (N=60)",
        ),
        (
            lambda: read(stub, "imgs", list(range(17))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch of 17 ids exceeds the limit of 16",
        ),
        (lambda: stage(stub, "nope"), grpc.StatusCode.NOT_FOUND, "unknown dataset"),
        (lambda: add(stub, root), grpc.StatusCode.ALREADY_EXISTS, "already registered"),
        (lambda: add(stub, root / "missing", "other"), grpc.StatusCode.INVALID_ARGUMENT, "missing"),
        (lambda: add(stub, root, "../evil"), grpc.StatusCode.INVALID_ARGUMENT, "bad dataset name"),
        (lambda: stub.GetDataset(pb.GetDatasetRequest(name="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: list(stub.GetManifest(pb.GetDatasetRequest(name="nope"))), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: stub.DropDataset(pb.DropDatasetRequest(name="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
        (
            lambda: list(stub.Read(pb.ReadRequest(dataset="imgs", ids=[0], manifest_id="0" * 32))),
            grpc.StatusCode.FAILED_PRECONDITION,
            "dataset 'imgs' was replaced since it was opened",
        ),
    ]
    for call, code, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code
        assert message in err.value.details()
        assert [s.data for s in read(stub, "imgs", [3])] == [payloads[3]]


def test_full_cache_stops_inserting_and_keeps_serving_correct_bytes(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    root = tmp_path / "big"
    payloads = make_files(root, 40, size=100_000)
    stub = stub_for(start_daemon("--cache-size", "1M"))
    add(stub, root, "big")
    progress = stage(stub, "big")
    assert progress.cache_full and not progress.error
    s = stats(stub)
    assert s.cache_full and 0 < s.cache_entries < len(payloads)
    samples = read(stub, "big", list(range(40)))
    assert [x.data for x in samples] == payloads
    tiers = [x.tier for x in samples]
    assert tiers.count(pb.TIER_CACHE) == s.cache_entries
    assert tiers.count(pb.TIER_PFS) == len(payloads) - s.cache_entries


def test_corrupt_cached_value_is_detected_served_from_pfs_and_repaired(
    start_daemon: Callable[..., DaemonProcess], pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    daemon = start_daemon()
    staged(daemon, root)
    assert daemon.stop() == 0

    data_file = daemon.cache_dir / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    # Besides the live value, pages an earlier transaction copied may hold a
    # stale one: every copy is flipped.
    at = raw.find(payloads[7][:64])
    assert at > 0
    while at >= 0:
        raw[at + 10] ^= 0xFF
        at = raw.find(payloads[7][:64], at + 1)
    data_file.write_bytes(raw)

    daemon.start()
    stub = stub_for(daemon)
    first = read(stub, "imgs", [7])[0]
    assert first.data == payloads[7] and first.tier == pb.TIER_PFS
    stage(stub, "imgs")  # waits for the queued repair to commit
    assert stats(stub).corrupt_repaired == 1
    again = read(stub, "imgs", [7])[0]
    assert again.data == payloads[7] and again.tier == pb.TIER_CACHE


def test_sigkilled_daemon_restarts_on_its_cache_with_every_entry(
    start_daemon: Callable[..., DaemonProcess], pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    daemon = start_daemon()
    staged(daemon, root)
    daemon.kill()
    daemon.start()
    stub = stub_for(daemon)
    assert stats(stub).cache_entries == len(payloads)
    samples = read(stub, "imgs", list(range(len(payloads))))
    assert [s.data for s in samples] == payloads
    assert {s.tier for s in samples} == {pb.TIER_CACHE}


def test_sigterm_drains_reads_in_flight_commits_their_writes_and_exits_zero(
    start_daemon: Callable[..., DaemonProcess], pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    # About 180 KB of misses at 60 KB/s: the reads are still at the PFS for seconds.
    daemon = start_daemon("--pfs-bandwidth", "60K")
    stub = stub_for(daemon)
    add(stub, root)
    half = len(payloads) // 2
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(read, stub, "imgs", ids) for ids in (list(range(half)), list(range(half, len(payloads))))]
        deadline = time.monotonic() + 20
        while stats(stub).pfs_bytes == 0:
            assert time.monotonic() < deadline, "the reads never reached the PFS"
            time.sleep(0.02)
        assert not any(call.done() for call in calls)
        daemon.signal(signal.SIGTERM)
        samples = [s for call in calls for s in call.result(timeout=30)]
    assert [s.data for s in samples] == payloads
    assert [s.checksum for s in samples] == [checksum(p) for p in payloads]
    assert {s.tier for s in samples} == {pb.TIER_PFS}
    assert daemon.process is not None and daemon.process.wait(30) == 0
    assert not daemon.socket.exists()

    daemon.start()
    assert stats(stub_for(daemon)).cache_entries == len(payloads)


def test_drop_frees_the_cache_and_unregisters(daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]) -> None:
    root, payloads = pfs
    stub = staged(daemon, root)
    reply = stub.DropDataset(pb.DropDatasetRequest(name="imgs"))
    assert reply.freed_samples == len(payloads)
    assert stats(stub).cache_entries == 0
    assert not stub.ListDatasets(pb.ListDatasetsRequest()).datasets


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cache-size", "lots"], "bad size 'lots'"),
        (["--cache-dir", "/dev/null/cache"], "cache dir /dev/null/cache cannot be created"),
        (["--pfs-threads", "0"], "--pfs-threads: bad value '0'"),
        (["--socket-group", "no-such-group-here"], "to group 'no-such-group-here'"),
        (["--token-file", "/nonexistent/token"], "cannot read the token file /nonexistent/token"),
        (["--tls-cert", "/nonexistent/cert.pem"], "a TLS certificate needs its key"),
    ],
)
def test_serve_config_errors_exit_nonzero_with_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    result = run_cli(
        "serve",
        "--socket",
        str(tmp_path / "s.sock"),
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0",
        "--state-dir",
        str(tmp_path / "state"),
        "--cache-dir",
        str(tmp_path / "cache"),
        *flags,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dataquay: error:") and message in lines[0]


def test_the_socket_is_for_its_owner_and_group_only(start_daemon: Callable[..., DaemonProcess]) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    daemon = start_daemon("--socket-group", group)
    mode = os.stat(daemon.socket)
    assert stat.S_IMODE(mode.st_mode) == 0o660 and mode.st_gid == os.getgid()


def test_serve_refuses_a_taken_port(daemon: DaemonProcess, tmp_path: Path) -> None:
    assert daemon.ready is not None
    result = run_cli(
        "serve",
        "--socket",
        str(tmp_path / "s.sock"),
        "--listen",
        daemon.ready["tcp"],
        "--metrics-port",
        "0",
        "--state-dir",
        str(tmp_path / "state"),
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert result.returncode == 1
    assert "cannot listen on" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_bad_bulk_listen(tmp_path: Path) -> None:
    result = run_cli(
        "serve",
        "--socket",
        str(tmp_path / "s.sock"),
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0",
        "--state-dir",
        str(tmp_path / "state"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--bulk-listen",
        "nowhere",
    )
    assert result.returncode == 1
    assert "bad --bulk-listen nowhere" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_dataset_commands(daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]) -> None:
    root, _ = pfs
    env = {"DATAQUAY_ADDR": daemon.address}
    added = run_cli("dataset", "add", "imgs", str(root), env=env)
    assert added.returncode == 0, added.stderr
    assert "60 samples" in added.stdout
    again = run_cli("dataset", "add", "imgs", str(root), env=env)
    assert again.returncode == 1 and "already registered" in again.stderr
    missing = run_cli("dataset", "add", "x", str(root / "nope"), env=env)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    staged = run_cli("stage", "imgs", "--quiet", env=env)
    assert staged.returncode == 0, staged.stderr
    assert "60/60 samples cached" in staged.stdout
    shown = run_cli("dataset", "show", "imgs", env=env)
    assert "samples      60" in shown.stdout and "cached       60 samples" in shown.stdout
    assert "imgs" in run_cli("dataset", "ls", env=env).stdout
    status = run_cli("status", env=env)
    assert status.returncode == 0 and "60 entries" in status.stdout and "pfs" in status.stdout
    dropped = run_cli("dataset", "drop", "imgs", env=env)
    assert dropped.returncode == 0 and "freed 60" in dropped.stdout
    nodaemon = run_cli("dataset", "ls", env={"DATAQUAY_ADDR": str(root / "none.sock")})
    assert nodaemon.returncode == 1 and "no daemon answers" in nodaemon.stderr


def test_payloads_go_through_the_callers_shared_memory_when_it_names_a_segment(
    daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = stub_for(daemon)
    add(stub, root)
    name = f"dataquay-{os.getpid()}-test"
    size = 64 * 1024
    path = Path("/dev/shm") / name
    with open(path, "wb+") as f:
        f.truncate(size)
        segment = mmap.mmap(f.fileno(), size)
    try:
        ids = [5, 0, 59, 5]
        request = pb.ReadRequest(dataset="imgs", ids=ids, shm_name=name, shm_size=size)
        reply = [s for c in stub.Read(request) for s in c.samples]
        assert all(s.in_shm and not s.data for s in reply)
        got = [bytes(segment[s.shm_offset : s.shm_offset + s.length]) for s in reply]
        assert got == [payloads[i] for i in ids]
        assert all(s.checksum == checksum(g) for s, g in zip(reply, got))

        many = list(range(30))  # 30 x ~3 KB does not fit in 64 KiB: the rest comes inline
        request = pb.ReadRequest(dataset="imgs", ids=many, shm_name=name, shm_size=size)
        reply = [s for c in stub.Read(request) for s in c.samples]
        assert any(s.in_shm for s in reply) and any(not s.in_shm for s in reply)
        got = [bytes(segment[s.shm_offset : s.shm_offset + s.length]) if s.in_shm else s.data for s in reply]
        assert got == [payloads[i] for i in many]

        for bad in ("../etc/passwd", "dataquay-1-nope", "other-1-x"):
            request = pb.ReadRequest(dataset="imgs", ids=[1], shm_name=bad, shm_size=size)
            reply = [s for c in stub.Read(request) for s in c.samples]
            assert not reply[0].in_shm and reply[0].data == payloads[1]
    finally:
        segment.close()
        path.unlink()


def test_a_segment_its_client_shrank_gets_inline_replies_and_the_daemon_serves_on(
    daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = stub_for(daemon)
    add(stub, root)
    name = f"dataquay-{os.getpid()}-shrunk"
    size = 64 * 1024
    path = Path("/dev/shm") / name
    path.write_bytes(b"")
    os.truncate(path, size)

    def read_via_segment(ids: list[int]) -> list[pb.Sample]:
        request = pb.ReadRequest(dataset="imgs", ids=ids, shm_name=name, shm_size=size)
        return [s for chunk in stub.Read(request) for s in chunk.samples]

    try:
        assert all(s.in_shm for s in read_via_segment([0, 1]))  # the daemon holds the segment now
        ids = list(range(10))  # ~30 KB, past the first page
        for shrunk_to in (4096, 0):
            os.truncate(path, shrunk_to)
            reply = read_via_segment(ids)
            assert not any(s.in_shm for s in reply)
            assert [s.data for s in reply] == [payloads[i] for i in ids]
        assert daemon.process is not None and daemon.process.poll() is None, daemon.log_tail()
        assert [s.data for s in read(stub, "imgs", [7, 59])] == [payloads[7], payloads[59]]
        os.truncate(path, size)
        assert all(s.in_shm for s in read_via_segment([3]))  # grown back: usable again
    finally:
        path.unlink()


def test_staging_interrupted_by_sigterm_resumes_where_it_stopped(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    root = tmp_path / "slow"
    payloads = make_files(root, 60, size=100_000)
    daemon = start_daemon("--pfs-bandwidth", "2M", "--pfs-threads", "2")
    stub = stub_for(daemon)
    add(stub, root, "slow")
    reports: list[pb.StageProgress] = []
    watcher = threading.Thread(target=lambda: reports.extend(stub.Stage(pb.StageRequest(dataset="slow"))))
    watcher.start()
    deadline = time.monotonic() + 20
    while not reports or reports[-1].done_samples == 0:
        assert time.monotonic() < deadline, "staging made no progress"
        time.sleep(0.05)
    stopped = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - stopped < 5, "shutdown waited for staging"
    watcher.join(10)
    assert reports and "shutting down" in reports[-1].error
    assert 0 < reports[-1].done_samples < len(payloads)

    daemon.start()
    stub = stub_for(daemon)
    resumed = stage(stub, "slow")
    assert not resumed.error and resumed.done_samples == len(payloads)
    assert resumed.skipped_samples > 0
    assert [s.data for s in read(stub, "slow", list(range(60)))] == payloads


def test_staging_skips_samples_the_pfs_will_not_give_and_names_them(
    daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = stub_for(daemon)
    info = add(stub, root)
    files = sorted(root.rglob("*.bin"), key=lambda p: (p.parent.name, p.name))
    files[7].unlink()
    files[40].write_bytes(b"short")

    progress = stage(stub, "imgs")
    assert not progress.error and progress.finished
    assert progress.failed_samples == 2
    assert progress.done_samples == info.num_samples - 2
    assert any(f"sample {i} of 'imgs': cannot read {files[i]}" in progress.first_failure for i in (7, 40))

    good = [i for i in range(len(payloads)) if i not in (7, 40)]
    assert [s.data for s in read(stub, "imgs", good)] == [payloads[i] for i in good]
    for bad, reason in ((7, "No such file"), (40, "changed since the dataset was registered")):
        with pytest.raises(grpc.RpcError) as err:
            read(stub, "imgs", [bad])
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert f"sample {bad} of 'imgs'" in err.value.details() and reason in err.value.details()

    cli = run_cli("stage", "imgs", "--quiet", env={"DATAQUAY_ADDR": daemon.address})
    assert cli.returncode == 1
    assert "58/60 samples cached" in cli.stdout
    assert cli.stderr.count("\n") == 1 and "2 samples of 'imgs' could not be read" in cli.stderr


def test_metrics_endpoint_exports_reads_cache_and_pfs_figures(
    daemon: DaemonProcess, pfs: tuple[Path, list[bytes]]
) -> None:
    root, payloads = pfs
    stub = staged(daemon, root)
    read(stub, "imgs", [0, 1, 2])
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    total = float(sum(map(len, payloads)))
    assert values['dataquay_reads_total{tier="cache"}'] == 3
    assert values['dataquay_read_bytes_total{tier="cache"}'] == sum(map(len, payloads[:3]))
    assert values["dataquay_pfs_read_bytes_total"] == total
    assert values["dataquay_pfs_errors_total"] == 0
    assert values["dataquay_cache_entries"] == len(payloads)
    assert 0 < values["dataquay_cache_bytes"] <= values["dataquay_cache_capacity_bytes"]
    assert values['dataquay_staging_samples{dataset="imgs"}'] == len(payloads)
    assert values['dataquay_request_seconds_count{method="Read"}'] == 1


def test_a_host_over_its_calls_in_flight_is_refused_and_local_clients_are_not(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    make_files(tmp_path / "slow", 20)
    daemon = start_daemon("--max-calls-per-peer", "2", "--pfs-bandwidth", "1K")  # staging takes a minute
    assert daemon.ready is not None
    add(stub_for(daemon), tmp_path / "slow", "slow")
    with grpc.insecure_channel(daemon.ready["tcp"], options=channel_options()) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        held = [stub.Stage(pb.StageRequest(dataset="slow")) for _ in range(2)]
        for call in held:
            next(call)  # both streams are open and in flight
        with pytest.raises(grpc.RpcError) as refused:
            stub.Info(pb.InfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many calls in flight from this host (at most 2)" in refused.value.details()
        assert stub_for(daemon).Info(pb.InfoRequest(), timeout=5).node  # the unix socket is not capped
        for call in held:
            call.cancel()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert stub.Info(pb.InfoRequest(), timeout=5).node
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)


def test_dataset_show_gives_an_npy_records_dtype_and_shape(daemon: DaemonProcess, tmp_path: Path) -> None:
    root = synthetic.make_npy_dataset(tmp_path / "frames", 12, record_shape=(3, 5), dtype="int16")
    env = {"DATAQUAY_ADDR": daemon.address}
    assert run_cli("dataset", "add", "frames", str(root), "--format", "npy", env=env).returncode == 0
    shown = run_cli("dataset", "show", "frames", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "record       dtype int16  shape (3, 5)" in shown.stdout.splitlines()
    info = stub_for(daemon).GetDataset(pb.GetDatasetRequest(name="frames"))
    assert (info.record_dtype, list(info.record_shape)) == ("int16", [3, 5])
