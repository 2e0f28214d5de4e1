"""The shuffle-quality experiment's report: its runs summarised per layout and
mode, printed as a markdown table, and written to JSON with a markdown page."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from shuffle_quality_training import (
    HIDDEN,
    NODES,
    PARTITIONS,
    RANKS_PER_NODE,
    SHARDS_PER_CLASS,
    TEST_FRACTION,
    WORLD,
    RunResult,
    Settings,
)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(results: Sequence[RunResult]) -> list[dict[str, object]]:
    """One row per (partition, mode): accuracy mean and std over seeds, skew, read tiers."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.spec.partition, r.spec.mode_label), []).append(r)
    rows: list[dict[str, object]] = []
    for (partition, mode), runs in groups.items():
        sync_mean, sync_std = _mean_std([r.sync_accuracy for r in runs])
        lsgd_mean, lsgd_std = _mean_std([r.local_sgd_accuracy for r in runs])
        tiers = sorted({t for r in runs for t in r.tiers})
        rows.append(
            {
                "partition": partition,
                "mode": mode,
                "seeds": len(runs),
                "sync_acc_mean": sync_mean,
                "sync_acc_std": sync_std,
                "local_sgd_acc_mean": lsgd_mean,
                "local_sgd_acc_std": lsgd_std,
                "classes_per_node_epoch0": statistics.fmean(r.node_classes[0] for r in runs),
                "classes_per_node_last": statistics.fmean(r.node_classes[-1] for r in runs),
                "node_kl_epoch0": statistics.fmean(r.node_kl[0] for r in runs),
                "node_kl_last": statistics.fmean(r.node_kl[-1] for r in runs),
                "node_kl_mean": statistics.fmean(statistics.fmean(r.node_kl) for r in runs),
                "read_share": {t: statistics.fmean(r.tiers.get(t, 0.0) for r in runs) for t in tiers},
                "run_seconds_mean": statistics.fmean(r.seconds for r in runs),
            }
        )
    return rows


HEADER = (
    "partition",
    "mode",
    "sync acc",
    "local SGD acc",
    "classes/node e0 -> last",
    "KL e0 -> last",
    "local / peer / pfs reads",
    "s per run",
)


def table(rows: Sequence[dict[str, object]]) -> list[str]:
    """The summary as markdown table lines."""

    def pct(row: dict[str, object], *tiers: str) -> str:
        share = row["read_share"]
        assert isinstance(share, dict)
        return f"{100 * sum(share.get(t, 0.0) for t in tiers):.0f}%"

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        cells = (
            row["partition"],
            row["mode"],
            f"{row['sync_acc_mean']:.4f} ± {row['sync_acc_std']:.4f}",
            f"{row['local_sgd_acc_mean']:.4f} ± {row['local_sgd_acc_std']:.4f}",
            f"{row['classes_per_node_epoch0']:.1f} -> {row['classes_per_node_last']:.1f}",
            f"{row['node_kl_epoch0']:.3f} -> {row['node_kl_last']:.3f}",
            " / ".join((pct(row, "local", "cache"), pct(row, "peer"), pct(row, "pfs", "fallback"))),
            f"{row['run_seconds_mean']:.1f}",
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def gaps_to_global(rows: Sequence[dict[str, object]]) -> list[str]:
    """Per layout and trainer, each mode's mean accuracy minus global's, in points."""
    lines = []
    for partition in PARTITIONS:
        mine = {str(r["mode"]): r for r in rows if r["partition"] == partition}
        if "global" not in mine:
            continue
        for trainer, key in (("sync", "sync_acc_mean"), ("local SGD", "local_sgd_acc_mean")):
            base = float(mine["global"][key])  # type: ignore[arg-type]
            deltas = ", ".join(
                f"{mode} {100 * (float(row[key]) - base):+.1f}"  # type: ignore[arg-type]
                for mode, row in mine.items()
                if mode != "global"
            )
            lines.append(f"- {partition}, {trainer}: global {100 * base:.1f}%; {deltas} points")
    return lines


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "nproc": nproc or str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


def write_reports(
    out: Path,
    rows: list[dict[str, object]],
    results: Sequence[RunResult],
    settings: Settings,
    num_train: int,
    command: str,
    wall_seconds: float,
) -> None:
    """The JSON (every run and the summary) and a markdown page next to it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    host = machine()
    seeds = len({r.spec.seed for r in results})
    record = {
        "benchmark": "shuffle_quality",
        "command": command,
        "wall_seconds": wall_seconds,
        "machine": host,
        "settings": {
            **asdict(settings),
            "nodes": NODES,
            "ranks_per_node": RANKS_PER_NODE,
            "hidden": HIDDEN,
            "test_fraction": TEST_FRACTION,
            "shards_per_class": SHARDS_PER_CLASS,
        },
        "summary": rows,
        "runs": [{**asdict(r), "spec": {**asdict(r.spec), "mode_label": r.spec.mode_label}} for r in results],
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# Shuffle quality: accuracy per placement mode",
        "",
        f"Command: `{command}` ({wall_seconds:.0f} s wall)",
        f"Machine: {host['nproc']} cores ({host['cpu']}), Python {host['python']}, {host['system']}",
        "",
        (
            f"sklearn digits, {num_train} training samples read through a {NODES}-node loopback cluster by "
            f"{WORLD} ranks (batch {settings.batch_size} per rank, global batch {settings.batch_size * WORLD}), "
            f"{settings.epochs} epochs, a 64-{HIDDEN}-10 MLP, SGD with lr {settings.lr} on a cosine decay by "
            f"epoch; test accuracy on a fixed "
            f"{TEST_FRACTION:.0%} held-out split, mean ± std over {seeds} seeds."
        ),
        "",
        *table(rows),
        "",
        "Accuracy against global, in points (mean over seeds; compare with the ± above):",
        "",
        *gaps_to_global(rows),
        "",
        (
            f"- **sync**: synchronous SGD, gradient averaged over the global batch (all {WORLD} ranks). "
            "global and locality give it the same global batches except each epoch's last, which global "
            "leaves short and locality fills with repeated ids; global's orders do not depend on the layout "
            "(both layouts number the samples class by class), so its rows are the same runs."
        ),
        (
            f"- **local SGD**: one replica per node on its {RANKS_PER_NODE} ranks' batches, averaged every "
            f"{settings.sync_every} steps: the setting where a node's class skew reaches the model."
        ),
        (
            "- **classes/node**: distinct classes the ranks of one node read in an epoch (mean over nodes), "
            "first and last epoch; **KL**: that node mix's KL divergence (nats) from the training set's."
        ),
        (
            "- **reads**: where the samples came from: the rank's own node's cache, a peer's cache, the PFS. "
            "Under partial, a traded sample is a local hit where the daemons' exchange delivered it ahead "
            "of its epoch, else its new owner reads it from the PFS. **s per run**: staging plus all epochs "
            "of one run, both trainers included, on this machine's loopback cluster."
        ),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
