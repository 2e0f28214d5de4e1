"""What a rank process's first read costs, step by step.

Setup: a directory and two daemons on loopback, a files dataset of 1,024
samples of 64 KiB (the quick stall bench's size) staged for a ``global`` job
over both nodes with batches of 16. Each round starts a fresh process (this
file with ``--rank ADDRESS``) that connects to node 0 as rank 0 of 2 and
times, one after the other:

- connect: ``dq.connect`` (channel, Info);
- open: ``client.dataset`` (the manifest);
- join: ``ds.sampler(job=...)`` (the job's plan);
- segment 64 MiB / segment 1 MiB: a sealed memfd segment of that size made and
  handed to the daemon, then closed (what the first read of a process made
  before / makes now);
- first read, second read: ``ds.get_batch`` of 16 ids node 1 owns (peer hits),
  outside the sampler's first batches.

Run it with ``PYTHONPATH`` naming another tree's ``client`` and ``server`` to
time that tree's client. Medians of ROUNDS rounds, in milliseconds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 7
STEPS = ("connect", "open", "join", "segment 64 MiB", "segment 1 MiB", "first read", "second read")


def rank(address: str) -> None:
    import dataquay.client as dq
    from dataquay.client.wire.memfd import MemfdSegment, daemon_socket_of, fd_socket_path

    times: dict[str, float] = {}
    started = time.perf_counter()

    def step(name: str) -> None:
        nonlocal started
        now = time.perf_counter()
        times[name] = (now - started) * 1e3
        started = now

    client = dq.connect(address, timeout=30)
    step("connect")
    ds = client.dataset("first")
    step("open")
    sampler = ds.sampler(job="first", rank=0, world_size=2)
    step("join")
    fd_socket = fd_socket_path(daemon_socket_of(address) or "")
    for size, name in ((64 << 20, "segment 64 MiB"), (1 << 20, "segment 1 MiB")):
        MemfdSegment(size, fd_socket, "").close()
        step(name)
    first = set(sampler.indices()[:64].tolist())
    theirs = [int(i) for i in (sampler.owners(0) == 1).nonzero()[0] if int(i) not in first]
    ds.get_batch(theirs[:16])
    step("first read")
    ds.get_batch(theirs[16:32])
    step("second read")
    client.close()
    print(json.dumps(times))


def main() -> None:
    import grpc

    import dataquay.client as dq
    from dataquay.client.wire.channels import grpc_target
    from dataquay.protos import cache_pb2 as pb
    from dataquay.protos import cache_pb2_grpc
    from dataquay.server.tools import synthetic
    from dataquay.server.tools.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        synthetic.make_files_dataset(base / "pfs", 1024, sizes=(64 << 10,))
        with LocalCluster(base / "cluster", 2, dataset_roots=(base,)) as local:
            address = local.daemons[0].address
            with grpc.insecure_channel(grpc_target(address)) as channel:
                cache_pb2_grpc.CacheStub(channel).AddDataset(pb.AddDatasetRequest(name="first", root=str(base / "pfs")))
            with dq.connect(address, timeout=30) as client:
                client.dataset("first").sampler(job="first", mode="global", batch_size=16, rank=0, world_size=2)
            for daemon in local.daemons:
                with grpc.insecure_channel(grpc_target(daemon.address)) as channel:
                    *_, staged = cache_pb2_grpc.CacheStub(channel).Stage(pb.StageRequest(dataset="first", job="first"))
                    assert staged.finished and not staged.error, staged
            rounds = [
                json.loads(
                    subprocess.run(
                        [sys.executable, __file__, "--rank", address], check=True, capture_output=True, text=True
                    ).stdout.splitlines()[-1]
                )
                for _ in range(ROUNDS)
            ]
    medians = {step: round(statistics.median(r[step] for r in rounds), 1) for step in STEPS}
    print(json.dumps({"medians_ms": medians, "rounds_ms": rounds}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank(sys.argv[2])
    else:
        main()
