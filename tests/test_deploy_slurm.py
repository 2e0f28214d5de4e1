"""The Slurm prolog and epilog under deploy/slurm.

They run for real on this machine, as a one-node allocation named
``localhost``, against the project's ``dataquay`` executable, with every
directory under a temporary one and every port picked by the OS. The
shellcheck lint skips when shellcheck is missing.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import dataquay.client as dq
from dataquay.client.wire.security import read_token
from dataquay.server.auth import new_token_file
from dataquay.server.tools.env_files import read_env_file
from dataquay.server.tools.pids import stat_state
from dataquay.server.tools.synthetic import make_files_dataset

SLURM = Path(__file__).resolve().parent.parent / "deploy" / "slurm"
#: The project's console script, beside the interpreter running the tests.
DATAQUAY_BIN = Path(sys.executable).with_name("dataquay")
SHELL_SCRIPTS = ("dataquay-slurm.sh", "prolog.sh", "epilog.sh", "task-prolog.sh", "train.sbatch")

JOB_ID = "4242"
NODE = "localhost"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_slurm_scripts_pass_shellcheck() -> None:
    result = subprocess.run(
        ["shellcheck", "--external-sources", *SHELL_SCRIPTS], cwd=SLURM, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _bash(snippet: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs ``snippet`` after sourcing the scripts' shared library."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; . "$0"; {snippet}', str(SLURM / "dataquay-slurm.sh")],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(("nodelist", "nodes"), [("gpu7", ["gpu7"]), ("gpu3,gpu1,gpu2", ["gpu3", "gpu1", "gpu2"])])
def test_nodelist_of_plain_names_expands_in_slurm_order(nodelist: str, nodes: list[str]) -> None:
    result = _bash("dq_nodes", {"SLURM_JOB_NODELIST": nodelist})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == nodes


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="scontrol is installed and expands it")
def test_bracketed_nodelist_without_scontrol_fails_in_one_line() -> None:
    result = _bash("dq_nodes", {"SLURM_JOB_NODELIST": "gpu[1-4]", "SLURM_JOB_ID": "7"})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("error: cannot expand SLURM_JOB_NODELIST=gpu[1-4] without scontrol")


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed")
def test_bracketed_nodelist_expands_with_the_nodes_slurm_conf(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("ClusterName=dq\nSlurmctldHost=gpu1\n")
    result = _bash("dq_nodes", {"SLURM_NODELIST": "gpu[3,1-2],cpu9", "SLURM_CONF": str(tmp_path / "slurm.conf")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["gpu3", "gpu1", "gpu2", "cpu9"]


def test_job_comment_sets_only_the_job_settings() -> None:
    comment = (
        "run 17 dataquay.dataset=imagenet dataquay.seed=42 dataquay.bin=/tmp/evil "
        "dataquay.slurm_dir=/ dataquay.mode=partial"
    )
    result = _bash(
        'dq_comment_settings; printf "%s|" "$DATAQUAY_DATASET" "$DATAQUAY_SEED" "${DATAQUAY_MODE}" '
        '"${DATAQUAY_BIN:-unset}" "${DATAQUAY_SLURM_DIR:-unset}"',
        {"SLURM_JOB_COMMENT": comment, "DATAQUAY_MODE": "local"},
    )
    assert result.returncode == 0, result.stderr
    # The environment beats the comment; the comment never names programs or paths.
    assert result.stdout == "imagenet|42|local|unset|unset|"


def _alive(pid: int) -> bool:
    """Running and not a zombie (an exited daemon whose parent, the prolog, is gone)."""
    try:
        return stat_state(Path(f"/proc/{pid}/stat")) != "Z"
    except OSError:
        return False


def _processes_under(marker: str) -> list[int]:
    """Live processes with ``marker`` in their command line."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and _alive(int(proc.name)):
                found.append(int(proc.name))
    return found


