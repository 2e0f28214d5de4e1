"""Coordinated prep with real processes: members on one daemon get the same
prepped batches, every sample once per epoch, each batch prepped once; members
killed, stopped or slow; the group in status and metrics; shared memory freed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from one_daemon import add, daemon_stats
from polling import wait_until
from prep_member import digest, prep
from stopping import stopped

import dataquay.client as dq
from dataquay.client.errors import JobMismatchError
from dataquay.client.prepped import collate
from dataquay.client.wire.shm import SHM_DIR
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

SAMPLES = 90
BATCH = 4
BATCHES = -(-SAMPLES // BATCH)
MEMBER = Path(__file__).with_name("prep_member.py")


@pytest.fixture
def dataset(daemon: DaemonProcess, tmp_path: Path) -> str:
    root = synthetic.make_files_dataset(tmp_path / "pfs", SAMPLES, sizes=(4096, 1000), seed=3)
    add(daemon, "ds", root)
    return "ds"


@pytest.fixture
def keys(tmp_path: Path, dataset: str) -> dict[int, int]:
    """Sample id by the key prep takes from its first bytes."""
    sizes = (4096, 1000)
    return {int(np.frombuffer(synthetic.sample_bytes(3, i, sizes[i % 2])[:8], "<u8")[0]): i for i in range(SAMPLES)}


@dataclass
class Member:
    process: subprocess.Popen[bytes]
    out: Path

    def lines(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.endswith("}")]

    def batches(self, epoch: int | None = None) -> list[dict[str, Any]]:
        return [line for line in self.lines() if "digest" in line and epoch in (None, line["epoch"])]

    def done(self) -> dict[str, Any] | None:
        return next((line for line in self.lines() if line.get("done")), None)


@pytest.fixture
def start_member(daemon: DaemonProcess, dataset: str, tmp_path: Path) -> Iterator[Callable[..., Member]]:
    started: list[Member] = []

    def start(*args: str, group: str = "sweep") -> Member:
        out = tmp_path / f"member{len(started)}.jsonl"
        command = [
            sys.executable,
            str(MEMBER),
            "--addr",
            daemon.address,
            "--dataset",
            dataset,
            "--group",
            group,
            "--batch-size",
            str(BATCH),
            "--out",
            str(out),
            *args,
        ]
        member = Member(subprocess.Popen(command), out)
        started.append(member)
        return member

    yield start
    for member in started:
        if member.process.poll() is None:
            member.process.send_signal(signal.SIGCONT)
            member.process.kill()
        member.process.wait()


def finished(member: Member) -> dict[str, Any]:
    assert member.process.wait(timeout=60) == 0
    done = member.done()
    assert done is not None
    return done


def samples_of(member: Member, keys: dict[int, int], epoch: int) -> list[int]:
    return sorted(keys[k] for line in member.batches(epoch) for k in line["keys"])


def digests(member: Member) -> list[tuple[object, object, object]]:
    return [(line["epoch"], line["index"], line["digest"]) for line in member.batches()]


def prep_segments(daemon: DaemonProcess) -> list[str]:
    """The prepped batches of the groups ``daemon`` keeps."""
    assert daemon.process is not None
    return [name for name in os.listdir(SHM_DIR) if name.startswith(f"dataquay-prep-{daemon.process.pid}-")]


@pytest.mark.parametrize("workers", [1, 3])
def test_a_group_of_one_yields_what_a_plain_loader_would(client: dq.Client, dataset: str, workers: int) -> None:
    ds = client.dataset(dataset)
    with ds.coordinated(group="solo", jobs=1, prep=prep, batch_size=BATCH, seed=5, workers=workers) as loader:
        loader.set_epoch(1)
        got: list[Any] = list(loader)
        assert loader.prepped_here == BATCHES == len(loader)
        expected: list[Any] = [
            collate([prep(sample) for sample in ds.get_batch(loader.batch_ids(i))]) for i in range(BATCHES)
        ]
    assert [digest(b) for b in got] == [digest(b) for b in expected]
    assert sorted(int(k) for keys, _ in got for k in keys) == sorted(int(k) for keys, _ in expected for k in keys)
    assert len({int(k) for keys, _ in got for k in keys}) == SAMPLES


def test_members_get_identical_batches_every_sample_once_and_prep_each_batch_once(
    start_member: Callable[..., Member], keys: dict[int, int], daemon: DaemonProcess
) -> None:
    members = [start_member("--jobs", "3", "--epochs", "2", "--workers", str(workers)) for workers in (1, 2, 3)]
    done = [finished(m) for m in members]
    for member in members:
        for epoch in (0, 1):
            assert samples_of(member, keys, epoch) == list(range(SAMPLES))
        assert digests(member) == digests(members[0])
    assert sum(d["prepped_here"] for d in done) == 2 * BATCHES
    assert all(d["prepped_here"] for d in done)
    assert prep_segments(daemon) == []


def test_a_member_killed_mid_epoch_is_dropped_and_the_others_finish(
    start_member: Callable[..., Member], keys: dict[int, int], daemon: DaemonProcess
) -> None:
    members = [start_member("--jobs", "3", "--step", "0.05", "--timeout", "30") for _ in range(3)]
    victim = members[2]
    wait_until(lambda: len(victim.batches()) >= 3, "the member to kill consumed 3 batches")
    victim.process.kill()
    victim.process.wait()
    for member in members[:2]:
        finished(member)
        assert samples_of(member, keys, 0) == list(range(SAMPLES))
        assert digests(member) == digests(members[0])
    wait_until(lambda: not daemon_stats(daemon).prep_groups, "the group ended once its members left")
    assert prep_segments(daemon) == []


def test_a_stopped_member_is_dropped_after_the_timeout_and_goes_on_alone(
    start_member: Callable[..., Member], keys: dict[int, int], daemon: DaemonProcess
) -> None:
    members = [start_member("--jobs", "3", "--step", "0.05", "--timeout", "2") for _ in range(3)]
    late = members[2]
    wait_until(lambda: len(late.batches()) >= 2, "the member to stop consumed 2 batches")
    with stopped(late.process.pid, daemon.cache_dir):
        for member in members[:2]:
            finished(member)
            assert samples_of(member, keys, 0) == list(range(SAMPLES))
    done = finished(late)
    assert done["prepped_here"]
    assert samples_of(late, keys, 0) == list(range(SAMPLES))
    assert digests(late) == digests(members[0])  # prep is deterministic: alone, the same bytes
    assert prep_segments(daemon) == []


def test_a_member_that_comes_mid_epoch_preps_it_alone_and_joins_the_next(
    start_member: Callable[..., Member], keys: dict[int, int], daemon: DaemonProcess
) -> None:
    common = ("--jobs", "2", "--epochs", "2", "--step", "0.05", "--timeout", "30")
    first = [start_member(*common) for _ in range(2)]
    wait_until(lambda: len(first[0].batches(0)) >= 3, "the first members consumed 3 batches")
    late = start_member(*common)
    done = [finished(member) for member in (*first, late)]
    for member in (*first, late):
        for epoch in (0, 1):
            assert samples_of(member, keys, epoch) == list(range(SAMPLES))
        assert digests(member) == digests(first[0])
    assert sum(d["prepped_here"] for d in done) == 3 * BATCHES  # epoch 0 twice, 1 once
    assert prep_segments(daemon) == []


def test_members_go_on_alone_when_the_daemon_dies_and_the_next_daemon_removes_the_batches_left(
    start_member: Callable[..., Member],
    keys: dict[int, int],
    daemon: DaemonProcess,
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    members = [start_member("--jobs", "2", "--step", "0.05", "--timeout", "30") for _ in range(2)]
    wait_until(lambda: len(members[0].batches()) >= 3, "the members consumed 3 batches")
    daemon.kill()
    for member in members:
        finished(member)
        assert samples_of(member, keys, 0) == list(range(SAMPLES))
        assert digests(member) == digests(members[0])
    start_daemon(name="node1")
    wait_until(lambda: not prep_segments(daemon), "the next daemon removed the dead one's prepped batches")


def test_a_slow_member_holds_the_group_within_its_memory_budget(
    start_member: Callable[..., Member], keys: dict[int, int], daemon: DaemonProcess
) -> None:
    budget = 3 * 4 * 1100  # about three batches of prepped floats
    common = ("--jobs", "2", "--memory", str(budget), "--timeout", "30")
    fast, slow = start_member(*common), start_member(*common, "--step", "0.03")
    staged: list[int] = []

    def sample_stats() -> bool:
        staged.extend(g.staged_bytes for g in daemon_stats(daemon).prep_groups)
        return fast.process.poll() is not None

    wait_until(sample_stats, "the fast member finished")
    for member in (fast, slow):
        finished(member)
        assert samples_of(member, keys, 0) == list(range(SAMPLES))
    assert digests(fast) == digests(slow)
    assert staged and max(staged) <= budget + 2 * 4 * 1100  # what two members may prep past it at once


def test_status_and_metrics_show_the_group(start_member: Callable[..., Member], daemon: DaemonProcess) -> None:
    members = [start_member("--jobs", "2", "--step", "0.2", "--timeout", "30", group="sweep-7") for _ in range(2)]
    wait_until(
        lambda: any(g.members == 2 and g.prepped_total >= 2 for g in daemon_stats(daemon).prep_groups),
        "the group has two members and prepped batches",
    )
    shown = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "status", "--addr", daemon.address],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    row = next(line for line in shown.splitlines() if line.startswith("sweep-7"))
    assert row.split()[1:3] == ["ds", "0"] and row.split()[3] == "2"
    with urllib.request.urlopen(daemon.metrics_url) as reply:
        metrics = reply.read().decode()
    assert 'dataquay_prep_members{group="sweep-7"} 2.0' in metrics
    assert 'dataquay_prep_batches_prepped_total{group="sweep-7"}' in metrics
    for member in members:
        member.process.kill()


def test_a_member_with_other_settings_is_refused_by_name(client: dq.Client, dataset: str) -> None:
    ds = client.dataset(dataset)
    with ds.coordinated(group="g", jobs=1, prep=prep, batch_size=BATCH, timeout=30) as first:
        for _ in first:  # the group exists once its first member has a batch
            other = ds.coordinated(group="g", jobs=1, prep=prep, batch_size=BATCH + 1, timeout=30)
            mismatch = "prep group 'g' has another batch_size than this member"
            with pytest.raises(JobMismatchError, match=mismatch) as refused:
                next(iter(other))
            assert str(BATCH) not in str(refused.value)  # which field, never the group's value
            other.close()
            break


def test_the_torch_adapter_yields_tensors_of_the_batches(client: dq.Client, dataset: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: the adapter needs it")
    from dataquay.client.torch import TorchCoordinated

    ds = client.dataset(dataset)
    with ds.coordinated(group="t", jobs=1, prep=prep, batch_size=BATCH) as loader:
        batches = list(torch.utils.data.DataLoader(TorchCoordinated(loader), batch_size=None))
        assert len(batches) == BATCHES
        keys, pixels = batches[0]
        assert isinstance(pixels, torch.Tensor) and pixels.shape == (BATCH, 256) and keys.shape == (BATCH,)
        expected = [prep(s) for s in ds.get_batch(loader.batch_ids(0))]
        assert torch.equal(pixels, torch.from_numpy(np.stack([e[1] for e in expected])))
