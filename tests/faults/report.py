"""Prints the fault suite's records (DATAQUAY_FAULT_REPORT) as a Markdown table.

python tests/faults/report.py bench/results/faults.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def tiers(per_epoch: list[dict[str, int]]) -> str:
    return " / ".join(", ".join(f"{tier} {n}" for tier, n in epoch.items()) for epoch in per_epoch)


def main(path: str) -> None:
    print("| scenario | mode | outcome | recovery s | samples by tier, epochs 0 / 1 / 2 |")
    print("|---|---|---|---:|---|")
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        recovery = "-" if record["recovery_seconds"] is None else f"{record['recovery_seconds']:.2f}"
        print(
            f"| {record['scenario']} | {record['mode']} | {record['outcome']} | {recovery} | {tiers(record['tiers'])} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
