"""The Grafana dashboard under deploy/grafana: well-formed panels that query
only metrics a daemon or a directory exports, with label values the code emits."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from dataquay.client.wire.tiers import CLIENT_TIERS
from dataquay.server.node.metrics import TIERS as DAEMON_TIERS
from dataquay.server.tools.processes import DaemonProcess, DirectoryProcess

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dataquay.json"

#: Metrics the dashboard queries that no daemon or directory exports yet. Empty
#: now; a name belongs here only while it is missing, and the dashboard test
#: fails once it is exported, so that this list only ever shrinks.
NOT_EXPORTED_YET: frozenset[str] = frozenset()
#: Label values the dashboard selects on, by label: what the code can emit.
LABEL_VALUES = {"tier": frozenset(CLIENT_TIERS) | frozenset(DAEMON_TIERS), "state": frozenset({"up", "down"})}


_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = _LABEL_LISTS.sub("", expr)
    names = set()
    for match in re.finditer(r"(?<![\w$.])([a-zA-Z_:][\w:]*)\s*(\()?", expr):
        if match[2] is None and match[1] not in _KEYWORDS:
            names.add(match[1])
    return names


def dashboard_queries(dashboard: dict[str, object]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and variable queries."""
    queries: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                queries.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard.get("panels", []))
    for variable in dashboard["templating"]["list"]:  # type: ignore[index]
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            queries.append(inner[1] if inner else query)
    return queries


def exported_names(page: str) -> set[str]:
    """Every series name a Prometheus text page exports, or declares by
    HELP/TYPE (families whose labelled series appear only once there is traffic)."""
    names = set()
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind == "summary":
                names |= {f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_metric_names_parse_out_of_promql() -> None:
    expr = (
        'sum by (tier) (rate(dataquay_client_reads_total{tier=~"local|cache",dataquay_node=~"$node"}'
        '[$__rate_interval])) / ignoring(tier) group_left() clamp_min(sum(up{job="x"}), 1) '
        "+ histogram_quantile(0.9, sum by (le, method) (rate(a_b_bucket[5m])))"
    )
    assert metric_names(expr) == {"dataquay_client_reads_total", "up", "a_b_bucket"}


def test_dashboard_queries_only_metrics_a_daemon_or_directory_exports(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    used = set().union(*map(metric_names, queries))
    assert len(queries) > 30 and len(used) > 25

    daemon = DaemonProcess(tmp_path / "node")
    directory = DirectoryProcess(tmp_path / "directory")
    try:
        daemon.start()
        directory.start()
        exported = exported_names(urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode())
        exported |= exported_names(urllib.request.urlopen(directory.http_url + "/metrics", timeout=10).read().decode())
    finally:
        daemon.kill()
        directory.kill()

    assert used - exported - NOT_EXPORTED_YET == set()
    # Exported now: move it out of NOT_EXPORTED_YET.
    assert NOT_EXPORTED_YET & exported == set()
    for label, allowed in LABEL_VALUES.items():
        selected = set()
        for query in queries:
            for values in re.findall(rf'\b{label}=~?"([^"]*)"', query):
                selected |= set(values.split("|"))
        assert selected and selected <= allowed, label


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "node"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]


def test_grafana_import_asks_for_the_prometheus_data_source() -> None:
    """Grafana's import form asks for each of ``__inputs`` and puts the choice
    wherever ``${NAME}`` stands: here the default of the dashboard's data
    source variable, which every panel reads."""
    text = DASHBOARD.read_text()
    dashboard = json.loads(text)
    assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")
    ]
    assert set(re.findall(r"\$\{(DS_\w+)\}", text)) == {"DS_PROMETHEUS"}
    panel_types = {p["type"] for p in dashboard["panels"]} - {"row"}
    required = {(r["type"], r["id"]) for r in dashboard["__requires"]}
    assert required == {("grafana", "grafana"), ("datasource", "prometheus")} | {("panel", t) for t in panel_types}

    imported = json.loads(text.replace("${DS_PROMETHEUS}", "prom-uid-1"))
    variable = next(v for v in imported["templating"]["list"] if v["name"] == "datasource")
    assert (variable["type"], variable["query"], variable["current"]["value"]) == (
        "datasource",
        "prometheus",
        "prom-uid-1",
    )
