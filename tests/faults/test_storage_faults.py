"""The cache's disk goes wrong under a job: a value corrupted on disk, and a
cache far too small for its node's share."""

from __future__ import annotations

import re
from collections.abc import Callable

from faultjob import NODES, SAMPLES, FaultJob

from dataquay.client.placement import owners


def test_a_value_corrupted_on_disk_is_caught_served_from_the_pfs_and_repaired(
    fault_job: Callable[..., FaultJob],
) -> None:
    job = fault_job("local")
    job.stage()
    victim = int(next(i for i in range(SAMPLES) if owners(job.plan, 0)[i] == 1))
    payload = (job.root / f"class_{victim * 10 // SAMPLES:03d}" / f"{victim:08d}.bin").read_bytes()
    data_file = job.local.daemons[1].cache_dir / "data.mdb"
    with open(data_file, "r+b") as disk:
        raw = disk.read()
        # Besides the live value, pages an earlier transaction copied may hold
        # a stale one: every copy is flipped (the daemon and the clients see
        # it through their maps).
        copies = [m.start() for m in re.finditer(re.escape(payload[:256]), raw)]
        assert copies
        for at in copies:
            disk.seek(at + 100)
            disk.write(bytes([raw[at + 100] ^ 0xFF]))

    with job.ranks() as group:
        job.run_epochs(group)
    # Epoch 0 read the sample from the PFS; the repaired copy served epochs 1 and 2.
    assert job.tiers[0] == {"local": SAMPLES - 1, "pfs": 1}
    assert job.tiers[1] == job.tiers[2] == {"local": SAMPLES}
    assert job.stats(1).corrupt_repaired == 1
    job.report(
        "a value corrupted on disk", "checksum mismatch: read from the PFS, repaired in place", 0.0, corrupt_repaired=1
    )


def test_a_cache_too_small_for_its_share_serves_the_rest_from_the_pfs_every_epoch(
    fault_job: Callable[..., FaultJob],
) -> None:
    # A node's share is about 380 KB; its cache holds about a third of it.
    job = fault_job("partial", daemon_args=("--cache-size", "128K"))
    job.stage()
    held = [job.stats(m).cache_entries for m in range(NODES)]
    # Staging stops short of the capacity: the exchange's reserve stays free.
    assert all(job.stats(m).cache_used_bytes < job.stats(m).cache_capacity_bytes for m in range(NODES))
    assert all(0 < n < SAMPLES // NODES for n in held)
    with job.ranks() as group:
        job.run_epochs(group)
    # The exchanges fill part of the reserve staging left free: the caches end holding a few more.
    cached = max(sum(held), sum(job.stats(m).cache_entries for m in range(NODES)))
    for tiers in job.tiers:
        assert tiers.get("local", 0) + tiers.get("peer", 0) <= cached and tiers.get("pfs", 0) >= SAMPLES - cached
    # The PFS share stays level (before, it grew epoch after epoch).
    pfs = [tiers.get("pfs", 0) for tiers in job.tiers]
    assert max(pfs) <= 1.25 * min(pfs), pfs
    job.report(
        "cache disk too small for its share (--cache-size 128K)",
        "correct bytes; the overflow read from the PFS every epoch",
        None,
        cached=sum(held),
    )
