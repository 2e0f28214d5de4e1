"""The prolog publishes Prometheus targets of the allocation's own nodes only,
whatever else a token holder registered at the job's directory. The prolog
runs for real, as slurmd runs it (see tests/test_deploy_slurm.py)."""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
from pathlib import Path

from test_deploy_slurm import DATAQUAY_BIN, JOB_ID, NODE, _run_as_slurmd, _slurmd_env, slurm_dir

__all__ = ["slurm_dir"]  # the fixture, used by name

#: A node outside the allocation, and where it would have Prometheus scrape.
INTRUDER = "intruder"
INTRUDER_TARGET = "198.51.100.7:9100"

#: Registers INTRUDER at the directory ($1) as a token holder can.
REGISTER = f"""
import sys, grpc
from dataquay.protos import directory_pb2 as dpb, directory_pb2_grpc, jobs_pb2 as jpb
node = jpb.NodeInfo(name="{INTRUDER}", tcp_address="198.51.100.7:7070", metrics_address="{INTRUDER_TARGET}",
                    cache_capacity=1 << 30, pid=1, version="test")
with grpc.insecure_channel(sys.argv[1]) as channel:
    request = dpb.RegisterNodeRequest(node=node, identity_key=bytes(32))
    directory_pb2_grpc.DirectoryStub(channel).RegisterNode(request, timeout=10)
"""


def intruding_dataquay(base: Path) -> Path:
    """A ``dataquay`` that registers INTRUDER at the job's directory each time the
    prolog asks the directory which nodes are up, then does what it was asked:
    the directory lists the intruder by the time the prolog reads its targets."""
    (base / "register.py").write_text(REGISTER)
    wrapper = base / "dataquay"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = status ]; then {sys.executable} {base / "register.py"} "$3" || exit 1; fi\n'
        f'exec {DATAQUAY_BIN} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_prolog_publishes_targets_of_the_allocations_nodes_only(slurm_dir: Path) -> None:
    sd_dir = slurm_dir / "prometheus-sd"
    sd_dir.mkdir(mode=0o755)
    site = {"DATAQUAY_PROMETHEUS_SD_DIR": str(sd_dir), "DATAQUAY_BIN": str(intruding_dataquay(slurm_dir))}
    prolog = _run_as_slurmd("prolog.sh", _slurmd_env(slurm_dir, "prolog", JOB_ID, "", "SLURM_JOB_NODELIST", **site))
    assert prolog.returncode == 0, prolog.stderr

    job_dir = slurm_dir / "nodes" / "users" / getpass.getuser() / f"job-{JOB_ID}"
    daemon = json.loads((job_dir / "daemon.ready.json").read_text())
    directory = json.loads((job_dir / "directory.ready.json").read_text())
    # The intruder is there to be taken...
    status = subprocess.run(
        [str(DATAQUAY_BIN), "status", "--directory", directory["tcp"]], capture_output=True, text=True, timeout=60
    )
    assert INTRUDER in status.stdout
    # ... and only the allocation's node is published.
    assert json.loads((sd_dir / f"slurm-{JOB_ID}.daemons.json").read_text()) == [
        {
            "targets": [f"127.0.0.1:{daemon['metrics_port']}"],
            "labels": {"slurm_job": JOB_ID, "dataquay_node": NODE, "dataquay_state": "up"},
        }
    ]
    assert INTRUDER_TARGET not in "".join(p.read_text() for p in sd_dir.iterdir())
