"""The Prometheus side of deploy/: the alert rules and the scrape config,
checked and unit-tested by promtool, and a real Prometheus finding daemons
through the directory's /sd and through the Slurm prolog's target files.

Each test skips where promtool or prometheus is missing (`make tools`
installs Debian's prometheus package as root).
"""

from __future__ import annotations

import getpass
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import wait_until
from test_dashboard import exported_names, metric_names
from test_deploy_slurm import JOB_ID, _run_as_slurmd, _slurmd_env, prolog_with_target_folder, slurm_dir  # noqa: F401 (slurm_dir: a fixture)

from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess

PROMETHEUS_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "dataquay-rules.yml"
RULE_TESTS = Path(__file__).resolve().parent / "prometheus" / "dataquay-rules.test.yml"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")


@needs_promtool
def test_alert_rules_and_scrape_config_pass_promtool(tmp_path: Path) -> None:
    rules = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 6 rules found" in rules.stdout
    config = subprocess.run(
        ["promtool", "check", "config", "prometheus.yml"],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_each_alert_fires_on_its_condition_and_not_on_a_healthy_node() -> None:
    result = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        line.split(":", 1)[1].strip()
        for line in RULE_TESTS.read_text().splitlines()
        if line.strip().startswith("alertname:")
    }
    named = {
        line.split(":", 1)[1].strip() for line in RULES.read_text().splitlines() if line.strip().startswith("- alert:")
    }
    assert tested == named and len(named) == 6


def test_alert_rules_query_only_metrics_a_daemon_or_directory_exports(tmp_path: Path) -> None:
    exprs, lines = [], RULES.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("expr:"):
            expr = line.split("expr:", 1)[1].strip()
            if expr == ">-":
                expr = " ".join(next_line.strip() for next_line in _indented_after(lines, i))
            exprs.append(expr)
    used = set().union(*map(metric_names, exprs))
    assert len(exprs) == 6 and "up" in used

    daemon = DaemonProcess(tmp_path / "node")
    directory = DirectoryProcess(tmp_path / "directory")
    try:
        daemon.start()
        directory.start()
        exported = exported_names(urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode())
        exported |= exported_names(urllib.request.urlopen(directory.http_url + "/metrics", timeout=10).read().decode())
    finally:
        daemon.kill()
        directory.kill()
    assert used - exported == {"up"}


def _indented_after(lines: list[str], index: int) -> Iterator[str]:
    """The lines of a YAML block scalar that starts after ``lines[index]``."""
    indent = len(lines[index]) - len(lines[index].lstrip())
    for line in lines[index + 1 :]:
        if len(line) - len(line.lstrip()) <= indent:
            return
        yield line


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Prometheus:
    """A real Prometheus on loopback, scraping every second, with the
    project's alert rules."""

    def __init__(self, home: Path, scrape_configs: list[dict[str, Any]]) -> None:
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy(RULES, home / RULES.name)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "500ms"},
            "rule_files": [RULES.name],
            "scrape_configs": scrape_configs,
        }
        # JSON is YAML: no YAML writer needed.
        (home / "prometheus.yml").write_text(json.dumps(config))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = open(home / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={home / 'prometheus.yml'}",
                f"--storage.tsdb.path={home / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, "prometheus serves")

    def _ready(self) -> bool:
        assert self.process.poll() is None, "prometheus exited"
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
            answer = json.loads(reply.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def series(self, query: str) -> dict[str, str]:
        """``{dataquay_node or instance: value}`` of an instant query."""
        return {
            r["metric"].get("dataquay_node", r["metric"].get("instance", "")): r["value"][1]
            for r in self.api("query", query=query)["result"]
        }

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    started: list[Prometheus] = []

    def start(scrape_configs: list[dict[str, Any]]) -> Prometheus:
        started.append(Prometheus(tmp_path / "prometheus", scrape_configs))
        return started[-1]

    yield start
    for prometheus in started:
        prometheus.close()


@needs_prometheus
def test_a_stopped_daemon_stays_a_target_with_up_0_and_its_alert_pends(tmp_path: Path, prometheus_for: Any) -> None:
    directory = DirectoryProcess(tmp_path / "directory", ("--lease-seconds", "2", "--heartbeat-seconds", "0.2"))
    directory.start()
    daemons = [
        DaemonProcess(tmp_path / name, ("--node-name", name, "--directory", directory.address)) for name in ("n1", "n2")
    ]
    try:
        for daemon in daemons:
            daemon.start()
        prometheus = prometheus_for(
            [
                {
                    "job_name": "dataquay",
                    "http_sd_configs": [{"url": directory.http_url + "/sd", "refresh_interval": "1s"}],
                }
            ]
        )
        wait_until(
            lambda: prometheus.series('up{job="dataquay", dataquay_state="up"}') == {"n1": "1", "n2": "1"},
            "both daemons scraped",
        )
        daemons[1].kill()
        # The directory marks n2 down once its lease runs out; it stays a
        # target, now labelled down, and its scrapes fail.
        wait_until(
            lambda: prometheus.series('up{job="dataquay", dataquay_state="down"}') == {"n2": "0"},
            "n2 listed down with up 0",
            timeout=30,
        )
        wait_until(
            lambda: prometheus.series('ALERTS{alertname="DataquayNodeDown", alertstate="pending"}') == {"n2": "1"},
            "DataquayNodeDown pending for n2",
        )
        assert prometheus.series('up{job="dataquay"} == 1') == {"n1": "1"}
    finally:
        for daemon in daemons:
            daemon.kill()
        directory.kill()


@needs_prometheus
def test_prometheus_finds_a_slurm_jobs_daemons_and_directory_by_the_prologs_files(
    slurm_dir: Path,  # noqa: F811 (the fixture)
    prometheus_for: Any,
) -> None:
    sd_dir, prolog = prolog_with_target_folder(slurm_dir, 0o755)
    site = {"DATAQUAY_PROMETHEUS_SD_DIR": str(sd_dir)}
    assert prolog.returncode == 0, prolog.stderr
    job_dir = slurm_dir / "nodes" / "users" / getpass.getuser() / f"job-{JOB_ID}"
    directory = json.loads((job_dir / "directory.ready.json").read_text())

    prometheus = prometheus_for(
        [
            {
                "job_name": "dataquay",
                "file_sd_configs": [{"files": [str(sd_dir / "*.daemons.json")], "refresh_interval": "1s"}],
            },
            {
                "job_name": "dataquay-directory",
                "file_sd_configs": [{"files": [str(sd_dir / "*.directory.json")], "refresh_interval": "1s"}],
            },
        ]
    )
    wait_until(
        lambda: (
            prometheus.series(f'up{{slurm_job="{JOB_ID}"}} == 1')
            == {"localhost": "1", f"localhost:{directory['http_port']}": "1"}
        ),
        "the job's servers scraped",
    )
    assert prometheus.series(f'dataquay_directory_nodes{{slurm_job="{JOB_ID}", state="up"}}') == {
        f"localhost:{directory['http_port']}": "1"
    }

    epilog = _run_as_slurmd("epilog.sh", _slurmd_env(slurm_dir, "epilog", JOB_ID, "", "SLURM_NODELIST", **site))
    assert epilog.returncode == 0, epilog.stderr
    assert list(sd_dir.iterdir()) == []
    # Gone with the job: no target left, so nothing to alert on.
    wait_until(lambda: prometheus.api("targets", state="active")["activeTargets"] == [], "the job's targets gone")
