"""The Slurm scripts under a real Slurm: slurmctld and slurmd on loopback,
jobs submitted with sbatch, deploy/slurm's Prolog, Epilog and TaskProlog
configured in slurm.conf as an administrator would.

Needs root (slurmd runs prologs as root and starts the job's steps) and the
Slurm daemons (`make tools` installs Debian's slurmctld, slurmd and
slurm-client as root); skips elsewhere. Jobs run as root too: an ordinary
user could not run the project's interpreter on every machine the tests run
on. Authentication is auth/none: nothing leaves loopback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import wait_until
from test_deploy_slurm import DATAQUAY_BIN, SLURM, SLURMD_ENV, _processes_under, slurm_dir  # noqa: F401

from dataquay.server.tools.synthetic import make_files_dataset

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "squeue")),
    reason="needs root and Slurm's slurmctld, slurmd, sbatch and squeue",
)

#: A job that reads every sample of its dataset through the client, with the
#: settings the TaskProlog handed it, and prints what it read and what its
#: node's daemon has read from the PFS.
JOB = """#!/bin/bash
exec {python} - <<'PY'
import json, os, urllib.request
import dataquay.client as dq
with dq.connect() as client:
    samples = client.dataset(os.environ["DATAQUAY_DATASET"]).get_batch(list(range({samples})))
ready = json.load(open(os.path.join(os.path.dirname(os.environ["DATAQUAY_ADDR"]), "daemon.ready.json")))
page = urllib.request.urlopen(f"http://127.0.0.1:{{ready['metrics_port']}}/metrics", timeout=10).read().decode()
pfs = [line.split()[1] for line in page.splitlines() if line.startswith("dataquay_pfs_read_bytes_total ")]
print(json.dumps({{"read": sum(map(len, samples)), "pfs": float(pfs[0])}}))
PY
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SlurmCluster:
    """slurmctld and one slurmd (node ``localhost``) under ``base``."""

    def __init__(self, base: Path, scripts: bool = True) -> None:
        """``scripts``: configure deploy/slurm's Prolog, Epilog and TaskProlog (False: a site without them)."""
        self.base = base
        for name in ("ctld", "spool", "log", "out"):
            (base / name).mkdir()
        # Each script records the environment slurmd gave it, then runs ours.
        for script in ("prolog", "epilog", "task-prolog"):
            wrapper = base / script
            wrapper.write_text(
                f"#!/bin/bash\nenv >{base}/env.{script}.$SLURM_JOB_ID\n"
                f"DATAQUAY_SLURM_CONF={base}/slurm.env exec /bin/bash {SLURM / script}.sh\n"
            )
            wrapper.chmod(0o755)
        (base / "slurm.conf").write_text(
            "\n".join(
                [
                    "ClusterName=dqtest",
                    "SlurmctldHost=localhost",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "AuthType=auth/none",
                    "CredType=cred/none",
                    f"StateSaveLocation={base}/ctld",
                    f"SlurmdSpoolDir={base}/spool",
                    f"SlurmctldPidFile={base}/ctld.pid",
                    f"SlurmdPidFile={base}/slurmd.pid",
                    f"SlurmctldLogFile={base}/log/slurmctld.log",
                    f"SlurmdLogFile={base}/log/slurmd.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/linear",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "PrologFlags=Alloc",
                    *(
                        [f"Prolog={base}/prolog", f"Epilog={base}/epilog", f"TaskProlog={base}/task-prolog"]
                        if scripts
                        else []
                    ),
                    "NodeName=localhost CPUs=1 State=UNKNOWN",
                    "PartitionName=debug Nodes=localhost Default=YES State=UP",
                ]
            )
            + "\n"
        )
        self.env = {**os.environ, "SLURM_CONF": str(base / "slurm.conf")}
        self.daemons = [
            subprocess.Popen(["slurmctld", "-D", "-i"], env=self.env, cwd=base, stderr=subprocess.DEVNULL),
            subprocess.Popen(["slurmd", "-D", "-N", "localhost"], env=self.env, cwd=base, stderr=subprocess.DEVNULL),
        ]
        try:
            wait_until(lambda: self._command("sinfo", "-h", "-o", "%t") == "idle", "the node idle")
        except AssertionError:
            self.close()
            raise

    def _command(self, *argv: str) -> str:
        assert all(d.poll() is None for d in self.daemons), (self.base / "log" / "slurmctld.log").read_text()
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return result.stdout.strip() if result.returncode == 0 else ""

    def run_job(self, script: Path, comment: str = "") -> tuple[str, str]:
        """Submits ``script`` and waits until it ran and its epilog is done;
        returns the job id and the job's output."""
        commented = ("--comment", comment) if comment else ()
        job_id = self._command("sbatch", "--parsable", *commented, "-o", f"{self.base}/out/%j.txt", str(script))
        assert job_id.isdigit(), "sbatch refused the job"
        wait_until(lambda: self._command("squeue", "-h", "-j", job_id, "-o", "%i") == "", f"job {job_id} over")
        return job_id, (self.base / "out" / f"{job_id}.txt").read_text()

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


