"""Where this process sits in a distributed job, from the launcher's environment.

torchrun and most launchers export RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE; under plain ``srun`` only Slurm's variables exist, so they
are the fallback. A process started by neither is rank 0 of 1.
DATAQUAY_JOB names the dataquay cluster job a process trains in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_SOURCES: dict[str, tuple[tuple[str, str], int]] = {
    "rank": (("RANK", "SLURM_PROCID"), 0),
    "world_size": (("WORLD_SIZE", "SLURM_NTASKS"), 1),
    "local_rank": (("LOCAL_RANK", "SLURM_LOCALID"), 0),
    "local_world_size": (("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), 1),
}


@dataclass(frozen=True)
class Topology:
    """Rank and size of this process, job-wide and on its node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _read(environ: Mapping[str, str], field: str) -> int:
    names, default = _SOURCES[field]
    for name in names:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
        if value < 0:
            raise ValueError(f"environment variable {name}={raw!r} is negative")
        return value
    return default


def topology(environ: Mapping[str, str] | None = None) -> Topology:
    """This process's :class:`Topology` from ``environ`` (default: os.environ).

    Raises:
        ValueError: a variable is set but is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    return Topology(*(_read(env, field) for field in _SOURCES))


def local_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Ranks on this node when the launcher says (LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE), else None.

    Unlike :func:`topology`, which defaults to 1, this tells "not said" apart,
    so a job's ranks per node are set only from what the launcher knows.

    Raises:
        ValueError: a variable is set but is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    names, _ = _SOURCES["local_world_size"]
    return _read(env, "local_world_size") if any(env.get(name, "").strip() for name in names) else None


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The job this process trains in, from DATAQUAY_JOB (None when unset or empty)."""
    env = os.environ if environ is None else environ
    return env.get("DATAQUAY_JOB", "").strip() or None
