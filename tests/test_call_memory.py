"""What one Read costs the daemon in memory: a repeated id is held once, a
reply is resolved a window at a time and sent as it is made, never held
whole. Peak memory is the daemon's VmHWM, reset just before the call."""

from __future__ import annotations

from pathlib import Path

import pytest
from one_daemon import add, cache_stub, reply_samples, stage

import dataquay.client as dq
from dataquay.protos import cache_pb2 as pb
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes

MiB = 1 << 20


def status_bytes(pid: int, key: str) -> int:
    """A /proc/PID/status figure (VmHWM, VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


class PeakGrowth:
    """The growth of a process's peak resident size over a block."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.bytes = 0

    def __enter__(self) -> PeakGrowth:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        self._before = status_bytes(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = status_bytes(self.pid, "VmHWM") - self._before


def daemon_pid(daemon: DaemonProcess) -> int:
    assert daemon.ready is not None
    return int(daemon.ready["pid"])


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "pfs"])
def test_a_read_of_many_repeats_of_one_sample_holds_it_about_once(
    daemon: DaemonProcess, tmp_path: Path, cached: bool
) -> None:
    size, repeats = 2 * MiB, 300  # 600 MiB asked for; before the fix the daemon grew by twice that
    make_files_dataset(tmp_path / "big", 2, sizes=(size,), classes=1)
    add(daemon, "big", tmp_path / "big")
    if cached:
        stage(daemon, "big")
    with cache_stub(daemon) as stub, PeakGrowth(daemon_pid(daemon)) as peak:
        samples = [s for chunk in stub.Read(pb.ReadRequest(dataset="big", ids=[1] * repeats)) for s in chunk.samples]
    assert [s.id for s in samples] == [1] * repeats
    want = sample_bytes(0, 1, size)
    assert all(s.data == want for s in samples)
    assert peak.bytes < 200 * MiB, f"the daemon grew by {peak.bytes / MiB:.0f} MiB for one sample of 2 MiB"


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "pfs"])
def test_a_read_of_many_repeats_of_a_sample_larger_than_a_message_holds_it_a_few_times_at_most(
    daemon: DaemonProcess, tmp_path: Path, cached: bool
) -> None:
    size, repeats = 70 * MiB, 12  # 840 MiB asked for, in pieces; before, the daemon grew by 1.2-2 GB
    make_files_dataset(tmp_path / "huge", 1, sizes=(size,), classes=1)
    add(daemon, "huge", tmp_path / "huge")
    if cached:
        stage(daemon, "huge")
    want = sample_bytes(0, 0, size)
    count = 0
    with cache_stub(daemon) as stub, PeakGrowth(daemon_pid(daemon)) as peak:
        for sample in reply_samples(stub.Read(pb.ReadRequest(dataset="huge", ids=[0] * repeats))):
            assert sample.id == 0 and sample.data == want
            count += 1
    assert count == repeats
    assert peak.bytes < 6 * size, f"the daemon grew by {peak.bytes / MiB:.0f} MiB for one sample of 70 MiB"


def test_a_batch_over_several_windows_comes_back_exact_and_in_order_through_shared_memory(
    daemon: DaemonProcess, client: dq.Client, tmp_path: Path
) -> None:
    size = 3 * MiB  # 50 samples: three windows, more than the client's segment holds
    make_files_dataset(tmp_path / "wide", 50, sizes=(size,), classes=1, seed=2)
    add(daemon, "wide", tmp_path / "wide")
    ids = [49, *range(48), 0, 49, 7, 7]
    assert client.dataset("wide").get_batch(ids) == [sample_bytes(2, i, size) for i in ids]
