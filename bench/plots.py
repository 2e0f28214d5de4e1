"""Draws the plots of docs/results.md and the README from bench/results/*.json.

    make results            # or: .venv/bin/python bench/plots.py

- ``docs/img/stall.png`` (the README's headline): per-rank epoch time, split
  into compute and the wait for data, for the PFS read directly (a worker
  pool, as a DataLoader), the PFS behind a page cache, and each dataquay
  mode, from ``stall.json`` (``dataquay bench``).
- ``docs/img/stall_per_epoch.png``: the stall % of every system per epoch on
  a log scale, so that the 76% of the baselines and the 0.1-1% of the modes
  are all visible and no line hides another.
- ``docs/img/ratios.png``: each single-node and two-node figure as a ratio
  to its baseline in the same run (local hits, the miss path, peer hits,
  staging, the exchange), per sample size.
- ``docs/img/dashboard.png``: the layout of the Grafana dashboard
  (``deploy/grafana/dataquay.json``): its rows and each panel's title and kind,
  where the dashboard puts them.
- ``docs/img/peer_loader.png``: the head-to-head, the same job read from the
  PFS directly, through dataquay and through Mosaic StreamingDataset under one
  PFS cap: first and later epochs, from ``peer_loader.json``
  (``bench/peer_loader.py``).
- ``docs/img/overflow.png``: the stall with data larger than the caches
  (``overflow.json``, ``dataquay bench overflow``).

Needs matplotlib (``pip install dataquay[bench]``).
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
IMG = BENCH.parent / "docs" / "img"

#: Each system's colour and marker, the same in every plot.
STYLE = {
    "direct": ("#b22222", "o"),
    "page cache": ("#e9967a", "s"),
    "dataquay global": ("#1f77b4", "^"),
    "dataquay partial q=0.1": ("#2ca02c", "D"),
    "dataquay local": ("#9467bd", "v"),
    "dataquay locality": ("#17becf", "P"),
    "dataquay global, no read-ahead": ("#7f7f7f", "x"),
}


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def _per_system(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        out[row["system"]].append(row)
    return out


def headline(stall: dict[str, Any], path: Path) -> None:
    """Mean epoch time after the first epoch, compute and data wait stacked, one bar per system."""
    systems = _per_system(stall["rows"])
    names = [name for name in STYLE if name in systems]
    wall, wait = [], []
    for name in names:
        later = [r for r in systems[name] if r["epoch"] > 0]
        wall.append(sum(r["wall_s"] for r in later) / len(later))
        wait.append(sum(r["wait_s"] for r in later) / len(later))
    compute = [w - d for w, d in zip(wall, wait)]
    labels = [n.replace("dataquay ", "dataquay\n").replace(", no", ",\nno") for n in names]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(labels, compute, color="#9ecae1", label="compute (50 ms per batch)")
    ax.bar(labels, wait, bottom=compute, color="#d62728", label="waiting for data")
    for x, (w, d) in enumerate(zip(wall, wait)):
        ax.text(x, w + 0.2, f"{w:.1f} s\n{100 * d / w:.1f}% stall", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("epoch time per rank (s)")
    ax.set_ylim(0, max(wall) * 1.3)
    ax.set_title(
        f"{stall['samples']:,} samples ({stall['dataset_mb']:.0f} MB), 4 nodes x 2 ranks, "
        f"PFS capped at {stall['pfs_mb_per_s']:.0f} MB/s; epochs 1-{max(r['epoch'] for r in stall['rows'])}",
        fontsize=9,
    )
    ax.legend(loc="upper right", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_epoch(stall: dict[str, Any], path: Path) -> None:
    """Stall % per epoch on a log scale, each system offset a little in x so none hides another."""
    systems = _per_system(stall["rows"])
    names = [name for name in STYLE if name in systems]
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, name in enumerate(names):
        colour, marker = STYLE[name]
        rows = sorted(systems[name], key=lambda r: r["epoch"])
        offset = (k - (len(names) - 1) / 2) * 0.06
        ax.plot(
            [r["epoch"] + offset for r in rows],
            [max(r["stall_pct"], 0.05) for r in rows],
            marker=marker,
            color=colour,
            label=name,
            linestyle="-" if name.startswith("dataquay") else "--",
        )
    ax.set_yscale("log")
    ax.axhline(2, color="#555", linewidth=0.8, linestyle=":")
    ax.text(0, 2.2, "2%", fontsize=8, color="#555")
    ax.set_xlabel("epoch")
    ax.set_ylabel("stall % (log scale)")
    ax.set_xticks(sorted({r["epoch"] for r in stall["rows"]}))
    ax.legend(fontsize=7, ncol=2, loc="center right")
    ax.set_title("Share of each epoch the ranks wait for data", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overflow(data: dict[str, Any], path: Path) -> None:
    """Stall % per epoch with the dataset larger than the caches."""
    systems = _per_system(data["rows"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, rows in systems.items():
        rows = sorted(rows, key=lambda r: r["epoch"])
        ax.plot([r["epoch"] for r in rows], [max(r["stall_pct"], 0.05) for r in rows], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("stall % (log scale)")
    ax.set_xticks(sorted({r["epoch"] for r in data["rows"]}))
    ax.legend(fontsize=8)
    ax.set_title("Data larger than the caches: the overflow read ahead, on demand, direct", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peer_loader(data: dict[str, Any], path: Path) -> None:
    """First epoch and mean later epoch per system side by side, each later bar labelled with its stall and PFS MB."""
    summary = data["summary"]
    names = list(summary)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k, name in enumerate(names):
        figures = summary[name]
        ax.bar(k - 0.2, figures["first_epoch_s"], width=0.38, color="#9ecae1", label="first epoch" if k == 0 else None)
        ax.bar(
            k + 0.2,
            figures["later_epoch_s"],
            width=0.38,
            color="#08519c",
            label="later epochs, mean" if k == 0 else None,
        )
        ax.text(k - 0.2, figures["first_epoch_s"] + 0.2, f"{figures['first_epoch_s']:.1f} s", ha="center", fontsize=7)
        ax.text(k + 0.2, figures["later_epoch_s"] + 0.2, f"{figures['later_epoch_s']:.2f} s", ha="center", fontsize=7)
    ax.set_xticks(
        range(len(names)),
        [f"{n}\njob {summary[n]['job_s']:.1f} s\n{summary[n]['pfs_mb']:.0f} MB from the PFS" for n in names],
        fontsize=7,
    )
    ax.set_ylabel("epoch time (s)")
    ax.set_ylim(0, max(f["first_epoch_s"] for f in summary.values()) * 1.3)
    ax.set_title(
        f"{data['samples']:,} samples ({data['dataset_mb']:.0f} MB), {data['nodes']} nodes x 1 rank, caches "
        f"{data['cache_share']:g}x a node's share, no compute;\nthe PFS capped at "
        f"{data['pfs_mb_per_s_per_node'] * 1e6 / (1 << 20):.0f} MiB/s per node for every system; "
        f"medians of {1 + max(r['run'] for r in data['rows'])} runs",
        fontsize=8,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rows(name: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = _load(name)["rows"]
    return rows


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def ratio_figures() -> dict[str, dict[str, float]]:
    """Per figure, per sample size, the ratio to its baseline, read from the raw results."""
    peer_runs = [_rows(f"wire-peer-run{n}.json") for n in (4, 5, 6, 7)]
    peer_sizes = [r["size"] for r in peer_runs[0]]
    miss = _rows("miss_path-pause.json")
    return {
        "local hit, verified\n(raw LMDB + xxh3)": {r["size"]: r["verified_ratio"] for r in _rows("local_hits.json")},
        "miss path, warm\n(direct, keeping batches)": {
            r["size"]: r["miss_path_per_s"] / r["direct_batch_per_s"] for r in miss
        },
        "miss path, cold\n(direct, cold)": {r["size"]: r["miss_cold_ratio"] for r in miss},
        "peer hit, median of 4 runs\n(raw TCP stream)": {
            size: _median([run[i]["peer_bulk_ratio"] for run in peer_runs]) for i, size in enumerate(peer_sizes)
        },
        "staging, uncapped\n(slower raw half)": {r["size"]: r["staging_vs_slower_raw"] for r in _rows("staging.json")},
        "staging, capped\n(the cap)": {r["size"]: r["capped_vs_cap"] for r in _rows("staging.json")},
        "exchange, last run\n(peer-read streaming)": {r["size"]: r["ratio"] for r in _rows("exchange_throughput.json")},
    }


def ratios(figures: dict[str, dict[str, float]], path: Path) -> None:
    """Grouped bars: one group per figure, one bar per sample size, the baseline at 1."""
    sizes = ["4KiB", "110KiB", "1MiB"]
    colours = {"4KiB": "#9ecae1", "110KiB": "#3182bd", "1MiB": "#08519c"}
    fig, ax = plt.subplots(figsize=(11, 4))
    for g, by_size in enumerate(figures.values()):
        present = [s for s in sizes if s in by_size]
        for k, size in enumerate(present):
            x = g + (k - (len(present) - 1) / 2) * 0.26
            ax.bar(
                x,
                by_size[size],
                width=0.24,
                color=colours[size],
                label=size if g == 0 or size not in {s for f in list(figures.values())[:g] for s in f} else None,
            )
            ax.text(x, by_size[size] + 0.02, f"{by_size[size]:.2f}", ha="center", fontsize=7)
    ax.axhline(1, color="#555", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(figures)), list(figures), fontsize=7)
    ax.set_ylabel("ratio to the baseline in the same run")
    ax.set_title("Each figure against its baseline (in brackets), per sample size", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DASHBOARD = BENCH.parent / "deploy" / "grafana" / "dataquay.json"
#: How each kind of panel is drawn: fill colour and the word under its title.
PANEL_KINDS = {
    "stat": ("#e8f4ea", "stat"),
    "timeseries": ("#eef3fb", "time series"),
    "bargauge": ("#fff7e6", "bar gauge"),
}


def dashboard(path: Path) -> None:
    """The dashboard's panels where Grafana lays them out (24 columns; a grid row is 30 px)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig, ax = plt.subplots(figsize=(10, bottom * 0.16))
    for panel in panels:
        grid = panel["gridPos"]
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        if panel["type"] == "row":
            ax.text(x + 0.1, y + 0.5, panel["title"], fontsize=9, fontweight="bold", va="center")
            continue
        fill, kind = PANEL_KINDS.get(panel["type"], ("#f4f4f4", panel["type"]))
        ax.add_patch(plt.Rectangle((x + 0.1, y + 0.1), w - 0.2, h - 0.2, facecolor=fill, edgecolor="#7a8fb3"))
        ax.text(x + w / 2, y + h / 2 - 0.4, panel["title"], ha="center", va="center", fontsize=7, wrap=True)
        ax.text(x + w / 2, y + h / 2 + 0.8, kind, ha="center", va="center", fontsize=6, color="#666")
    ax.set_xlim(0, 24)
    ax.set_ylim(bottom, 0)
    ax.axis("off")
    ax.set_title("The Grafana dashboard (deploy/grafana/dataquay.json): rows and panels", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    stall = _load("stall.json")
    headline(stall, IMG / "stall.png")
    per_epoch(stall, IMG / "stall_per_epoch.png")
    overflow(_load("overflow.json"), IMG / "overflow.png")
    peer_loader(_load("peer_loader.json"), IMG / "peer_loader.png")
    ratios(ratio_figures(), IMG / "ratios.png")
    dashboard(IMG / "dashboard.png")
    shutil.copyfile(RESULTS / "cache_policy.png", IMG / "cache_policy.png")  # drawn by bench/cache_policy.py
    print(
        f"wrote {IMG}/stall.png, stall_per_epoch.png, overflow.png, peer_loader.png, ratios.png, dashboard.png, "
        "cache_policy.png"
    )


if __name__ == "__main__":
    main()
