"""A cluster job as a rank sees it: the spec it joins with, the plan it reads by.

The directory keeps only a job's settings. Every rank and every daemon turns
the job record into the same :class:`~dataquay.client.placement.JobPlan` and
computes placement from it, so nobody asks anybody where a sample lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataquay.client.errors import DataquayError, EpochTooFarError, JobMismatchError
from dataquay.client.job_settings import JobSettings
from dataquay.client.manifest import Manifest
from dataquay.client.placement import MAX_EPOCHS_AHEAD, MODES, JobPlan
from dataquay.protos import jobs_pb2 as jpb

if TYPE_CHECKING:
    from dataquay.client.client import Client


def job_spec(job_id: str, dataset: str, **settings: Any) -> jpb.JobSpec:
    """The spec a rank joins ``job_id`` with; only the settings given are set.

    An unset setting takes the job's value (or the default, when this rank
    creates the job); a set one must equal the job's, or the join fails with
    :class:`JobMismatchError`. Ranks that name nothing join whatever job runs.

    Args:
        job_id: the job to join or create.
        dataset: the dataset a new job reads; empty joins whatever it reads.
        settings: fields of :class:`JobSettings`; None is "not given".

    Raises:
        ValueError: an empty job id, or an unknown mode or partition.
        TypeError: a name that is no setting.
    """
    if not job_id:
        raise ValueError("a job id must not be empty")
    given = {name: value for name, value in settings.items() if value is not None}
    named = JobSettings(job_id, dataset, **given)
    named.check_names()
    return named.to_proto(named=given.keys() | {"dataset"})


def check_epoch_ahead(job_id: str, mode: str, epoch: int, current: int) -> None:
    """Refuses ``epoch`` where it is more than MAX_EPOCHS_AHEAD past the job's
    ``current`` epoch in a mode whose owners move (each epoch between is one
    step for every daemon of the job); modes whose owners stay compute any
    epoch directly, and take any.

    Raises:
        EpochTooFarError: naming the current epoch, the bound and the likely mistake.
    """
    if epoch > current + MAX_EPOCHS_AHEAD and MODES[mode].owners_move:
        raise EpochTooFarError(
            f"epoch {epoch} of job {job_id!r} is more than {MAX_EPOCHS_AHEAD} epochs past its current epoch "
            f"{current} (mode {mode} moves owners one epoch at a time): pass the epoch number, not the global step"
        )


def job_plan(job: jpb.Job, manifest: Manifest) -> JobPlan:
    """The placement plan of ``job`` over the dataset that ``manifest`` describes.

    Works before any rank set the job's ranks per node: ownership (what a
    daemon stages and serves) does not depend on them.

    Raises:
        JobMismatchError: the dataset was replaced since the job was created,
            so the job's orders would address other samples.
        ValueError: a setting out of range.
    """
    settings = JobSettings.from_proto(job.spec)
    if job.manifest_id != manifest.manifest_id:
        raise JobMismatchError(
            f"dataset {settings.dataset!r} was replaced since job {settings.job_id!r} started; "
            "start a new job (another job id) to train on its new content"
        )
    return JobPlan(
        settings,
        num_samples=manifest.num_samples,
        num_nodes=len(settings.nodes),
        groups=manifest.shard_groups() if settings.partition == "shard" else None,
    )


def join(client: Client, spec: jpb.JobSpec, world_size: int) -> jpb.Job:
    """Joins the job of ``spec``, setting its ranks per node if nobody has.

    A job's ranks per node (g) come from the first rank that knows them
    (LOCAL_WORLD_SIZE in ``spec``). When no rank did, g is the world size
    over the job's nodes, which must divide evenly: ranks fill nodes g at a
    time, and a node with fewer ranks would break the equal split.

    Raises:
        ValueError: ``world_size`` does not divide over the job's nodes.
        JobMismatchError: a setting of ``spec`` differs from the job's.
        DataquayError: the job lists no nodes.
    """
    job = client.join_job(spec)
    if job.spec.ranks_per_node:
        return job
    nodes = len(job.spec.nodes)
    if not nodes:
        raise DataquayError(f"job {spec.job_id!r} lists no nodes; are the daemons registered with the directory?")
    if world_size % nodes:
        raise ValueError(
            f"world size {world_size} does not divide over the {nodes} nodes of job {spec.job_id!r}; "
            "run the same number of ranks on every node, or set LOCAL_WORLD_SIZE"
        )
    with_g = jpb.JobSpec()
    with_g.CopyFrom(spec)
    with_g.ranks_per_node = world_size // nodes
    return client.join_job(with_g, must_exist=True)