@pytest.fixture
def slurm_dir() -> Iterator[Path]:
    """A short base directory (the daemon's socket path must stay below 108
    bytes); every process started under it is killed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dq-slurm-"))
    yield base
    for pid in _processes_under(str(base)):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(base, ignore_errors=True)


def _slurm_env(base: Path, **more: str) -> dict[str, str]:
    """What slurmd would give the scripts for job JOB_ID on one node, plus
    the settings that keep everything under ``base`` and on loopback."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": NODE,
        "SLURMD_NODENAME": NODE,
        "SLURM_JOB_USER": getpass.getuser(),
        "DATAQUAY_BIN": str(DATAQUAY_BIN),
        "DATAQUAY_SLURM_CONF": str(base / "site-settings.env"),
        "DATAQUAY_SLURM_DIR": str(base / "nodes"),
        "DATAQUAY_LISTEN": "127.0.0.1:0",
        "DATAQUAY_METRICS_HOST": "127.0.0.1",
        "DATAQUAY_DIRECTORY_LISTEN": "127.0.0.1:0",
        "DATAQUAY_DIRECTORY_HTTP_HOST": "127.0.0.1",
        # The site's PFS mount points, as slurm.env would name them.
        "DATAQUAY_DATASET_ROOTS": str(base),
        "DATAQUAY_DIRECTORY_DATASET_ROOTS": str(base),
        **more,
    }


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM / script)], env=env, capture_output=True, text=True, timeout=120)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def _sample(text: str, series: str) -> float:
    """The value of one series line of a Prometheus text page."""
    values = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.rpartition(" ")[0] == series]
    assert len(values) == 1, f"{series} not exported exactly once"
    return values[0]


