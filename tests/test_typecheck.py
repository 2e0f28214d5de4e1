"""The client and server packages stay mypy-clean (the house rule, enforced)."""

from __future__ import annotations

from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]


def test_client_and_server_packages_are_mypy_clean() -> None:
    stdout, stderr, status = api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            str(ROOT / "client/dataquay/client"),
            str(ROOT / "client/dataquay/analyze"),
            str(ROOT / "server/dataquay/server"),
        ]
    )
    assert status == 0, stdout + stderr
