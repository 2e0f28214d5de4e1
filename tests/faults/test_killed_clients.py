"""Trainer-side processes killed with SIGKILL while they read: a client in
the middle of a large get_batch, and one of the DataLoader workers a trainer
forked. The daemon must neither notice more than a cancelled call nor keep
what the dead process left, and everyone else must read on unharmed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import xxhash
from checker import pfs_digests
from faultjob import DATASET, JOB, NODES, RANKS_PER_NODE, SAMPLES, FaultJob
from open_files import open_files
from polling import wait_until

import dataquay.client as dq
from dataquay.client.dataset import Dataset
from dataquay.server.tools.processes import DaemonProcess
from dataquay.server.tools.synthetic import make_files_dataset

#: A dataset no job stages: every first read of it is a PFS read at the daemon's cap.
BIG = "big"
BIG_SAMPLES = 24
BIG_SIZE = 100_000
#: The daemons' PFS cap: a get_batch of all of BIG takes over a second.
PFS_CAP = ("--pfs-bandwidth", "2M")

#: The killed client: reads one sample (so the daemon opens its segment and
#: the client unlinks its name), says so, then reads the rest of BIG in one
#: call that its SIGKILL interrupts. With ``--first`` it skips the warm-up.
CLIENT = """
import sys
import dataquay.client as dq

ds = dq.connect().dataset(sys.argv[1])
ids = list(range(len(ds)))
if sys.argv[2] != "--first":
    ds.get_batch(ids[:1])
    ids = ids[1:]
print("reading", flush=True)
ds.get_batch(ids)
print("done", flush=True)
"""


def add_big(local_address: str, root: Path) -> np.ndarray:
    """Writes and registers BIG; returns the xxh3 of its files."""
    make_files_dataset(root, BIG_SAMPLES, sizes=(BIG_SIZE,), seed=5)
    added = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "dataset", "add", BIG, str(root), "--addr", local_address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    return pfs_digests(root)


def kill_mid_read(address: str, *, first: bool) -> int:
    """Starts a client of the daemon at ``address``, SIGKILLs it inside its
    large read of BIG, checks that the read had not finished; returns its pid."""
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, BIG, "--first" if first else "--warm"],
        env={**os.environ, "DATAQUAY_ADDR": address},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    try:
        assert client.stdout.readline() == "reading\n", "the client failed before its read"
        # The read takes over a second at the PFS cap: this lands in its middle.
        time.sleep(0.3)
    finally:
        client.kill()
        client.wait()
    assert client.stdout.read() == "", "the read finished before the kill"
    client.stdout.close()
    return client.pid


def segment_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"dataquay-{pid}-")]


def open_segments(daemon: DaemonProcess, pid: int) -> list[str]:
    """The segments of process ``pid`` that the daemon holds open (a sealed
    memfd, or a file under /dev/shm)."""
    assert daemon.process is not None
    return [
        target
        for target in open_files(daemon.process.pid)
        if f"/memfd:dataquay-{pid} " in target or f"/dataquay-{pid}-" in target
    ]


def test_a_client_killed_mid_read_is_cleaned_up_and_the_job_reads_on(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("global", daemon_args=PFS_CAP)
    job.stage()
    daemon = job.local.daemons[0]
    want = add_big(daemon.address, job.work_dir / "big")
    killed: list[int] = []

    with job.ranks() as group:
        job.check(0, group.epoch(0))
        job.check(1, group.epoch(1, mid=lambda: killed.append(kill_mid_read(daemon.address, first=False))))
        job.check(2, group.epoch(2))

    assert daemon.process is not None and daemon.process.poll() is None, daemon.log_tail()
    with dq.connect(daemon.address) as client:
        got = client.dataset(BIG).get_batch(range(BIG_SAMPLES))
    assert [xxhash.xxh3_64_intdigest(x) for x in got] == want.tolist()
    # Its segment was a sealed memfd, never a name; the daemon's mapping goes
    # with the segment's connection.
    assert segment_files(killed[0]) == []
    closed = wait_until(lambda: not open_segments(daemon, killed[0]), "the daemon closed the killed client's segment")
    for epoch in range(3):
        assert set(job.tiers[epoch]) == {"local", "peer"} and sum(job.tiers[epoch].values()) == SAMPLES
    job.report(
        "SIGKILL a client mid-get_batch (warm segment)",
        "the daemon kept serving; segment unmapped as its connection ended; job exact",
        None,
        segment_closed_after_seconds=round(closed, 2),
    )


def test_a_client_killed_in_its_first_read_leaves_no_segment_behind(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon(*PFS_CAP)
    add_big(daemon.address, tmp_path / "big")
    pid = kill_mid_read(daemon.address, first=True)
    # The daemon mapped the segment before the first reply: it unmaps it as
    # the segment's connection ends, and no name is left in /dev/shm.
    try:
        wait_until(
            lambda: not segment_files(pid) and not open_segments(daemon, pid),
            "the segment's name and open file are gone",
        )
    finally:
        for name in segment_files(pid):
            (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_a_new_client_removes_the_segments_of_its_users_dead_processes(daemon: DaemonProcess) -> None:
    # A client killed before the daemon ever saw its segment: only a client
    # of the same user knows to remove it.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    stale = Path("/dev/shm") / f"dataquay-{dead}-0123456789abcdef"
    stale.write_bytes(b"")
    try:
        with dq.connect(daemon.address):
            assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


# ------------------------------------------------------- DataLoader workers


def read_slice(ds: Dataset, ids: list[int], digests: np.ndarray, out: Connection, rounds: int) -> None:
    """A DataLoader worker: reads its slice ``rounds`` times (0: until killed)
    through the client its parent created, announcing each read and sending
    the number of samples whose bytes differ from their file's."""
    done = 0
    while rounds == 0 or done < rounds:
        out.send(("start", done))
        got = ds.get_batch(ids)
        out.send(("end", sum(xxhash.xxh3_64_intdigest(x) != int(digests[i]) for i, x in zip(ids, got))))
        done += 1
    out.close()


