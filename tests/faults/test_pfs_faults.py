"""Files on the PFS go bad after their dataset was registered: one deleted,
one made unreadable, one truncated."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from checker import pfs_files
from faultjob import SAMPLES, FaultJob

from dataquay.client import connect
from dataquay.client.errors import PfsReadError


def break_files(files: list[Path]) -> dict[int, str]:
    """Deletes one file, makes one unreadable and truncates one; returns
    their ids and the cause an error must name."""
    files[11].unlink()
    # Root reads through any mode bits: a folder in the file's place is what
    # it cannot read.
    if os.geteuid() == 0:
        files[222].unlink()
        files[222].mkdir()
    else:
        files[222].chmod(0)
    os.truncate(files[333], 100)
    unreadable = "is a directory (refused)" if os.geteuid() == 0 else "Permission denied"
    return {11: "No such file or directory", 222: unreadable, 333: "changed since the dataset was registered"}


def test_broken_files_fail_their_own_reads_by_name_and_nothing_else(fault_job: Callable[..., FaultJob]) -> None:
    job = fault_job("partial")
    job.stage()
    files = pfs_files(job.root)
    # A copy of the files (new mtimes), so that no cache holds them: the same
    # files under a second name would share the job's cache.
    copy = shutil.copytree(job.root, job.root.with_name("pfs-uncached"), copy_function=shutil.copyfile)
    copies = pfs_files(copy)
    added = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "dataset",
            "add",
            "uncached",
            str(copy),
            "--addr",
            job.local.daemons[0].address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    broken = break_files(files)
    assert break_files(copies) == broken

    # The job's samples were all staged: the broken files are never read.
    with job.ranks() as group:
        job.run_epochs(group)
    assert all(tiers.get("pfs", 0) == tiers.get("fallback", 0) == 0 for tiers in job.tiers)

    # "uncached" was never staged: its reads go to the PFS.
    client = connect(job.local.daemons[0].address)
    try:
        ds = client.dataset("uncached")
        for sample_id, reason in broken.items():
            with pytest.raises(PfsReadError) as caught:
                ds.get_batch([sample_id - 1, sample_id, sample_id + 1])
            message = str(caught.value)
            assert f"sample {sample_id} of 'uncached'" in message and str(copies[sample_id]) in message
            assert reason in message
        good = [i for i in range(SAMPLES) if i not in broken]
        for start in range(0, len(good), 64):
            ids = good[start : start + 64]
            got = [xxhash.xxh3_64_intdigest(s) for s in ds.get_batch(ids)]
            assert got == [int(job.digests[i]) for i in ids]
    finally:
        client.close()
    staged_again = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataquay.server.cli",
            "stage",
            "uncached",
            "--quiet",
            "--addr",
            job.local.daemons[0].address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert staged_again.returncode == 1
    assert f"{SAMPLES - len(broken)}/{SAMPLES} samples cached" in staged_again.stdout
    assert staged_again.stderr.count("\n") == 1 and "3 samples of 'uncached' could not be read" in staged_again.stderr
    job.report(
        "PFS file deleted / unreadable / truncated after registration",
        "staged copies served the job; uncached reads of those ids fail with PfsReadError naming dataset, id, "
        "path and cause; every other id reads right; staging skips and names them",
        None,
    )
