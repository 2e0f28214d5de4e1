"""The docs against the code: the reference pages name exactly the flags,
settings, metrics and errors the code has, the README's PyTorch example runs
against a real daemon, and nothing a user reads speaks the project's private
language (issue numbers, development passes, seed numbers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dataquay.server.cli import reference
from dataquay.server.tools import synthetic
from dataquay.server.tools.processes import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _page(name: str) -> str:
    return (DOCS / "reference" / name).read_text()


def test_reference_pages_are_what_the_code_writes() -> None:
    assert reference.stale_pages() == [], "run: .venv/bin/python -m dataquay.server.cli.reference"


def test_every_cli_flag_is_in_the_cli_reference_and_no_other() -> None:
    page = _page("cli.md")
    documented: set[tuple[str, str]] = set()
    command = ""
    for line in page.splitlines():
        if heading := re.match(r"### `(dataquay[^`]*)`", line):
            command = heading.group(1)
        elif row := re.match(r"\| `(-[^`]*)` \|", line):
            for flag in row.group(1).split(", "):
                documented.add((command, flag.split(" ")[0]))
    in_code = reference.cli_flags()
    assert in_code - documented == set(), "flags the reference lacks"
    assert documented - in_code == set(), "flags the reference names that the parsers lack"


def test_every_setting_is_in_the_config_reference_and_no_other() -> None:
    from dataclasses import fields

    from dataquay.server.config import DaemonConfig, DirectoryConfig

    page = _page("config.md")
    documented = set(re.findall(r"^\| `--[a-z-]+` \| `(DATAQUAY_[A-Z_]+)` \| `([a-z_]+)` \|", page, re.M))
    classes = (DaemonConfig, DirectoryConfig)
    in_code = {(cls.env_prefix + f.name.upper(), f.name) for cls in classes for f in fields(cls)}
    assert in_code - documented == set()
    assert documented - in_code == set()


def _metric_names_in_code() -> set[str]:
    """Every metric name the metrics modules define, as scraped (counters with _total)."""
    names = set()
    for module in ("server/dataquay/server/node/metrics.py", "server/dataquay/server/directory/metrics.py"):
        source = (REPO / module).read_text()
        for kind, name in re.findall(
            r"(Counter|Gauge|Histogram|CounterMetricFamily|GaugeMetricFamily)"
            r"\(\s*\"(dataquay_[a-z0-9_]+)\"",
            source,
        ):
            names.add(name + "_total" if kind.startswith("Counter") else name)
    return names


def test_every_metric_is_in_the_metrics_reference_and_no_other() -> None:
    documented = set(re.findall(r"^\| `(dataquay_[a-z0-9_]+)` \|", _page("metrics.md"), re.M))
    exported = {name for rows in reference.metric_families().values() for name, *_ in rows}
    assert exported - documented == set()
    assert documented - exported == set()
    # A name written in a metrics module and not exported is a metric the registry lost.
    assert _metric_names_in_code() - exported == set()


def test_every_error_class_is_in_the_errors_reference_and_no_other() -> None:
    documented = set(re.findall(r"^\| `(dataquay\.[a-z.]+\.[A-Za-z]+)` \|", _page("errors.md"), re.M))
    in_code = {f"{cls.__module__}.{cls.__name__}" for cls in reference.error_classes()}
    assert in_code - documented == set()
    assert documented - in_code == set()


def test_every_variable_the_client_reads_is_in_the_environment_reference() -> None:
    read = {
        name
        for path in (REPO / "client" / "dataquay").rglob("*.py")
        for name in re.findall(r"\"(DATAQUAY_[A-Z_]+)\"", path.read_text())
    }
    assert read - set(re.findall(r"DATAQUAY_[A-Z_]+", _page("environment.md"))) == set()


def _readme_python_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    example = [block for block in blocks if "DataLoader(" in block]
    assert len(example) == 1, "the README has one PyTorch example"
    return example[0]


def test_the_pytorch_page_shows_the_readme_example_unchanged() -> None:
    assert f"```python\n{_readme_python_block()}```" in (DOCS / "getting-started" / "pytorch.md").read_text()


def test_readme_pytorch_example_runs_against_a_real_daemon(tmp_path: Path) -> None:
    """The README's block, unchanged, in a process of its own against one
    daemon serving a staged files dataset named as the README names it."""
    pytest.importorskip("torch")
    root = synthetic.make_files_dataset(tmp_path / "imagenet", 300, sizes=(100, 3000), classes=3)
    daemon = DaemonProcess(tmp_path / "node", (), dataset_roots=(tmp_path,)).start()
    try:
        env = {**os.environ, "DATAQUAY_ADDR": daemon.address}
        for argv in (["dataset", "add", "imagenet", str(root)], ["stage", "imagenet", "--seed", "42", "--quiet"]):
            subprocess.run([sys.executable, "-m", "dataquay.server.cli", *argv], env=env, check=True, timeout=60)
        script = tmp_path / "example.py"
        script.write_text(_readme_python_block() + "\nprint('samples', len(sampler))\n")
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
    finally:
        daemon.kill()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["samples", "300"]


#: Words of the project's own history that no user can look up.
PRIVATE = re.compile(
    r"\bissue #?\d|\bseed 0\d\d|\b(fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
    r"twelfth) pass\b|\bitem \d|\bthis pass\b",
    re.I,
)


def _user_pages() -> list[Path]:
    pages = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md"]
    return pages + sorted(p for p in DOCS.rglob("*.md") if "deploy" not in p.relative_to(DOCS).parts[:1])


def test_user_pages_speak_no_private_language() -> None:
    found = [
        f"{page.relative_to(REPO)}:{n}: {line.strip()}"
        for page in _user_pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert found == []


def test_cli_help_speaks_no_private_language() -> None:
    page = _page("cli.md")
    assert [line for line in page.splitlines() if PRIVATE.search(line) or re.search(r"\bQ = ", line)] == []


def test_readme_fits_one_screenful_of_sections() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_results_page_quotes_the_ratios_the_raw_results_hold() -> None:
    """Every ratio the results page's plot draws from bench/results appears on
    the page, as the plot rounds it: the text cannot drift from the data."""
    pytest.importorskip("matplotlib")
    if not (REPO / "bench" / "results").is_dir():
        pytest.skip("bench/results is the repository's record; a source release leaves it out")
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import plots
    finally:
        sys.path.remove(str(REPO / "bench"))
    page = (DOCS / "results.md").read_text()
    missing = [
        f"{figure.splitlines()[0]} {size}: {value:.2f}"
        for figure, by_size in plots.ratio_figures().items()
        for size, value in by_size.items()
        if f"{value:.2f}" not in page
    ]
    assert missing == []


def _defined_names() -> set[str]:
    """Every top-level function and class, and every ``Class.method``, of the client and the server."""
    import ast

    names: set[str] = set()
    for root in (REPO / "client" / "dataquay", REPO / "server" / "dataquay"):
        for path in root.rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    names.update(
                        f"{node.name}.{item.name}"
                        for item in node.body
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    )
    return names


def test_the_hot_path_map_names_functions_and_modules_that_exist() -> None:
    """A hop renamed or moved without its map fails here: every `Class.method`,
    function and module the map names is in the code."""
    page = (DOCS / "internals" / "hot-path.md").read_text()
    names = _defined_names()
    called = [n for n in re.findall(r"`([A-Za-z_]\w*(?:\.\w+)?)`", page) if not re.search(r"\.(c|py)$", n)]
    assert [n for n in called if n not in names] == []
    modules = re.findall(r"\b((?:client|node)/[\w/]+\.(?:py|c))\b", page)
    assert modules
    roots = {
        "client": REPO / "client" / "dataquay" / "client",
        "node": REPO / "server" / "dataquay" / "server" / "node",
    }
    missing = [m for m in modules if not (roots[m.split("/")[0]] / m.split("/", 1)[1]).exists()]
    assert missing == []
