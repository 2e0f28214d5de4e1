"""Directories the daemon must be able to write, checked with a clear error."""

from __future__ import annotations

import os
from pathlib import Path

from dataquay.server.errors import StartupError


def ensure_writable_dir(path: Path, what: str) -> Path:
    """Creates ``path`` if needed; raises StartupError naming ``what`` if unusable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"{what} {path} cannot be created: {exc.strerror}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"{what} {path} is not writable")
    return path
