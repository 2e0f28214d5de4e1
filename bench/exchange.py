"""The per-epoch exchange: its throughput, whether it hides inside an epoch,
and whether it moves what the placement says.

1. Throughput (per sample size, 110 KiB and 1 MiB): a directory and two
   daemons on loopback; a files dataset of ``DATASET_BYTES`` staged whole on
   node-0; per round a fresh ``partial`` job with Q = 1 on [node-0, node-1]
   (node-1's cache wiped, its identity key kept, and the daemon restarted before each round). Two
   runs over the same ids, the ones node-0 gives node-1 for epoch 1:

   - peer-read streaming (the baseline): this process reads them from node-0
     over TCP with ``peer=True`` in batches of 64, what a daemon does for a
     peer hit (hop 1 in bench/peers.py);
   - exchange: node-0 is told its trainers entered epoch 0 and ships them to
     node-1, which checks each checksum, commits to LMDB and acknowledges;
     the rate is the bytes sent over the daemon's own elapsed time for the run.

   Target: exchange >= 0.7x peer-read streaming.

2. An epoch that hides the exchange: 4 daemons, 8 rank processes (2 per
   node), a ``partial`` job with Q = 0.1, ``--spare-copies-fill 0``; each rank
   sleeps ``COMPUTE_SECONDS`` per batch of 16 (a GPU step) so that an epoch
   takes longer than the exchange needs. Per epoch: wall time, whether every
   node's exchange into the next epoch had finished when the epoch ended, the
   tiers the ranks read from, and the bytes the exchange sent against the
   placement's own count (samples whose owner changes, times their sizes).
   Targets: epochs 1+ read nothing from the PFS and >= 99% locally; bytes sent
   within 1% of the placement's count. ``held`` is what the receivers already
   had (a sample handed back to a node that kept it, knowing it would own it
   again): sent + held must equal the placement's count exactly.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from common import REPEATS, MiB, progress, report, wipe_cache

from dataquay.client.jobs import job_plan
from dataquay.client.malloc import tune_malloc
from dataquay.client.manifest import Manifest
from dataquay.client.placement import owners
from dataquay.client.wire.channels import channel_options
from dataquay.protos import cache_pb2 as pb
from dataquay.protos import cache_pb2_grpc
from dataquay.protos import jobs_pb2 as jpb
from dataquay.server.tools.local_cluster import LocalCluster
from dataquay.server.tools.synthetic import make_files_dataset, sample_bytes
from dataquay.server.tools.trainers import RankGroup

BATCH = 64
DATASET_BYTES = 256 * MiB
SIZES = {"110KiB": 110 * 1024, "1MiB": MiB}
TARGET = 0.7

EPOCH_SAMPLES = 4800
EPOCH_SIZES = (48 * 1024, 64 * 1024, 96 * 1024)
EPOCHS = 4
COMPUTE_SECONDS = 0.04
Q = 0.1


def _stub(address: str) -> tuple[grpc.Channel, cache_pb2_grpc.CacheStub]:
    channel = grpc.insecure_channel(address, options=channel_options())
    return channel, cache_pb2_grpc.CacheStub(channel)


def _tcp(local: LocalCluster, index: int) -> str:
    ready = local.daemons[index].ready
    assert ready is not None
    return str(ready["tcp"])


def _manifest(stub: cache_pb2_grpc.CacheStub, name: str) -> Manifest:
    return Manifest(b"".join(c.data for c in stub.GetManifest(pb.GetDatasetRequest(name=name))))


def _exchange_run(stub: cache_pb2_grpc.CacheStub, job: str, epoch: int, timeout: float = 600) -> pb.ExchangeProgress:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run in stub.Stats(pb.StatsRequest()).exchanges:
            if run.job == job and run.epoch == epoch and run.finished:
                return run
        time.sleep(0.02)
    raise RuntimeError(f"exchange of {job} into epoch {epoch} did not finish")


def throughput(base: Path) -> list[dict[str, object]]:
    rows = []
    for label, size in SIZES.items():
        count = DATASET_BYTES // size
        root = make_files_dataset(base / "pfs" / label, count, sizes=(size,))
        with LocalCluster(base / f"pair-{label}", 2, dataset_roots=(base,)) as local:
            channel, n0 = _stub(_tcp(local, 0))
            n0.AddDataset(pb.AddDatasetRequest(name=label, root=str(root)))
            progress(f"throughput {label}: staging {count} samples on node-0")
            *_, staged = n0.Stage(pb.StageRequest(dataset=label))
            assert staged.done_samples == count, staged
            manifest = _manifest(n0, label)
            peer_rates, exchange_rates, moved = [], [], []
            for round_ in range(REPEATS):
                progress(f"throughput {label}: round {round_ + 1} of {REPEATS}")
                local.kill_node(1)
                wipe_cache(local.daemons[1].cache_dir)
                local.restart_node(1)
                job_id = f"x-{label}-{round_}"
                spec = jpb.JobSpec(
                    job_id=job_id,
                    dataset=label,
                    mode="partial",
                    q=1.0,
                    seed=round_,
                    nodes=["node-0", "node-1"],
                    ranks_per_node=1,
                )
                job = n0.JoinJob(jpb.JoinJobRequest(spec=spec))
                plan = job_plan(job, manifest)
                before = owners(plan, 0)
                after = owners(plan, 1, before)
                given = np.flatnonzero((before == 0) & (after == 1))
                nbytes = int(manifest.sample_length[given].sum())

                started = time.perf_counter()
                for i in range(0, len(given), BATCH):
                    ids = given[i : i + BATCH].tolist()
                    request = pb.ReadRequest(dataset=label, ids=ids, manifest_id=manifest.manifest_id, peer=True)
                    got = [s for chunk in n0.Read(request) for s in chunk.samples]
                    assert len(got) == len(ids) and not any(s.missing for s in got)
                peer_rates.append(nbytes / (time.perf_counter() - started))

                n0.ReportEpoch(jpb.ReportEpochRequest(job_id=job_id, epoch=0))
                run = _exchange_run(n0, job_id, 1)
                assert run.delivered_samples == run.total_samples == len(given), run
                assert run.sent_bytes == nbytes, (run.sent_bytes, nbytes)
                exchange_rates.append(run.sent_bytes / run.elapsed_seconds)
                moved.append(nbytes)
                with grpc.insecure_channel(_tcp(local, 1), options=channel_options()) as c1:
                    check = given[:: max(1, len(given) // 8)].tolist()
                    request = pb.ReadRequest(dataset=label, ids=check, peer=True)
                    got = [s for chunk in cache_pb2_grpc.CacheStub(c1).Read(request) for s in chunk.samples]
                    assert [s.data for s in got] == [sample_bytes(0, i, size) for i in check]
            channel.close()
        peer, exchange = statistics.median(peer_rates), statistics.median(exchange_rates)
        rows.append(
            {
                "size": label,
                "moved_MB": statistics.median(moved) / 1e6,
                "peer_read_GBps": peer / 1e9,
                "exchange_GBps": exchange / 1e9,
                "ratio": exchange / peer,
                "target": TARGET,
            }
        )
    return rows


def hidden_epochs(base: Path) -> list[dict[str, object]]:
    root = make_files_dataset(base / "pfs" / "epochs", EPOCH_SAMPLES, sizes=EPOCH_SIZES)
    rows = []
    with LocalCluster(base / "four", 4, ("--spare-copies-fill", "0"), dataset_roots=(base,)) as local:
        stubs = [_stub(_tcp(local, i)) for i in range(4)]
        n0 = stubs[0][1]
        n0.AddDataset(pb.AddDatasetRequest(name="epochs", root=str(root)))
        spec = jpb.JobSpec(job_id="hide", dataset="epochs", mode="partial", q=Q, ranks_per_node=2)
        job = n0.JoinJob(jpb.JoinJobRequest(spec=spec))
        for _, stub in stubs:
            *_, staged = stub.Stage(pb.StageRequest(dataset="epochs", job="hide"))
            assert staged.done_samples == staged.total_samples, staged
        manifest = _manifest(n0, "epochs")
        plan = job_plan(job, manifest)
        epoch_owners = [owners(plan, 0)]
        for epoch in range(1, EPOCHS + 1):
            epoch_owners.append(owners(plan, epoch, epoch_owners[-1]))
        envs = [local.rank_env(r, 2, "hide") for r in range(8)]
        with RankGroup(envs, "epochs", base / "ranks", batch=16, compute_seconds=COMPUTE_SECONDS) as group:
            for epoch in range(EPOCHS):
                progress(f"epochs: epoch {epoch + 1} of {EPOCHS}")
                results = group.epoch(epoch)
                stats = [stub.Stats(pb.StatsRequest()) for _, stub in stubs]
                runs = [next((r for r in s.exchanges if r.job == "hide" and r.epoch == epoch + 1), None) for s in stats]
                hidden = all(r is not None and r.finished for r in runs)
                done = [_exchange_run(stub, "hide", epoch + 1) for _, stub in stubs]
                changed = epoch_owners[epoch] != epoch_owners[epoch + 1]
                counts = {t: sum(r.samples[t] for r in results) for t in results[0].samples}
                total = sum(counts.values())
                expected_bytes = int(manifest.sample_length[changed].sum())
                sent = sum(r.sent_bytes for r in done)
                held = sum(r.delivered_bytes - r.sent_bytes for r in done)
                rows.append(
                    {
                        "epoch": epoch,
                        "wall_s": max(r.wall_seconds for r in results),
                        "exchange_s": max(r.elapsed_seconds for r in done),
                        "hidden": hidden,
                        "local_pct": 100 * (counts.get("local", 0) + counts.get("cache", 0)) / total,
                        "peer": counts.get("peer", 0),
                        "pfs": counts.get("pfs", 0) + counts.get("fallback", 0),
                        "placement_MB": expected_bytes / 1e6,
                        "sent_MB": sent / 1e6,
                        "held_MB": held / 1e6,
                        "sent_vs_placement": sent / expected_bytes,
                        "accounted": (sent + held) / expected_bytes,
                    }
                )
        for channel, _ in stubs:
            channel.close()
    return rows


def main() -> None:
    tune_malloc()
    with tempfile.TemporaryDirectory(prefix="dq-bench-exchange-") as tmp:
        base = Path(tmp)
        report(
            "exchange_throughput",
            throughput(base),
            ["size", "moved_MB", "peer_read_GBps", "exchange_GBps", "ratio", "target"],
        )
        print()
        report(
            "exchange_epochs",
            hidden_epochs(base),
            [
                "epoch",
                "wall_s",
                "exchange_s",
                "hidden",
                "local_pct",
                "peer",
                "pfs",
                "placement_MB",
                "sent_MB",
                "held_MB",
                "sent_vs_placement",
                "accounted",
            ],
        )


if __name__ == "__main__":
    main()
