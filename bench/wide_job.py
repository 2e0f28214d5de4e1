"""What a read costs the daemon in a job over thousands of nodes, against one
over the node alone.

Every read a trainer asks for a job's epoch looks up the job's placement
on its daemon; nothing in that lookup may take a pass over the job's nodes,
or a cluster of 4,096 nodes pays thousands of steps a call.

Setup: a directory and one daemon (``--heal-after 1s``); a files dataset of
``SAMPLES`` samples of 4 KiB (small, so the cost per call shows). Two jobs
on it, each staged on the daemon: ``alone``, on the daemon's node only,
and ``wide``, on that node and ``--nodes - 1`` others registered with the
directory (real RegisterNode calls) that never beat, so that their leases
end and, a grace period later, they are lost and the daemon holds their
share (staged, or fetched by healing, before the timing starts). Timed:
``ROUNDS`` rounds of ``PASSES`` passes over the dataset in batches of ``BATCH``
through the daemon (the memfd batch path, as a client that may not open
the cache reads), the two jobs taking turns; the daemon's CPU (user +
system, /proc) per call, the median of the rounds; the ratio is the median
of each round's wide over alone. Every read must be a cache hit.

    .venv/bin/python bench/wide_job.py [--nodes 4096]   # about 30 s
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
    """Both jobs on one daemon, ``nodes`` in the wide one; a row per job."""
    root = make_files_dataset(base / "pfs" / "d", SAMPLES, sizes=(SIZE,))
    with LocalCluster(base / "cluster", 1, dataset_roots=(base,), daemon_args=("--heal-after", "1")) as local:
        assert local.directory is not None and local.directory.process is not None
        daemon = local.daemons[0]
        assert daemon.process is not None and daemon.ready is not None
        others = [f"far-{i:05d}" for i in range(nodes - 1)]
        progress(f"registering {len(others)} nodes")
        asyncio.run(_register(local.directory.address, others))
        channel = grpc.insecure_channel(str(daemon.ready["tcp"]), options=channel_options())
        stub = cache_pb2_grpc.CacheStub(channel)
        stub.AddDataset(pb.AddDatasetRequest(name="d", root=str(root)))
        jobs = {"alone": [node_name(0)], "wide": [node_name(0), *others]}
        for job, names in jobs.items():
            stub.JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=job, dataset="d", nodes=names)))
        progress("waiting for the registered nodes' leases and grace to end")
        time.sleep(LEASE_AND_GRACE_SECONDS)
        for job in jobs:
            *_, staged = stub.Stage(pb.StageRequest(dataset="d", job=job))
            assert not staged.error, staged
        _healed(stub, len(others))
        client = connect(daemon.address)
        meter = Meter({"daemon": daemon.process.pid})
        try:
            readers = {job: _reader(client, job, len(names)) for job, names in jobs.items()}
            spent: dict[str, list[float]] = {job: [] for job in jobs}
            before = client.stats().samples.get("cache", 0)
            for round_ in range(ROUNDS):
                progress(f"round {round_ + 1} of {ROUNDS}")
                for job, read in readers.items():
                    with meter.measure():
                        calls = read()
                    spent[job].append(meter.spent["daemon"] / calls * 1e3)
            hits = client.stats().samples.get("cache", 0) - before
            assert hits == ROUNDS * len(jobs) * PASSES * SAMPLES, hits  # every read a cache hit
        finally:
            client.close()
            channel.close()
    return [
        {
            "job": job,
            "nodes": len(names),
            "calls": PASSES * SAMPLES // BATCH,
            "daemon_ms_per_call": statistics.median(spent[job]),
            "runs_ms": [round(ms, 3) for ms in spent[job]],
            # Paired by round: a loaded moment moves both jobs' calls alike.
            "ratio": statistics.median(a / b for a, b in zip(spent[job], spent["alone"], strict=True)),
        }
        for job, names in jobs.items()
    ]


def _healed(stub: cache_pb2_grpc.CacheStub, lost: int) -> None:
    """Waits until the daemon counts the ``lost`` nodes lost and holds their
    share, so that no healing runs while reads are timed."""
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
    report("wide_job", rows, ["job", "nodes", "calls", "daemon_ms_per_call", "runs_ms", "ratio"])


if __name__ == "__main__":
    main()