def test_prolog_starts_and_stages_and_epilog_stops_everything(slurm_dir: Path) -> None:
    assert DATAQUAY_BIN.exists(), f"no dataquay console script at {DATAQUAY_BIN}: pip install -e ."
    root = make_files_dataset(slurm_dir / "pfs" / "synth", 120, sizes=(1000, 3000))
    comment = f"dataquay.dataset=synth dataquay.dataset_root={root} dataquay.seed=7"
    env = _slurm_env(slurm_dir, SLURM_JOB_COMMENT=comment, DATAQUAY_STAGE_REQUIRED="1")
    # Site settings reach the daemon.
    Path(env["DATAQUAY_SLURM_CONF"]).write_text("DATAQUAY_CACHE_SIZE=64MiB\n")
    user_dir = slurm_dir / "nodes" / "users" / getpass.getuser()
    job_dir = user_dir / f"job-{JOB_ID}"

    first = _run("prolog.sh", env)
    assert first.returncode == 0, first.stderr
    daemon = json.loads((job_dir / "daemon.ready.json").read_text())
    directory = json.loads((job_dir / "directory.ready.json").read_text())
    assert _alive(daemon["pid"]) and _alive(directory["pid"])
    assert (daemon["node"], daemon["directory"], daemon["cache_dir"]) == (
        NODE,
        directory["tcp"],
        str(user_dir / "cache"),
    )
    assert read_env_file(job_dir / "dataquay.env") == {
        "DATAQUAY_ADDR": str(job_dir / "dataquay.sock"),
        "DATAQUAY_DIRECTORY": directory["tcp"],
        "DATAQUAY_JOB": f"slurm-{JOB_ID}",
        "DATAQUAY_DATASET": "synth",
        "DATAQUAY_SEED": "7",
    }
    staged = _metrics(daemon["metrics_port"])
    assert _sample(staged, 'dataquay_staging_samples{dataset="synth"}') == 120
    assert _sample(staged, 'dataquay_staging_total_samples{dataset="synth"}') == 120
    assert _sample(staged, "dataquay_cache_entries") == 120
    assert _sample(staged, "dataquay_cache_capacity_bytes") == 64 << 20
    pfs_bytes = _sample(staged, "dataquay_pfs_read_bytes_total")
    assert pfs_bytes == sum(p.stat().st_size for p in root.rglob("*.bin"))
    at_directory = _metrics(directory["http_port"])
    assert _sample(at_directory, 'dataquay_directory_nodes{state="up"}') == 1
    assert _sample(at_directory, "dataquay_directory_jobs") == 1
    assert _sample(at_directory, "dataquay_directory_datasets") == 1

    again = _run("prolog.sh", env)
    assert again.returncode == 0, again.stderr
    assert json.loads((job_dir / "daemon.ready.json").read_text())["pid"] == daemon["pid"]
    assert json.loads((job_dir / "directory.ready.json").read_text())["pid"] == directory["pid"]
    assert "daemon already running" in again.stderr
    assert sorted(_processes_under(str(slurm_dir))) == sorted([daemon["pid"], directory["pid"]])
    # Staged again: nothing left to read from the PFS.
    assert _sample(_metrics(daemon["metrics_port"]), "dataquay_pfs_read_bytes_total") == pfs_bytes

    task = _run("task-prolog.sh", env)
    assert task.returncode == 0, task.stderr
    assert sorted(task.stdout.splitlines()) == [
        f"export DATAQUAY_ADDR={job_dir / 'dataquay.sock'}",
        "export DATAQUAY_DATASET=synth",
        f"export DATAQUAY_DIRECTORY={directory['tcp']}",
        f"export DATAQUAY_JOB=slurm-{JOB_ID}",
        "export DATAQUAY_SEED=7",
    ]

    stop = _run("epilog.sh", env)
    assert stop.returncode == 0, stop.stderr
    assert not _alive(daemon["pid"]) and not _alive(directory["pid"])
    assert _processes_under(str(slurm_dir)) == []
    # The cache stays for the user's next job on this node; the job's files go.
    assert sorted(p.name for p in user_dir.iterdir()) == [".lock", "cache", "state"]
    assert (user_dir / "cache" / "data.mdb").is_file()
    log = (slurm_dir / "nodes" / "log" / f"job-{JOB_ID}.log").read_text()
    assert "epilog: daemon stopped" in log and "epilog: directory stopped" in log

    assert _run("epilog.sh", env).returncode == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_node_allocation_stages_each_node_its_share(slurm_dir: Path) -> None:
    """Two nodes on this machine, each with a base directory of its own as
    separate hosts would have: the second finds the directory by the first
    node's name and the fixed port; the first stages once both are up."""
    root = make_files_dataset(slurm_dir / "pfs" / "synth", 120, sizes=(2000,))
    token = new_token_file(slurm_dir / "token")
    port = _free_port()
    common = {
        "SLURM_JOB_NODELIST": f"{NODE},nodeb",
        "SLURM_JOB_COMMENT": f"dataquay.dataset=synth dataquay.dataset_root={root} dataquay.seed=3",
        "DATAQUAY_TOKEN_FILE": str(token),
        "DATAQUAY_DIRECTORY_LISTEN": f"127.0.0.1:{port}",
        "DATAQUAY_STAGE_REQUIRED": "1",
        "DATAQUAY_NODES_TIMEOUT": "60",
    }
    nodes = {NODE: slurm_dir / "nodes", "nodeb": slurm_dir / "nodes-b"}
    envs = {
        name: _slurm_env(slurm_dir, SLURMD_NODENAME=name, DATAQUAY_SLURM_DIR=str(base), **common)
        for name, base in nodes.items()
    }
    job_dirs = {name: base / "users" / getpass.getuser() / f"job-{JOB_ID}" for name, base in nodes.items()}

    prologs = {
        name: subprocess.Popen(["bash", str(SLURM / "prolog.sh")], env=env, stderr=subprocess.PIPE, text=True)
        for name, env in envs.items()
    }
    errors = {name: prolog.communicate(timeout=120)[1] for name, prolog in prologs.items()}
    for name, prolog in prologs.items():
        assert prolog.returncode == 0, f"{name}: {errors[name]}"

    ready = {name: json.loads((job_dirs[name] / "daemon.ready.json").read_text()) for name in nodes}
    assert ready["nodeb"]["directory"] == f"{NODE}:{port}"
    trainers_env = read_env_file(job_dirs["nodeb"] / "dataquay.env")
    assert trainers_env["DATAQUAY_TOKEN_FILE"] == str(token)
    assert not any("NODE_TOKEN" in name for name in trainers_env)
    # Both nodes derived the same node token for the job, the job user's alone, not the cluster token.
    node_tokens = {name: read_token(job_dir / "node-token") for name, job_dir in job_dirs.items()}
    assert node_tokens[NODE] == node_tokens["nodeb"] != read_token(token)
    # The token is in force: a call without it is refused.
    refused = subprocess.run(
        [str(DATAQUAY_BIN), "job", "ls", "--directory", f"127.0.0.1:{port}"],
        env={"PATH": os.environ["PATH"], "DATAQUAY_CONFIG": "/dev/null"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 1 and "needs the cluster token" in refused.stderr, refused.stderr
    assert not (job_dirs["nodeb"] / "directory.ready.json").exists()
    staged = {name: _metrics(r["metrics_port"]) for name, r in ready.items()}
    shares = {name: _sample(page, 'dataquay_staging_samples{dataset="synth"}') for name, page in staged.items()}
    assert sum(shares.values()) == 120 and min(shares.values()) > 0
    assert {name: _sample(page, "dataquay_cache_entries") for name, page in staged.items()} == shares
    directory = json.loads((job_dirs[NODE] / "directory.ready.json").read_text())
    assert _sample(_metrics(directory["http_port"]), 'dataquay_directory_nodes{state="up"}') == 2

    for name in ("nodeb", NODE):
        stop = _run("epilog.sh", envs[name])
        assert stop.returncode == 0, f"{name}: {stop.stderr}"
    assert _processes_under(str(slurm_dir)) == []
    assert not any(job_dir.exists() for job_dir in job_dirs.values())


@pytest.mark.parametrize(("wipe", "kept"), [("0", True), ("1", False)])
def test_epilog_wipes_the_users_cache_only_when_asked(slurm_dir: Path, wipe: str, kept: bool) -> None:
    user_dir = slurm_dir / "nodes" / "users" / getpass.getuser()
    (user_dir / f"job-{JOB_ID}").mkdir(parents=True)
    (user_dir / "cache").mkdir()
    (user_dir / "cache" / "data.mdb").write_bytes(b"cached")
    (user_dir / "cache.job").write_text(f"{JOB_ID}\n")

    result = _run("epilog.sh", _slurm_env(slurm_dir, DATAQUAY_WIPE=wipe))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in user_dir.iterdir()) == ([".lock", "cache"] if kept else [".lock"])
    assert (user_dir / "cache" / "data.mdb").exists() is kept


def test_prolog_refuses_a_user_directory_that_is_a_link(slurm_dir: Path) -> None:
    """The prolog runs as root: a directory it writes in must be its own."""
    users = slurm_dir / "nodes" / "users"
    users.mkdir(parents=True)
    elsewhere = slurm_dir / "elsewhere"
    elsewhere.mkdir()
    (users / getpass.getuser()).symlink_to(elsewhere)
    result = _run("prolog.sh", _slurm_env(slurm_dir))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(
        f"error: {users / getpass.getuser()} must be a directory of uid {os.getuid()}, writable by nobody else"
    )
    assert list(elsewhere.iterdir()) == []


def test_prolog_that_cannot_start_the_daemon_fails_in_one_line(slurm_dir: Path) -> None:
    result = _run("prolog.sh", _slurm_env(slurm_dir, DATAQUAY_BIN=str(slurm_dir / "no-such-dataquay")))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert re.search(rf"job {JOB_ID} {NODE} prolog: error: directory exited at start: .*no-such-dataquay", lines[0])
    assert _processes_under(str(slurm_dir)) == []


SLURMD_ENV = Path(__file__).resolve().parent / "slurm_env"


def _slurmd_env(
    base: Path, script: str, job_id: str, comment: str, nodelist_var: str, **site_settings: str
) -> dict[str, str]:
    """What slurmd 22.05 really gives a prolog or epilog (tests/slurm_env/, captured
    from a real slurmd), for job ``job_id`` of this user on node ``localhost``,
    with the node list in ``nodelist_var``: 22.05 sets SLURM_NODELIST, newer
    releases SLURM_JOB_NODELIST. The site settings (the tests' own, then
    ``site_settings``) come from the slurm.env the scripts source, as on a
    real node; slurmd passes no PATH."""
    env = read_env_file(SLURMD_ENV / f"22.05-{script}.env")
    del env["SLURM_NODELIST"]
    uid, gid = str(os.getuid()), str(os.getgid())
    env.update(
        {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOBID": job_id,
            "SLURM_JOB_USER": getpass.getuser(),
            "SLURM_JOB_UID": uid,
            "SLURM_UID": uid,
            "SLURM_JOB_GID": gid,
            "SLURMD_NODENAME": NODE,
            "SLURM_JOB_COMMENT": comment,
            "SLURM_CONF": str(base / "slurm.conf"),
            nodelist_var: NODE,
            "DATAQUAY_SLURM_CONF": str(base / "slurm.env"),
        }
    )
    site = {k: v for k, v in _slurm_env(base).items() if k.startswith("DATAQUAY_") and k != "DATAQUAY_SLURM_CONF"}
    site.update(site_settings)
    (base / "slurm.env").write_text("".join(f"{k}={v}\n" for k, v in site.items()))
    (base / "slurm.conf").write_text(f"ClusterName=dq\nSlurmctldHost={NODE}\n")
    return env


def _run_as_slurmd(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``script`` run as slurmd runs it: bash by its path, slurmd's environment only."""
    return subprocess.run(["/bin/bash", str(SLURM / script)], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("nodelist_var", ["SLURM_NODELIST", "SLURM_JOB_NODELIST"])
def test_prolog_and_epilog_run_in_slurmds_own_environment(slurm_dir: Path, nodelist_var: str) -> None:
    job_dir = slurm_dir / "nodes" / "users" / getpass.getuser() / f"job-{JOB_ID}"
    prolog = _run_as_slurmd("prolog.sh", _slurmd_env(slurm_dir, "prolog", JOB_ID, "", nodelist_var))
    assert prolog.returncode == 0, prolog.stderr
    daemon = json.loads((job_dir / "daemon.ready.json").read_text())
    directory = json.loads((job_dir / "directory.ready.json").read_text())
    assert (daemon["node"], daemon["directory"]) == (NODE, directory["tcp"])
    assert sorted(_processes_under(str(slurm_dir))) == sorted([daemon["pid"], directory["pid"]])

    epilog = _run_as_slurmd("epilog.sh", _slurmd_env(slurm_dir, "epilog", JOB_ID, "", nodelist_var))
    assert epilog.returncode == 0, epilog.stderr
    assert _processes_under(str(slurm_dir)) == []
    assert not job_dir.exists()


def test_prolog_without_a_node_list_fails_in_one_line(slurm_dir: Path) -> None:
    env = _slurmd_env(slurm_dir, "prolog", JOB_ID, "", "SLURM_NODELIST")
    del env["SLURM_NODELIST"]
    result = _run_as_slurmd("prolog.sh", env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("error: neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set")


def test_users_next_job_reads_the_cached_dataset_and_nothing_from_the_pfs(slurm_dir: Path) -> None:
    """Two jobs of one user in a row on a node, each with a directory of its
    own that starts empty: the second finds the dataset in the user's cache."""
    root = make_files_dataset(slurm_dir / "pfs" / "synth", 120, sizes=(1000, 3000))
    comment = f"dataquay.dataset=synth dataquay.dataset_root={root} dataquay.seed=7"
    user_dir = slurm_dir / "nodes" / "users" / getpass.getuser()
    pfs_bytes = sum(p.stat().st_size for p in root.rglob("*.bin"))
    read: dict[str, float] = {}
    for job_id in ("4242", "4243"):
        env = _slurmd_env(slurm_dir, "prolog", job_id, comment, "SLURM_NODELIST", DATAQUAY_STAGE_REQUIRED="1")
        prolog = _run_as_slurmd("prolog.sh", env)
        assert prolog.returncode == 0, prolog.stderr
        daemon = json.loads((user_dir / f"job-{job_id}" / "daemon.ready.json").read_text())
        assert daemon["cache_dir"] == str(user_dir / "cache")
        page = _metrics(daemon["metrics_port"])
        assert _sample(page, 'dataquay_staging_samples{dataset="synth"}') == 120
        assert _sample(page, "dataquay_cache_entries") == 120
        with dq.connect(str(user_dir / f"job-{job_id}" / "dataquay.sock")) as client:
            samples = client.dataset("synth").get_batch(list(range(120)))
            # Local hits: the trainer maps the cache the second job inherited.
            assert client.stats().samples["local"] == 120
        assert sum(len(s) for s in samples) == pfs_bytes
        read[job_id] = _sample(_metrics(daemon["metrics_port"]), "dataquay_pfs_read_bytes_total")
        epilog = _run_as_slurmd("epilog.sh", _slurmd_env(slurm_dir, "epilog", job_id, comment, "SLURM_NODELIST"))
        assert epilog.returncode == 0, epilog.stderr
    assert read == {"4242": pfs_bytes, "4243": 0}


def test_two_jobs_of_a_user_starting_together_run_one_daemon_per_cache(slurm_dir: Path) -> None:
    user_dir = slurm_dir / "nodes" / "users" / getpass.getuser()
    jobs = ("4242", "4243")
    envs = {job: _slurmd_env(slurm_dir, "prolog", job, "dataquay.wipe=1", "SLURM_NODELIST") for job in jobs}
    prologs = {
        job: subprocess.Popen(["/bin/bash", str(SLURM / "prolog.sh")], env=env, stderr=subprocess.PIPE, text=True)
        for job, env in envs.items()
    }
    errors = {job: prolog.communicate(timeout=120)[1] for job, prolog in prologs.items()}
    assert {job: prolog.returncode for job, prolog in prologs.items()} == {"4242": 0, "4243": 0}, errors

    caches = {job: json.loads((user_dir / f"job-{job}" / "daemon.ready.json").read_text())["cache_dir"] for job in jobs}
    holder = (user_dir / "cache.job").read_text().strip()
    other = "4243" if holder == "4242" else "4242"
    assert caches == {holder: str(user_dir / "cache"), other: str(user_dir / f"job-{other}" / "cache")}
    assert f"job {holder} holds {user_dir / 'cache'}: this job gets a private cache" in errors[other]

    for job in jobs:
        epilog = _run_as_slurmd("epilog.sh", _slurmd_env(slurm_dir, "epilog", job, "dataquay.wipe=1", "SLURM_NODELIST"))
        assert epilog.returncode == 0, epilog.stderr
    assert _processes_under(str(slurm_dir)) == []
    # The holder's epilog wiped the shared cache, as the comment asked.
    assert sorted(p.name for p in user_dir.iterdir()) == [".lock"]


def prolog_with_target_folder(slurm_dir: Path, mode: int) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The job's prolog with DATAQUAY_PROMETHEUS_SD_DIR set to a new folder of ``mode``:
    the folder and the prolog's run."""
    sd_dir = slurm_dir / "prometheus-sd"
    sd_dir.mkdir()
    sd_dir.chmod(mode)
    site = {"DATAQUAY_PROMETHEUS_SD_DIR": str(sd_dir)}
    return sd_dir, _run_as_slurmd("prolog.sh", _slurmd_env(slurm_dir, "prolog", JOB_ID, "", "SLURM_NODELIST", **site))


def test_prolog_writes_prometheus_targets_for_the_job_and_the_epilog_removes_them(slurm_dir: Path) -> None:
    sd_dir, prolog = prolog_with_target_folder(slurm_dir, 0o755)
    assert prolog.returncode == 0, prolog.stderr
    site = {"DATAQUAY_PROMETHEUS_SD_DIR": str(sd_dir)}
    job_dir = slurm_dir / "nodes" / "users" / getpass.getuser() / f"job-{JOB_ID}"
    daemon = json.loads((job_dir / "daemon.ready.json").read_text())
    directory = json.loads((job_dir / "directory.ready.json").read_text())
    assert sorted(p.name for p in sd_dir.iterdir()) == [f"slurm-{JOB_ID}.{k}.json" for k in ("daemons", "directory")]
    assert json.loads((sd_dir / f"slurm-{JOB_ID}.daemons.json").read_text()) == [
        {
            "targets": [f"127.0.0.1:{daemon['metrics_port']}"],
            "labels": {"slurm_job": JOB_ID, "dataquay_node": NODE, "dataquay_state": "up"},
        }
    ]
    assert json.loads((sd_dir / f"slurm-{JOB_ID}.directory.json").read_text()) == [
        {"targets": [f"{NODE}:{directory['http_port']}"], "labels": {"slurm_job": JOB_ID}}
    ]

    epilog = _run_as_slurmd("epilog.sh", _slurmd_env(slurm_dir, "epilog", JOB_ID, "", "SLURM_NODELIST", **site))
    assert epilog.returncode == 0, epilog.stderr
    assert list(sd_dir.iterdir()) == []


def test_prolog_writes_no_prometheus_targets_where_others_could_swap_them(slurm_dir: Path) -> None:
    sd_dir, prolog = prolog_with_target_folder(slurm_dir, 0o777)
    # The job runs; Prometheus does not find it, and the log says why.
    assert prolog.returncode == 0, prolog.stderr
    assert f"DATAQUAY_PROMETHEUS_SD_DIR={sd_dir} must be a directory of uid {os.getuid()}" in prolog.stderr
    assert list(sd_dir.iterdir()) == []