def messages(conn: Connection) -> Iterator[tuple[str, int]]:
    while conn.poll():
        try:
            yield conn.recv()
        except EOFError:
            return


@dataclass
class WorkerKill:
    """What the trainer of the DataLoader scenario saw."""

    victim_pid: int = 0
    #: Nothing came from the victim after it announced the read it was killed in.
    died_mid_read: bool = False
    exit_codes: list[int | None] = field(default_factory=list)
    #: Per slice, the samples with wrong bytes in each read (the victim's slice: its replacement's reads).
    wrong: dict[int, list[int]] = field(default_factory=dict)
    parent_wrong: int = -1
    parent_tiers: dict[str, int] = field(default_factory=dict)


def test_a_killed_dataloader_worker_harms_neither_its_parent_nor_its_siblings(
    fault_job: Callable[..., FaultJob],
) -> None:
    job = fault_job("global")
    job.stage()
    ctx = multiprocessing.get_context("fork")
    slices = [list(range(k, SAMPLES, 3)) for k in range(3)]
    victim = 1
    seen = WorkerKill()

    def wrong(ids: Sequence[int], samples: list[bytes]) -> int:
        return sum(xxhash.xxh3_64_intdigest(x) != int(job.digests[i]) for i, x in zip(ids, samples))

    def kill_a_worker() -> None:
        """Node 0's trainer forks three workers reading through its client
        (misses are peer reads for the job), one is SIGKILLed as it starts a
        read, the others and the parent read on, and a replacement reads
        the dead worker's slice."""
        with dq.connect(job.local.daemons[0].address) as client:
            ds = client.dataset(DATASET)
            ds.sampler(job=JOB, rank=0, world_size=NODES * RANKS_PER_NODE)
            pipes = [ctx.Pipe(duplex=False) for _ in slices]
            workers = [
                ctx.Process(target=read_slice, args=(ds, ids, job.digests, send, 0 if k == victim else 5))
                for k, (ids, (_, send)) in enumerate(zip(slices, pipes))
            ]
            try:
                for w in workers:
                    w.start()
                for _, send in pipes:
                    send.close()
                starts = 0
                while starts < 3:
                    assert pipes[victim][0].poll(30), "the worker stopped reading"
                    kind, _ = pipes[victim][0].recv()
                    starts += kind == "start"
                pid = workers[victim].pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                workers[victim].join(10)
                seen.victim_pid = pid
                seen.died_mid_read = not list(messages(pipes[victim][0]))
                before = client.stats().samples
                seen.parent_wrong = wrong(range(SAMPLES), ds.get_batch(range(SAMPLES)))
                seen.parent_tiers = {t: n - before[t] for t, n in client.stats().samples.items() if n > before[t]}
                recv, send = ctx.Pipe(duplex=False)
                workers.append(ctx.Process(target=read_slice, args=(ds, slices[victim], job.digests, send, 2)))
                workers[-1].start()
                send.close()
                for w in workers:
                    w.join(30)
                seen.exit_codes = [w.exitcode for w in workers]
                seen.wrong = {k: [n for kind, n in messages(pipes[k][0]) if kind == "end"] for k in range(3)}
                seen.wrong[victim] = [n for kind, n in messages(recv) if kind == "end"]
            finally:
                for w in workers:
                    if w.is_alive():
                        w.kill()
                        w.join()

    with job.ranks() as group:
        job.check(0, group.epoch(0))
        job.check(1, group.epoch(1, mid=kill_a_worker))
        job.check(2, group.epoch(2))

    assert seen.exit_codes == [0, -signal.SIGKILL, 0, 0], seen
    # Every read of the surviving workers (5 each), of the replacement (2)
    # and of the parent had every sample's bytes right.
    assert seen.wrong == {0: [0] * 5, 1: [0] * 2, 2: [0] * 5} and seen.parent_wrong == 0, seen
    # The parent's misses, like its workers', went through the daemon to the
    # peers (its stats count its forked workers' reads too, read meanwhile).
    assert set(seen.parent_tiers) == {"local", "peer"} and sum(seen.parent_tiers.values()) >= SAMPLES, seen
    assert segment_files(seen.victim_pid) == []
    for epoch in range(3):
        assert set(job.tiers[epoch]) == {"local", "peer"} and sum(job.tiers[epoch].values()) == SAMPLES
    job.report(
        "SIGKILL a forked DataLoader worker mid-read",
        "parent, siblings and a replacement worker read right bytes; job exact",
        None,
        died_mid_read=seen.died_mid_read,
        parent_tiers=seen.parent_tiers,
    )
