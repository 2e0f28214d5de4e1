"""`dataquay slurm run`: the user's own path inside an allocation. Its plan
is checked from SLURM_* variables alone; the whole path runs as an sbatch job
under a real Slurm (slurmctld and slurmd on loopback) configured with none of
deploy/slurm's scripts, as on a site whose admin installed nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_deploy_slurm import DATAQUAY_BIN, _processes_under, slurm_dir  # noqa: F401
from test_deploy_slurm_real import SlurmCluster

from dataquay.server.tools.slurm_job import SlurmJobError, plan_job
from dataquay.server.tools.synthetic import make_files_dataset

N = 60

#: The training command: registers the dataset through the daemon it was handed, reads every sample.
READER = """
import json, os, subprocess, sys
import dataquay.client as dq
subprocess.run([sys.argv[1], "dataset", "add", "synth", sys.argv[2]], check=True, stdout=subprocess.DEVNULL)
with dq.connect() as client:
    samples = client.dataset("synth").get_batch(list(range(int(sys.argv[3]))))
print(json.dumps({"read": sum(map(len, samples)), "addr": os.environ["DATAQUAY_ADDR"],
                  "directory": os.environ["DATAQUAY_DIRECTORY"], "job": os.environ["DATAQUAY_JOB"]}))
"""


def test_the_plan_puts_every_path_under_the_node_local_scratch_the_same_on_every_node() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "4", "SLURMD_NODENAME": "gpu07", "TMPDIR": "/local/job"}
    plan = plan_job(env)
    run_dir = Path(f"/local/job/dataquay-{os.getuid()}/slurm-4242")
    assert (plan.nodes, plan.host, plan.run_dir, plan.socket, plan.cache_dir, plan.bind_host, plan.job) == (
        4,
        "gpu07",
        run_dir,
        run_dir / "dataquay.sock",
        run_dir / "cache",
        "0.0.0.0",
        "slurm-4242",
    )
    named = plan_job({**env, "SLURM_JOB_NUM_NODES": "1"}, scratch="/ssd", cache_dir="/ssd/cache")
    assert (named.run_dir.parent, named.cache_dir, named.bind_host) == (
        Path(f"/ssd/dataquay-{os.getuid()}"),
        Path("/ssd/cache"),
        "127.0.0.1",
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, r"^not inside a Slurm allocation \(no SLURM_JOB_ID\)"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "x"}, r"^SLURM_JOB_NUM_NODES='x' is not a node count$"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "TMPDIR": "rel"}, r"^scratch folder rel is not an absolute path"),
    ],
)
def test_the_plan_refuses_an_environment_it_cannot_use_naming_why(env: dict[str, str], message: str) -> None:
    with pytest.raises(SlurmJobError, match=message):
        plan_job(env)


def test_outside_an_allocation_the_command_says_so_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    result = subprocess.run(
        [sys.executable, "-m", "dataquay.server.cli", "slurm", "run", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and result.stderr.startswith("dataquay: error: not inside a Slurm allocation")
    assert len(result.stderr.splitlines()) == 1


@pytest.fixture
def bare_slurm(slurm_dir: Path) -> Iterator[SlurmCluster]:  # noqa: F811 (the fixture)
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "squeue", "srun")):
        pytest.skip("needs root and Slurm's slurmctld, slurmd, sbatch, squeue and srun")
    cluster = SlurmCluster(slurm_dir, scripts=False)
    yield cluster
    cluster.close()


def test_slurm_run_in_a_users_sbatch_job_serves_the_ranks_and_leaves_nothing_running(bare_slurm: SlurmCluster) -> None:
    base = bare_slurm.base
    root = make_files_dataset(base / "pfs" / "synth", N, sizes=(1000, 3000))
    dataset_bytes = sum(p.stat().st_size for p in root.rglob("*.bin"))
    scratch = base / "scratch"
    (base / "reader.py").write_text(READER)
    job = base / "job.sh"
    job.write_text(
        "#!/bin/bash\n"
        f"export DATAQUAY_DATASET_ROOTS={base / 'pfs'} DATAQUAY_DIRECTORY_DATASET_ROOTS={base / 'pfs'}\n"
        f"exec {DATAQUAY_BIN} slurm run --scratch {scratch} -- "
        f"{DATAQUAY_BIN.with_name('python')} {base / 'reader.py'} {DATAQUAY_BIN} {root} {N}\n"
    )
    job.chmod(0o755)

    job_id, output = bare_slurm.run_job(job)

    assert output.strip().splitlines()[-1].startswith("{"), output
    result = json.loads(output.strip().splitlines()[-1])
    run_dir = scratch / f"dataquay-{os.getuid()}" / f"slurm-{job_id}"
    assert result["read"] == dataset_bytes
    assert (result["addr"], result["job"]) == (str(run_dir / "dataquay.sock"), f"slurm-{job_id}")
    assert result["directory"].startswith("127.0.0.1:")
    assert "dataquay: 1 daemon(s) up" in output
    assert _processes_under(str(scratch)) == []
    assert not (run_dir / "dataquay.sock").exists(), (run_dir / "daemons.log").read_text()