@pytest.fixture
def slurm(slurm_dir: Path) -> Iterator[SlurmCluster]:  # noqa: F811 (the fixture)
    cluster = SlurmCluster(slurm_dir)
    yield cluster
    cluster.close()


def test_two_sbatch_jobs_in_a_row_the_second_reads_nothing_from_the_pfs(slurm: SlurmCluster) -> None:
    base = slurm.base
    root = make_files_dataset(base / "pfs" / "synth", 120, sizes=(1000, 3000))
    dataset_bytes = sum(p.stat().st_size for p in root.rglob("*.bin"))
    (base / "slurm.env").write_text(
        "".join(
            f"{key}={value}\n"
            for key, value in {
                "DATAQUAY_BIN": DATAQUAY_BIN,
                "DATAQUAY_SLURM_DIR": base / "nodes",
                "DATAQUAY_STAGE_REQUIRED": 1,
                "DATAQUAY_LISTEN": "127.0.0.1:0",
                "DATAQUAY_METRICS_HOST": "127.0.0.1",
                "DATAQUAY_DIRECTORY_LISTEN": "127.0.0.1:0",
                "DATAQUAY_DIRECTORY_HTTP_HOST": "127.0.0.1",
                "DATAQUAY_DATASET_ROOTS": base / "pfs",
                "DATAQUAY_DIRECTORY_DATASET_ROOTS": base / "pfs",
            }.items()
        )
    )
    job = base / "job.sh"
    job.write_text(JOB.format(python=DATAQUAY_BIN.with_name("python"), samples=120))
    job.chmod(0o755)
    comment = f"dataquay.dataset=synth dataquay.dataset_root={root} dataquay.seed=7"

    runs = [slurm.run_job(job, comment) for _ in range(2)]
    results = [json.loads(output.strip().splitlines()[-1]) for _, output in runs]
    assert results == [{"read": dataset_bytes, "pfs": dataset_bytes}, {"read": dataset_bytes, "pfs": 0}]
    assert _processes_under(str(base / "nodes")) == []

    # What this slurmd gave the scripts is what the tests run them in elsewhere.
    version = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=30).stdout.split()[-1]
    if version.startswith("22.05."):
        job_id = runs[0][0]
        for script in ("prolog", "epilog"):
            assert _slurm_names(base / f"env.{script}.{job_id}") == _slurm_names(SLURMD_ENV / f"22.05-{script}.env")


def _slurm_names(env_file: Path) -> set[str]:
    """The Slurm variables the scripts read that an ``env`` listing names."""
    read = set(re.findall(r"\bSLURMD?_[A-Z_]+", "".join(p.read_text() for p in SLURM.glob("*.sh"))))
    return {line.partition("=")[0] for line in env_file.read_text().splitlines()} & read
