"""Load: 64 clients (8 processes x 8 threads) reading random batches from one
daemon through its Read RPC, over shared memory, the unix socket and TCP,
a quarter of the ids not cached; every byte checked against the PFS files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dataquay.server.cli import build_parser
from dataquay.server.tools.load_results import LoadResult
from dataquay.server.tools.load_worker import TRANSPORTS
from dataquay.server.tools.loadgen import LoadSettings, file_checksums, partial_cache_size, register_and_stage, run_load
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

SAMPLES = 1024
SIZES = (1 << 10, 8 << 10, 32 << 10)
#: Generous, since the allocator's high-water mark moves by MiBs under 64 clients;
#: a run reads 1,000+ batches of about 0.4 MB, so leaking even a tenth of each
#: batch's bytes would cross it.
RSS_GROWTH_BOUND = 48 << 20


def _load(start_daemon: Callable[..., DaemonProcess], tmp_path: Path, seconds: float) -> LoadResult:
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    capacity = partial_cache_size([SIZES[i % len(SIZES)] for i in range(SAMPLES)], 0.75)
    daemon = start_daemon("--cache-size", str(capacity))
    assert daemon.ready is not None
    staged = register_and_stage(daemon.address, "load", root)
    assert 0 < staged.done_samples < SAMPLES and staged.cache_full
    settings = LoadSettings("load", daemon.address, daemon.ready["tcp"], processes=8, threads=8, seconds=seconds)
    return run_load(settings, file_checksums(root), int(daemon.ready["pid"]), progress=False)


def _assert_served_right_with_flat_memory(result: LoadResult, seconds: float) -> None:
    assert result.errors == {}, result.error_examples
    total = result.total
    assert total.clients == 64 and set(result.by_transport) == set(TRANSPORTS)
    assert total.samples > 0 and total.verified == total.samples
    assert all(f.verified > 0 for f in result.by_transport.values())
    assert result.tiers.get("cache", 0) > 0 and result.tiers.get("pfs", 0) > 0
    assert 0 < total.p50_ms <= total.p99_ms <= total.max_ms
    assert total.samples_per_s > 0 and total.mb_per_s > 0
    assert len([s for s in result.rss if s.t >= result.warmup_seconds]) >= seconds / 2
    assert result.rss_anon_growth < RSS_GROWTH_BOUND, result.rss
    assert result.vm_rss_growth < RSS_GROWTH_BOUND, result.rss


@pytest.mark.long
def test_64_clients_for_10_s_get_every_byte_right_and_the_daemon_memory_stays_flat(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    _assert_served_right_with_flat_memory(_load(start_daemon, tmp_path, 10.0), 10.0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_64_clients_for_60_s_get_every_byte_right_and_the_daemon_memory_stays_flat(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    _assert_served_right_with_flat_memory(_load(start_daemon, tmp_path, 60.0), 60.0)


def test_bytes_that_differ_from_the_pfs_files_are_counted_as_errors_not_verified(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    root = make_files_dataset(tmp_path / "pfs", 64, sizes=(512,))
    daemon = start_daemon()
    assert daemon.ready is not None
    register_and_stage(daemon.address, "load", root)
    wrong = file_checksums(root) ^ np.uint64(1)
    settings = LoadSettings("load", daemon.address, daemon.ready["tcp"], processes=1, threads=3, seconds=1.0)
    result = run_load(settings, wrong, int(daemon.ready["pid"]), progress=False)
    assert result.total.samples > 0 and result.total.verified == 0
    assert result.errors == {"wrong bytes": result.total.samples}


def test_file_checksums_follow_the_manifest_id_order(tmp_path: Path) -> None:
    from dataquay.client.wire.records import checksum
    from dataquay.server.tools.synthetic import sample_bytes

    root = make_files_dataset(tmp_path / "pfs", 25, sizes=(100, 300), classes=3)
    (root / ".DS_Store").write_bytes(b"not a sample")
    expected = [checksum(sample_bytes(0, i, (100, 300)[i % 2])) for i in range(25)]
    assert file_checksums(root).tolist() == expected


def test_bench_load_is_a_subcommand_and_plain_bench_still_runs_the_stall_benchmark() -> None:
    parser = build_parser()
    plain = parser.parse_args(["bench", "--quick"])
    assert plain.func.__name__ == "cmd_bench" and plain.quick and plain.out == "bench/results"
    load = parser.parse_args(["bench", "load", "--seconds", "10", "--processes", "2", "--threads", "4"])
    assert load.func.__name__ == "cmd_load"
    assert (load.seconds, load.processes, load.threads, load.out) == (10.0, 2, 4, "bench/results")
    assert parser.parse_args(["bench", "--out", "elsewhere", "load"]).out == "elsewhere"
