"""dataquay's commands load numpy with one OpenBLAS thread and leave the
setting to what they start: a thread per core spinning at each command's
start is CPU a many-core node pays for nothing."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import os; {}; print(len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS'))"


def threads_and_setting(statement: str, chosen: str | None = None) -> list[str]:
    """Threads and the setting after ``statement``, in a process started with
    ``OPENBLAS_NUM_THREADS`` set to ``chosen`` (unset where None)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if chosen is not None:
        env["OPENBLAS_NUM_THREADS"] = chosen
    out = subprocess.run([sys.executable, "-c", PROBE.format(statement)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_command_line_loads_numpy_with_one_blas_thread_and_takes_the_setting_back() -> None:
    assert threads_and_setting("import dataquay.server.cli") == ["1", "None"]
    if (os.cpu_count() or 1) > 1:
        threads, _ = threads_and_setting("import numpy")
        assert int(threads) > 1, "numpy alone starts a BLAS thread per core: the check above would see nothing"


def test_a_number_the_environment_chose_is_kept() -> None:
    assert threads_and_setting("import dataquay.server.cli", chosen="2")[-1] == "2"
