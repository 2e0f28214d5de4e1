"""``stage --job`` says, before staging, which caches cannot hold their share of
the job and what capacity would; staging goes on all the same."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import directory_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.cli import main as cli_main
from dataquay.server.planning.capacity import EXCHANGE_HEADROOM_BYTES, node_shares, within_room
from dataquay.server.sizes import format_bytes, parse_size
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset

NODES = 4
SAMPLES = 480
SIZES = (2000, 3100, 4500)
_SHORT = re.compile(
    r"^warning: node (node-\d): cache (.+?) cannot hold its share \((.+?)\)( plus the exchange's headroom)?; "
    r"--cache-size (\S+) would$"
)
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def readable_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def cluster_with_dataset(cluster: Callable[..., LocalCluster], tmp_path: Path, cache_size: str) -> LocalCluster:
    local = cluster(NODES, daemon_args=("--cache-size", cache_size))
    root = make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=SIZES)
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    return local


def stage(local: LocalCluster, capsys: pytest.CaptureFixture[str], job: str, *flags: str) -> tuple[str, list[str]]:
    """Stages "imgs" for ``job``; (stdout, the warning lines), and the command succeeded."""
    capsys.readouterr()
    code = cli_main(["stage", "imgs", "--job", job, "--quiet", "--directory", local.directory_address, *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out, [line for line in out.err.splitlines() if line.startswith("warning:")]


def expected_shares(local: LocalCluster, job_id: str) -> list[int]:
    """Each node's largest share of the job as the capacity model counts it, in node-rank order."""
    with grpc.insecure_channel(local.directory_address, options=channel_options()) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        job = stub.GetJob(jpb.GetJobRequest(job_id=job_id), timeout=10)
        manifest = Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name="imgs"))))
    return node_shares(job_plan(job, manifest), manifest.sample_length.astype(np.int64)).max(axis=0).tolist()


def test_caches_that_hold_the_share_but_not_the_exchange_are_named_with_the_size_that_would(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = cluster_with_dataset(cluster, tmp_path, "2M")
    out, warnings = stage(local, capsys, "still", "--mode", "global")
    assert warnings == [] and "480/480 samples cached" in out

    out, warnings = stage(local, capsys, "moving", "--mode", "partial", "--q", "0.25")
    assert "480/480 samples cached" in out
    named = [_SHORT.match(line) for line in warnings[:NODES]]
    assert [m.group(1) for m in named if m] == [f"node-{i}" for i in range(NODES)]
    for m, share in zip(named, expected_shares(local, "moving"), strict=True):
        assert m is not None and m.group(2) == "2.0 MiB" and m.group(4)
        assert m.group(3) == format_bytes(share)
        need = 1.05 * share + EXCHANGE_HEADROOM_BYTES
        assert need <= parse_size(m.group(5)) <= need + (1 << 20)
    assert len(warnings) == NODES + 1
    assert warnings[-1].startswith(f"warning: {NODES} of {NODES} nodes are short of cache")
    assert warnings[-1].endswith(f"--cache-size {max(m.group(5) for m in named if m)} on every node holds every share")


def test_caches_too_small_for_the_dataset_name_the_deficit_read_from_the_pfs_and_staging_goes_on(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = cluster_with_dataset(cluster, tmp_path, "400K")
    out, warnings = stage(local, capsys, "tight", "--mode", "local")
    assert all(_SHORT.match(line) and " plus the exchange's headroom" not in line for line in warnings[:NODES])
    assert len(warnings) == NODES + 2
    deficit = re.fullmatch(
        rf"warning: the {NODES} caches hold 1\.6 MiB in all, less than the (.+?) the dataset takes in them: "
        r"about (.+?) will be read from the PFS every epoch",
        warnings[-1],
    )
    assert deficit is not None
    dataset, read = readable_bytes(deficit.group(1)), readable_bytes(deficit.group(2))
    assert dataset - read == pytest.approx(1.6 * (1 << 20), abs=0.1 * (1 << 20))
    assert out.count("ok, cache full") == NODES


def test_q_leaving_stages_the_job_that_draws_q_over_one_minus_one_over_m(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = cluster_with_dataset(cluster, tmp_path, "64M")
    _, warnings = stage(local, capsys, "seed000", "--mode", "partial", "--q-leaving", "0.1875")
    assert warnings == []
    assert cli_main(["job", "show", "seed000", "--directory", local.directory_address]) == 0
    assert "q            0.25 drawn (0.1875 leave each node, Nguyen et al.'s Q)" in capsys.readouterr().out.splitlines()

    code = cli_main(
        [
            "stage",
            "imgs",
            "--job",
            "more",
            "--mode",
            "partial",
            "--q-leaving",
            "0.8",
            "--quiet",
            "--directory",
            local.directory_address,
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1
    assert "--q-leaving must be in (0, 0.75] with 4 nodes" in err


def test_a_short_cache_stages_reading_from_the_pfs_little_more_than_it_caches(
    cluster: Callable[..., LocalCluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Staging reads in the ranks' order only what the room left takes: what
    it read past a full cache would be read from the PFS for nothing. (The
    static modes spill what does not fit to other nodes' caches instead.)"""
    local = cluster(NODES, daemon_args=("--cache-size", "2M"))
    root = make_files_dataset(tmp_path / "pfs", 128, sizes=(120 << 10,))  # a share of 3.8 MB a node
    assert cli_main(["dataset", "add", "imgs", str(root), "--addr", local.daemons[0].address]) == 0
    out, _ = stage(local, capsys, "tight", "--mode", "partial", "--q", "1")
    rows = re.findall(r"^(node-\d+)\s+(\d+)/(\d+)\s+(\S+ \S+)\s+(\S+ \S+)\s", out, re.M)
    assert len(rows) == NODES and out.count("ok, cache full") == NODES
    for _node, cached, share, cached_bytes, read_bytes in rows:
        assert 0 < int(cached) < int(share)
        # Pages take more than the values: what fits by bytes is a few samples more than what fits.
        assert readable_bytes(cached_bytes) <= readable_bytes(read_bytes) <= 1.1 * readable_bytes(cached_bytes)


def test_staging_takes_the_first_samples_by_position_that_the_room_holds() -> None:
    position = np.array([5, 0, 3, 1, 4, 2], dtype=np.int64)
    charges = np.array([10, 10, 30, 10, 10, 20], dtype=np.int64)
    ids = np.array([0, 2, 3, 5], dtype=np.int64)  # by position: 3 (1), 5 (2), 2 (3), 0 (5)
    # The ones that fit, and the next: the cache finds itself full.
    assert within_room(ids, position, charges, 30).tolist() == [2, 3, 5]
    assert within_room(ids, position, charges, 59).tolist() == [2, 3, 5]
    assert within_room(ids, position, charges, 70).tolist() == [0, 2, 3, 5]
    assert within_room(ids, position, charges, 5).tolist() == [3]
    assert within_room(ids, position, charges, 0).tolist() == within_room(ids, position, charges, -5).tolist() == []
