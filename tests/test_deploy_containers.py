"""The container recipes and the Kubernetes manifests: each parses, holds
the fields its runtime requires, runs the daemon with the systemd unit's
command and directories, as a user that is not root, and sets only settings
that exist. Images are built only where a container engine answers."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy_systemd import _known_env_names, _unit_settings

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def unit_environment() -> dict[str, str]:
    """The daemon unit's Environment= (XDG_* folders the defaults derive from)."""
    (line,) = _unit_settings("dataquay.service")["Environment"]
    return dict(word.split("=", 1) for word in shlex.split(line))


def unit_command() -> list[str]:
    """The unit's ExecStart, less the executable's path."""
    (line,) = _unit_settings("dataquay.service")["ExecStart"]
    return ["dataquay", *shlex.split(line)[1:]]


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """(instruction, argument) of the Dockerfile's last stage, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "docker" / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        instruction, _, argument = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), argument.strip()))
    assert len(stages) >= 2, "the Dockerfile builds in one stage and ships in another"
    return stages[-1]


def test_the_dockerfile_runs_the_units_command_as_a_user_with_the_units_folders() -> None:
    final = dockerfile_final_stage()
    last = {instruction: argument for instruction, argument in final}
    assert yaml.safe_load(last["ENTRYPOINT"]) + yaml.safe_load(last["CMD"]) == unit_command() == ["dataquay", "serve"]
    assert last["USER"] not in ("root", "0", "")
    env = dict(shlex.split(word)[0].split("=", 1) for word in shlex.split(last["ENV"]))
    assert {k: env[k] for k in unit_environment()} == unit_environment()
    assert not any(instruction == "COPY" and "--from=" not in argument for instruction, argument in final), (
        "the final stage takes only the build stage's install, not the sources"
    )


def test_the_apptainer_definition_starts_the_units_command_and_checks_itself() -> None:
    text = (DEPLOY / "apptainer" / "dataquay.def").read_text()
    headers = re.findall(r"^(Bootstrap|From|Stage):\s*(\S+)", text, re.M)
    assert [value for key, value in headers if key == "Bootstrap"] == ["docker", "docker"]
    assert [value for key, value in headers if key == "Stage"] == ["build", "final"]
    sections = dict(re.findall(r"^%(\w+)[^\n]*\n(.*?)(?=^%|^Bootstrap:|\Z)", text, re.M | re.S))
    start = [line.strip() for line in sections["startscript"].splitlines() if line.strip() and line.strip()[0] != "#"]
    assert start == ["exec " + shlex.join(unit_command())]
    assert sections["runscript"].strip() == 'exec dataquay "$@"'
    assert sections["test"].strip() == "dataquay --version"


def manifests() -> dict[str, dict[str, Any]]:
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "dataquay.yaml").read_text()))
    return {document["kind"]: document for document in documents}


def test_the_kubernetes_manifests_hold_the_fields_each_kind_requires() -> None:
    kinds = manifests()
    assert sorted(kinds) == ["DaemonSet", "Deployment", "Namespace", "Service"]
    for kind in ("DaemonSet", "Deployment"):
        spec = kinds[kind]["spec"]
        assert kinds[kind]["apiVersion"] == "apps/v1" and kinds[kind]["metadata"]["namespace"] == "dataquay"
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        pod = spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        mounted = {m["name"] for c in pod["containers"] + pod.get("initContainers", []) for m in c["volumeMounts"]}
        assert mounted == {v["name"] for v in pod["volumes"]}
        for container in pod["containers"]:
            assert set(container) >= {"name", "image", "args"}
            assert {e["name"] for e in container["env"]} <= _known_env_names()
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            probe = container["readinessProbe"]["httpGet"]["port"]
            assert probe in ports
    service = kinds["Service"]["spec"]
    assert service["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]


def test_the_daemonset_runs_the_units_command_on_the_nodes_network_with_a_host_path_cache() -> None:
    daemonset = manifests()["DaemonSet"]["spec"]["template"]["spec"]
    (daemon,) = daemonset["containers"]
    assert ["dataquay", *daemon["args"]] == unit_command()
    assert daemonset["hostNetwork"] is True and daemonset["hostIPC"] is True
    volumes = {v["name"]: v for v in daemonset["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    # The image's XDG folders, as the unit's: the cache and the socket land in the host paths.
    cache = unit_environment()["XDG_CACHE_HOME"] + "/dataquay"
    runtime = unit_environment()["XDG_RUNTIME_DIR"] + "/dataquay"
    assert "hostPath" in volumes[mounts[cache]] and "hostPath" in volumes[mounts[runtime]]
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    directory = manifests()["Service"]["spec"]["ports"][0]["port"]
    assert env["DATAQUAY_DIRECTORY"] == f"dataquay-directory.dataquay.svc:{directory}"
    assert env["DATAQUAY_LISTEN"].endswith(f":{daemon['ports'][0]['containerPort']}")


def test_each_recipe_folder_has_a_readme_that_names_its_build_command() -> None:
    for folder, command in (
        ("docker", "docker build"),
        ("apptainer", "apptainer build"),
        ("kubernetes", "kubectl apply"),
    ):
        assert command in (DEPLOY / folder / "README.md").read_text(), folder


def _engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _engine_answers(), reason="no container engine answers here (docker info fails)")
def test_the_image_builds_and_its_entry_point_is_dataquay() -> None:
    subprocess.run(
        ["docker", "build", "-f", str(DEPLOY / "docker" / "Dockerfile"), "-t", "dataquay:test", str(REPO)],
        check=True,
        timeout=1800,
    )
    version = subprocess.run(
        ["docker", "run", "--rm", "dataquay:test", "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and version.stdout.startswith("dataquay ")
    user = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", "dataquay:test", "-u"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert user.stdout.strip() == "970"
