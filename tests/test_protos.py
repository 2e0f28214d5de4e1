"""The committed generated code matches protos/: regenerate and compare.

protoc runs in a process of its own: its C++ runtime in a test worker that
has loaded torch or jaxlib (each with a protobuf of its own) can crash it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROTOS = Path(__file__).resolve().parents[1] / "protos"


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(PROTOS / "generate.py"), str(tmp_path)], check=True, timeout=120)

    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "protoc generated nothing"
    for rel in fresh:
        committed = PROTOS / rel
        assert committed.exists(), f"{rel} is not committed; run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale; run `make proto`"
