"""The systemd units under deploy/systemd: they verify, and they set only real
settings. Checks that need systemd-analyze skip when it is missing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from dataquay.server.config import DaemonConfig, DirectoryConfig

SYSTEMD = Path(__file__).resolve().parent.parent / "deploy" / "systemd"
UNITS = ("dataquay.service", "dataquay-directory.service")
#: Where the units expect dataquay (deploy/systemd/README.md installs it there).
INSTALLED_BIN = "/opt/dataquay/bin/dataquay"
#: The project's console script, beside the interpreter running the tests.
DATAQUAY_BIN = Path(sys.executable).with_name("dataquay")


def _known_env_names() -> set[str]:
    daemon = {DaemonConfig.env_prefix + f.name.upper() for f in fields(DaemonConfig)}
    directory = {DirectoryConfig.env_prefix + f.name.upper() for f in fields(DirectoryConfig)}
    return daemon | directory


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    assert DATAQUAY_BIN.exists(), f"no dataquay console script at {DATAQUAY_BIN}: pip install -e ."
    copies = []
    for unit in UNITS:
        text = (SYSTEMD / unit).read_text()
        assert text.count(f"ExecStart={INSTALLED_BIN} ") == 1
        # verify checks that ExecStart's binary exists: point it at this checkout's.
        (tmp_path / unit).write_text(text.replace(INSTALLED_BIN, str(DATAQUAY_BIN)))
        copies.append(str(tmp_path / unit))
    result = subprocess.run(["systemd-analyze", "verify", *copies], capture_output=True, text=True, timeout=60)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "dataquay" in line]
    assert result.returncode == 0, result.stdout + result.stderr
    assert ours == []


def _unit_settings(unit: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in (SYSTEMD / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_daemon_unit_leaves_dev_shm_and_client_pids_visible() -> None:
    daemon = _unit_settings("dataquay.service")
    # The daemon writes into its clients' /dev/shm segments and looks up their
    # pids under /proc: nothing may give it a /dev or /proc of its own.
    hiding = ("PrivateDevices", "PrivateIPC", "ProtectProc", "ProcSubset", "InaccessiblePaths", "TemporaryFileSystem")
    assert set(hiding) & set(daemon) == set()
    assert daemon["User"] == ["dataquay"]
    assert daemon["Restart"] == ["on-failure"]
    assert daemon["NoNewPrivileges"] == ["yes"]
    assert daemon["ProtectSystem"] == ["strict"]
    assert daemon["ReadWritePaths"] == ["/var/cache/dataquay /var/lib/dataquay"]
    assert daemon["EnvironmentFile"] == ["-/etc/dataquay/dataquay.env"]
    assert int(daemon["LimitNOFILE"][0]) >= 65536
    directory = _unit_settings("dataquay-directory.service")
    assert directory["ExecStart"] == [f"{INSTALLED_BIN} directory"]
    assert directory["ReadWritePaths"] == ["/var/lib/dataquay/directory"]
    assert directory["EnvironmentFile"] == ["-/etc/dataquay/dataquay.env"]


def test_env_file_sets_only_real_settings_and_units_put_defaults_where_they_may_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every variable the example env file sets, or shows commented out, is a
    setting whose example value parses; under each unit's environment, the
    services' default paths lie in what the unit makes writable."""
    active: dict[str, str] = {}
    examples: dict[str, str] = {}
    for line in (SYSTEMD / "dataquay.env").read_text().splitlines():
        match = re.fullmatch(r"(#?)(DATAQUAY_[A-Z_]+)=(.*)", line)
        if match:
            (examples if match[1] else active)[match[2]] = match[3]
    assert set(active) | set(examples) <= _known_env_names()
    assert len(examples) > 15
    for config in (DaemonConfig, DirectoryConfig):
        config.from_sources({}, env={**active, **examples}, file=None)

    def unit_env(unit: str) -> None:
        for assignment in " ".join(_unit_settings(unit)["Environment"]).split():
            name, _, value = assignment.partition("=")
            assert not name.startswith("DATAQUAY_"), "a default here would beat dataquay.toml"
            monkeypatch.setenv(name, value)

    unit_env("dataquay.service")
    daemon = DaemonConfig.from_sources({}, env=active, file=None)
    assert (daemon.listen, daemon.metrics_port) == ("0.0.0.0:7070", 9470)
    assert daemon.socket == Path("/run/dataquay/dataquay.sock")
    settings = _unit_settings("dataquay.service")
    assert settings["RuntimeDirectory"] == ["dataquay"]
    writable = [Path(p) for p in settings["ReadWritePaths"][0].split()]
    assert Path("/var/cache/dataquay") in writable and settings["CacheDirectory"] == ["dataquay"]
    assert daemon.cache_dir == Path("/var/cache/dataquay/cache")
    assert daemon.state_dir == Path("/var/lib/dataquay") in writable

    unit_env("dataquay-directory.service")
    directory = DirectoryConfig.from_sources({}, env=active, file=None)
    assert directory.listen == "0.0.0.0:7071"
    settings = _unit_settings("dataquay-directory.service")
    assert settings["StateDirectory"] == ["dataquay/directory"]
    assert directory.state_dir == Path("/var/lib/dataquay/directory") == Path(settings["ReadWritePaths"][0])


def test_readme_hardening_table_says_what_each_unit_sets() -> None:
    """deploy/systemd/README.md's table of settings against the unit files:
    every row as the files have it, and every hardening setting of either
    unit in a row."""
    rows = {}
    for line in (SYSTEMD / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3 and cells[0].endswith("=`"):
            rows[cells[0].strip("`").rstrip("=")] = cells[1:]

    def cell(settings: dict[str, list[str]], key: str) -> str:
        if key not in settings:
            return "not set"
        return f"`{settings[key][0]}`" if settings[key][0] else "empty"

    units = [_unit_settings(unit) for unit in UNITS]
    assert {key: [cell(settings, key) for settings in units] for key in rows} == rows
    hardening = re.compile(
        r"^(Protect|Private|Restrict|SystemCall|Capability|Ambient|NoNewPrivileges|"
        r"LockPersonality|ReadWritePaths|UMask|ProcSubset|LimitNOFILE|User$)"
    )
    assert {key for settings in units for key in settings if hardening.match(key)} <= set(rows)
