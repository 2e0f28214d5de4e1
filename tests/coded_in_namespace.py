"""A job of NODES daemons with a coded exchange, run for a few epochs by a process of its own,
so that a test can put it in a network namespace (``ip netns exec``) with loss or
without multicast; writes what every exchange did as JSON.

Run: ``python tests/coded_in_namespace.py RUNDIR EPOCHS NODES DAEMON_ARG...``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from conftest import FAST_LEASES
from test_exchange import JOB, Nodes, staged

from dataquay.client.jobs import job_plan
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster

RUN_FIELDS = (
    "epoch",
    "elapsed_seconds",
    "coded_note",
    "coded_packets_sent",
    "coded_samples_decoded",
    "coded_datagrams_received",
    "coded_bytes_received",
    "coded_foreign_datagrams",
    "sent_bytes",
)


def main(rundir: Path, epochs: int, num_nodes: int, daemon_args: list[str]) -> None:
    clusters: list[LocalCluster] = []

    def cluster(nodes: int, *, daemon_args: tuple[str, ...] = ()) -> LocalCluster:
        local = LocalCluster(rundir / "cluster", nodes, daemon_args, FAST_LEASES, dataset_roots=(rundir,))
        clusters.append(local)
        return local.start()

    try:
        job_args = ["--mode", "partial", "--q", "1", "--exchange-coding", "coded"]
        local = staged(cluster, rundir, job_args, *daemon_args, nodes=num_nodes)
        nodes = Nodes(local)
        manifest = Manifest(b"".join(c.data for c in nodes.stubs[0].GetManifest(pb.GetDatasetRequest(name="imgs"))))
        job = nodes.stubs[0].JoinJob(jpb.JoinJobRequest(spec=jpb.JobSpec(job_id=JOB), must_exist=True))
        plan = job_plan(job, manifest)
        placement = owners(plan, 0)
        runs, exact = [], 0
        for epoch in range(epochs):
            placement = owners(plan, epoch + 1, placement)
            nodes.report(epoch)
            runs.append([{k: getattr(run, k) for k in RUN_FIELDS} for run in nodes.wait_exchanged(epoch + 1)])
            for m in range(num_nodes):
                mine = np.flatnonzero(placement == m)
                exact += len(nodes.read(m, mine))  # each checked against its checksum
        notes = [s.exchange_multicast_note for s in nodes.stats()]
        (rundir / "result.json").write_text(json.dumps({"runs": runs, "exact": exact, "multicast_notes": notes}))
        nodes.close()
    finally:
        for local in clusters:
            local.down()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
