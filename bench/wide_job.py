"""What a read costs the daemons in a job over thousands of nodes, against
one over two.

Every read a trainer asks for a job's epoch looks up the job's placement
on its daemon; nothing in that lookup may take a pass over the job's nodes,
or a cluster of 4,096 nodes pays thousands of steps a call.

Setup: a directory and two daemons (``--heal-after 1s``); a files dataset
of ``SAMPLES`` samples of 4 KiB (small, so the cost per call shows). Two
jobs on it, each staged on both daemons: ``pair``, on their two nodes,
and ``wide``, on those and ``--nodes - 2`` others registered with the
directory (real RegisterNode calls) that never beat, so that their leases
end and, a grace period later, they are lost and the two daemons hold
their share (staged, or fetched by healing, before the timing starts).
Timed: ``ROUNDS`` rounds of ``PASSES`` passes over the dataset in batches
of ``BATCH`` through node-0's daemon (the memfd batch path, as a client
that may not open the cache reads), the two jobs taking turns: about half
the samples are local hits, the rest peer hits from node-1, in both jobs.
Measured: each daemon's CPU (user + system, /proc) per call, the median of
the rounds; the ratio is the median of each round's wide over pair (the
asking daemon's). Every read must be a cache hit on one of the two.

    .venv/bin/python bench/wide_job.py [--nodes 4096]   # about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from common import progress, report
from cpu_meter import Meter

from dataquay.client import Client, connect
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc, directory_pb2_grpc
from dataquay.protos import directory_pb2 as dpb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster, node_name
from dataquay.server.tools.synthetic import make_files_dataset

SAMPLES = 512
SIZE = 4096
BATCH = 16
ROUNDS = 6
#: Passes over the dataset per timed round and job.
PASSES = 20
#: RegisterNode calls in flight at once.
REGISTERING = 64
#: The local cluster's lease (2 s), the daemon's grace (1 s), and room for the listings to reach it.
LEASE_AND_GRACE_SECONDS = 8
HEAL_TIMEOUT_SECONDS = 120


async def _register(address: str, names: list[str]) -> None:
    """Registers ``names`` as nodes (addresses nobody listens on), as their daemons would."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = directory_pb2_grpc.DirectoryStub(channel)
        slots = asyncio.Semaphore(REGISTERING)

        async def one(index: int, name: str) -> None:
            info = jpb.NodeInfo(name=name, tcp_address=f"127.0.0.1:{20000 + index % 40000}", cache_capacity=1 << 40)
            async with slots:
                await stub.RegisterNode(
                    dpb.RegisterNodeRequest(node=info, identity_key=hashlib.sha256(name.encode()).digest())
                )

        await asyncio.gather(*(one(i, name) for i, name in enumerate(names)))


def run(base: Path, nodes: int) -> list[dict[str, object]]:
    """Both jobs on two daemons, ``nodes`` in the wide one; a row per job."""
    root = make_files_dataset(base / "pfs" / "d", SAMPLES, sizes=(SIZE,))
    with LocalCluster(base / "cluster", 2, dataset_roots=(base,), daemon_args=("--heal-after", "1")) as local:
        assert local.directory is not None and local.directory.process is not None
        daemon, peer = local.daemons
        assert daemon.process is not None and daemon.ready is not None and peer.process is not None
        others = [f"far-{i:05d}" for i in range(nodes - 2)]
        progress(f"registering {len(others)} nodes")
        asyncio.run(_register(local.directory.address, others))
        channels = [grpc.insecure_channel(str(d.ready["tcp"]), options=channel_options()) for d in local.daemons]  # type: ignore[index]
        stubs = [cache_pb2_grpc.CacheStub(channel) for channel in channels]
        stubs[0].AddDataset(pb.AddDatasetRequest(name="d", root=str(root)))
        jobs = {"pair": [node_name(0), node_name(1)], "wide": [node_name(0), node_name(1), *others]}
        for job, names in jobs.items():
            stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job, dataset="d", nodes=names)))
        progress("waiting for the registered nodes' leases and grace to end")
        time.sleep(LEASE_AND_GRACE_SECONDS)
        for job in jobs:
            for stub in stubs:
                *_, staged = stub.Stage(pb.StageRequest(dataset="d", job=job))
                assert not staged.error, staged
        for stub in stubs:
            _healed(stub, len(others))
        client = connect(daemon.address)
        meter = Meter({"asking": daemon.process.pid, "owning": peer.process.pid})
        try:
            readers = {job: _reader(client, job, len(names)) for job, names in jobs.items()}
            spent: dict[str, list[float]] = {job: [] for job in jobs}
            owning: dict[str, list[float]] = {job: [] for job in jobs}
            before = client.stats().samples
            for round_ in range(ROUNDS):
                progress(f"round {round_ + 1} of {ROUNDS}")
                for job, read in readers.items():
                    with meter.measure():
                        calls = read()
                    spent[job].append(meter.spent["asking"] / calls * 1e3)
                    owning[job].append(meter.spent["owning"] / calls * 1e3)
            after = client.stats().samples
            local, remote = (after.get(t, 0) - before.get(t, 0) for t in ("cache", "peer"))
            # Every read a hit in one of the two caches, and about half of them peer hits.
            assert local + remote == ROUNDS * len(jobs) * PASSES * SAMPLES and remote > local // 2, after
        finally:
            client.close()
            for channel in channels:
                channel.close()
    return [
        {
            "job": job,
            "nodes": len(names),
            "calls": PASSES * SAMPLES // BATCH,
            "daemon_ms_per_call": statistics.median(spent[job]),
            "owner_ms_per_call": statistics.median(owning[job]),
            "runs_ms": [round(ms, 3) for ms in spent[job]],
            # Paired by round: a loaded moment moves both jobs' calls alike.
            "ratio": statistics.median(a / b for a, b in zip(spent[job], spent["pair"], strict=True)),
        }
        for job, names in jobs.items()
    ]


def _healed(stub: cache_pb2_grpc.CacheStub, lost: int) -> None:
    """Waits until a daemon counts the ``lost`` nodes lost and holds its part
    of their share, so that no healing runs while reads are timed."""
    deadline = time.monotonic() + HEAL_TIMEOUT_SECONDS
    while True:
        healing = stub.Stats(pb.StatsRequest()).healing
        if healing.lost_nodes == lost and not healing.pending_samples:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not take the lost nodes' share in {HEAL_TIMEOUT_SECONDS} s: {healing}")
        time.sleep(0.5)


def _reader(client: Client, job: str, nodes: int) -> Callable[[], int]:
    """PASSES passes over the dataset for ``job`` through the daemon, one
    rank per node; the calls it made. One pass untimed first."""
    ds = client.dataset("d")
    ds.sampler(job=job, rank=0, world_size=nodes)
    batches = [np.arange(i, min(i + BATCH, SAMPLES)) for i in range(0, SAMPLES, BATCH)]

    def read() -> int:
        for _ in range(PASSES):
            for batch in batches:
                held = client.remote._read_daemon(ds, batch, 0)
                assert len(held) == len(batch)
        return PASSES * len(batches)

    read()
    return read


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4096, help="nodes of the wide job, the daemon's included")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dq-bench-wide-") as tmp:
        rows = run(Path(tmp), args.nodes)
    report("wide_job", rows, ["job", "nodes", "calls", "daemon_ms_per_call", "owner_ms_per_call", "runs_ms", "ratio"])


if __name__ == "__main__":
    main()
