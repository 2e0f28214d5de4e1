"""numpy for dataquay's own processes, with one OpenBLAS thread.

The daemon, the directory and every ``dataquay`` command use numpy for sorts,
gathers and hashes, never for a matrix product. numpy's OpenBLAS starts a
thread per core when it loads, each spinning a while before it sleeps: CPU
seconds on a many-core node for a command that answers in a tenth of one.
The setting is taken back as soon as numpy is loaded, so that what dataquay
starts (``dataquay slurm run -- CMD``) sees the user's environment.
"""

from __future__ import annotations

import os

SETTING = "OPENBLAS_NUM_THREADS"


def import_numpy() -> None:
    """Loads numpy with one BLAS thread, unless the environment chose a number."""
    chosen = SETTING in os.environ
    if not chosen:
        os.environ[SETTING] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        if not chosen:
            del os.environ[SETTING]
