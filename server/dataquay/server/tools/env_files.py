"""Environment files a POSIX shell can source (``set -a; . FILE; set +a``):
how a local cluster tells its users' shells and trainers where it is."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path


def write_env_file(path: Path, values: Mapping[str, str], comment: str) -> None:
    """Writes ``KEY=VALUE`` lines, values quoted for a POSIX shell, atomically."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [f"{key}={shlex.quote(value)}" for key, value in values.items()]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of a file :func:`write_env_file` wrote (or any plain KEY=VALUE file)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, raw = line.partition("=")
        tokens = shlex.split(raw)
        values[key.removeprefix("export ").strip()] = tokens[0] if tokens else ""
    return values
