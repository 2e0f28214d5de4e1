"""Fixtures of the fault suite: a job on a real 4-node cluster to break."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from faultjob import NODES, FaultJob, make_fault_job

from dataquay.server.tools.local_cluster import LocalCluster


@pytest.fixture
def fault_job(cluster: Callable[..., LocalCluster], tmp_path: Path) -> Callable[..., FaultJob]:
    """Starts a 4-node cluster with the dataset registered (not staged): call
    with the job's mode and extra daemon flags."""

    def start(mode: str = "partial", daemon_args: tuple[str, ...] = ()) -> FaultJob:
        return make_fault_job(cluster(NODES, daemon_args=daemon_args), tmp_path, mode)

    return start
