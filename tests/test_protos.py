"""The committed generated code matches protos/: regenerate and compare."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PROTOS = Path(__file__).resolve().parents[1] / "protos"


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", PROTOS / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(tmp_path)

    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "protoc generated nothing"
    for rel in fresh:
        committed = PROTOS / rel
        assert committed.exists(), f"{rel} is not committed; run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale; run `make proto`"
