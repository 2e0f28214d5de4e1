"""Hand-made tar shards for tests that need members the generators do not make."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_tar(path: Path, members: list[tuple[str, bytes | None]]) -> Path:
    """A shard whose members are files, or folders where data is None."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path
