"""Where this process sits in a distributed job, from the launcher's environment.

torchrun and most launchers export RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE; under plain ``srun`` only Slurm's variables exist, so they
are the fallback. A process started by neither is rank 0 of 1.
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
