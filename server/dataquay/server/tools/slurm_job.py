"""Where `dataquay slurm run` puts a job's servers inside the user's own
allocation: a pure function of the environment Slurm gives the batch step and
the user's flags, so the layout is tested without Slurm.

Every path is the same on every node (built from the job id and the uid under
a node-local scratch directory), so that one ``DATAQUAY_ADDR`` serves every
rank, whichever node it lands on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from socket import gethostname

from dataquay.server.errors import DataquayError


class SlurmJobError(DataquayError):
    """The launcher cannot run here: no allocation, or an allocation it cannot read."""


@dataclass(frozen=True)
class SlurmJobPlan:
    """The job's servers: one directory on the launcher's node, one daemon per node."""

    job_id: str
    #: Nodes of the allocation: one daemon each.
    nodes: int
    #: The node the launcher (and the directory) runs on, as the other nodes reach it.
    host: str
    #: Node-local folder of the job's socket, state and ready files; the same path on every node.
    run_dir: Path
    #: The daemons' cache: node-local scratch unless the user names a folder.
    cache_dir: Path
    #: Address the servers bind: all interfaces, or loopback for an allocation of one node.
    bind_host: str

    @property
    def socket(self) -> Path:
        return self.run_dir / "dataquay.sock"

    @property
    def job(self) -> str:
        """The dataquay job the ranks join, unless the user names one."""
        return f"slurm-{self.job_id}"


def plan_job(
    env: Mapping[str, str], *, scratch: str | None = None, cache_dir: str | None = None, bind_host: str | None = None
) -> SlurmJobPlan:
    """The plan for the allocation that ``env`` (the batch step's environment) describes.

    Scratch is ``--scratch``, else ``$TMPDIR`` (which many sites point at a
    per-job node-local folder), else ``/tmp``.
    """
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise SlurmJobError(
            "not inside a Slurm allocation (no SLURM_JOB_ID): run `dataquay slurm run` in an sbatch script or salloc"
        )
    count = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    if not count.isdigit() or int(count) < 1:
        raise SlurmJobError(f"SLURM_JOB_NUM_NODES={count!r} is not a node count")
    nodes = int(count)
    base = Path(scratch or env.get("TMPDIR") or "/tmp")
    if not base.is_absolute():
        raise SlurmJobError(f"scratch folder {base} is not an absolute path: every node must find the same one")
    run_dir = base / f"dataquay-{os.getuid()}" / f"slurm-{job_id}"
    return SlurmJobPlan(
        job_id=job_id,
        nodes=nodes,
        host=env.get("SLURMD_NODENAME") or gethostname(),
        run_dir=run_dir,
        cache_dir=Path(cache_dir) if cache_dir else run_dir / "cache",
        bind_host=bind_host or ("127.0.0.1" if nodes == 1 else "0.0.0.0"),
    )
