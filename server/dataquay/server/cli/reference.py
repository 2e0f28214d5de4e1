"""The reference pages of the docs, written from the code so they cannot drift.

Each page under ``docs/reference/`` holds hand-written prose and, between a
``<!-- reference:NAME -->`` line and a ``<!-- /reference -->`` line, a part
this module writes: the command line from the parsers, the daemon's and the
directory's settings from their config classes, the metrics from the
registries the servers export, the errors and their gRPC codes from the
status table, and the trainer's Python API from its docstrings.
``python -m dataquay.server.cli.reference`` rewrites those parts;
``--check`` exits 1 naming each page that differs (tests/test_docs.py runs
it), so a flag, a setting, a metric or an error added without its reference
fails the tests, and so does a reference entry whose code is gone.

Defaults that depend on the machine (home directory, host name, uid) are
written as the rule that computes them, so the pages are the same everywhere.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, Field, fields
from pathlib import Path
from unittest import mock

from prometheus_client import CollectorRegistry

from dataquay.protos import cache_pb2, jobs_pb2
from dataquay.server.cli.plain_json import schema

REPO = Path(__file__).resolve().parents[4]
DOCS = REPO / "docs"
CLIENT = REPO / "client" / "dataquay" / "client"

#: Settings whose default is computed on the machine, as the rule that computes it.
MACHINE_DEFAULTS = {
    "socket": "`$XDG_RUNTIME_DIR/dataquay/dataquay.sock`, else `/tmp/dataquay-$UID/dataquay.sock`",
    "cache_dir": "`$XDG_CACHE_HOME/dataquay/cache` (`~/.cache/dataquay/cache`)",
    "state_dir": "`$XDG_STATE_HOME/dataquay` (`~/.local/state/dataquay`); the directory's: `.../dataquay/directory`",
    "node_name": "the host name",
}
#: What stands for the home directory in help text.
PLACEHOLDER_HOME = "/home/USER"


@contextmanager
def _neutral_machine() -> Iterator[None]:
    """Help text as it would read on any machine: fixed home, host and uid."""
    env = {"HOME": PLACEHOLDER_HOME, "XDG_RUNTIME_DIR": "/run/user/UID"}
    drop = ("XDG_CACHE_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")
    with mock.patch.dict(os.environ, env):
        saved = {name: os.environ.pop(name) for name in drop if name in os.environ}
        try:
            yield
        finally:
            os.environ.update(saved)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


# -- command line -------------------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out: list[tuple[str, str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def _flag_rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
        metavar_text = metavar if isinstance(metavar, str) else " ".join(metavar)
        name = ", ".join(action.option_strings) if action.option_strings else metavar_text
        if action.option_strings and action.nargs != 0:
            name += f" {metavar_text}"
        help_text = (action.help or "").replace("%%", "%")
        # The host name is a default computed at start; the page names the rule.
        help_text = help_text.replace(f"(default: {socket.gethostname()})", "(default: the host name)")
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        yield f"| `{_cell(name)}` | {_cell(help_text)} |"


def _command_sections(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
    for name, help_text, sub in _subcommands(parser):
        full = f"{path} {name}"
        rows = list(_flag_rows(sub))
        children = _subcommands(sub)
        yield f"### `{full}`\n"
        description = sub.description or help_text
        if description:
            yield _cell(description) + "\n"
        usage = " ".join(sub.format_usage().split())
        yield f"```text\n{usage.removeprefix('usage: ')}\n```\n"
        if rows:
            yield "| argument | meaning |\n|---|---|\n" + "\n".join(rows) + "\n"
        if children:
            yield from _command_sections(sub, full)


def cli_reference() -> str:
    """Every command and flag of ``dataquay``, from its parsers."""
    from dataquay.server.cli import build_parser

    with _neutral_machine():
        parser = build_parser()
        return "\n".join(_command_sections(parser, "dataquay"))


def cli_flags() -> set[tuple[str, str]]:
    """(command, flag) for every flag of every command: what the reference must name."""
    from dataquay.server.cli import build_parser

    out: set[tuple[str, str]] = set()

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for name, _help, sub in _subcommands(parser):
            full = f"{path} {name}"
            out.update(
                (full, flag)
                for action in sub._actions
                if not isinstance(action, argparse._HelpAction)
                for flag in action.option_strings
            )
            walk(sub, full)

    walk(build_parser(), "dataquay")
    return out


# -- configuration ------------------------------------------------------------------------------------------


def _default(f: Field[object]) -> str:
    if f.name in MACHINE_DEFAULTS:
        return MACHINE_DEFAULTS[f.name]
    factory = f.default_factory
    value = factory() if f.default is MISSING and callable(factory) else f.default
    if isinstance(value, tuple):
        value = os.pathsep.join(map(str, value))
    if value is None or value == "" or value == ():
        return "none"
    return f"`{value}`"


def config_reference() -> str:
    """Every setting of ``dataquay serve`` and ``dataquay directory``: flag, variable, file key, default."""
    from dataquay.server.config import DaemonConfig, DirectoryConfig

    parts = []
    for cls, command in ((DaemonConfig, "serve"), (DirectoryConfig, "directory")):
        rows = [
            f"| `--{f.name.replace('_', '-')}` | `{cls.env_prefix}{f.name.upper()}` | `{f.name}` | "
            f"{_cell(_default(f))} | {_cell(f.metadata['help'].replace('%%', '%'))} |"
            for f in fields(cls)
        ]
        parts.append(
            f"### `dataquay {command}`: the `[{cls.section}]` table\n\n"
            "| flag | environment | file key | default | meaning |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    return "\n".join(parts)


# -- metrics ------------------------------------------------------------------------------------------------


def _daemon_registry() -> CollectorRegistry:
    from dataquay.server.node.metrics import DaemonMetrics
    from dataquay.server.node.reads.overflow import OverflowCounts
    from dataquay.server.node.snapshot import LiveState

    empty = LiveState(
        cache_used_bytes=0,
        cache_capacity_bytes=0,
        cache_entries=0,
        cache_full=False,
        cache_disk_full=False,
        corrupt_repaired=0,
        inserts_dropped=0,
        pfs_bytes=0,
        pfs_errors=0,
        staging={},
        peers=(),
        exchanges={},
        exchange_sent=(0, 0),
        exchange_received=(0, 0),
        exchange_given_up=0,
        previous_owner_samples=0,
        prefetched_samples=0,
        prefetch_memory=(0, 0, 0),
        overflow=OverflowCounts(),
        client_reads={},
        client_data_wait_seconds=0.0,
        clients=0,
    )
    metrics = DaemonMetrics()
    metrics.export_state(lambda: empty)
    return metrics.registry


def _directory_registry() -> CollectorRegistry:
    from dataquay.server.directory.metrics import directory_metrics
    from dataquay.server.directory.state import DirectoryState

    state = DirectoryState(lease_seconds=10.0)
    return directory_metrics(lambda: state, lambda: 0, lambda: {}, lambda: {})


def metric_families() -> dict[str, list[tuple[str, str, str, tuple[str, ...]]]]:
    """Per server, (name as scraped, type, help, labels) of every metric family it exports."""
    out: dict[str, list[tuple[str, str, str, tuple[str, ...]]]] = {}
    for server, registry in (("daemon", _daemon_registry()), ("directory", _directory_registry())):
        rows = []
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = tuple(sorted({k for s in family.samples for k in s.labels if k not in ("le", "quantile")}))
            # A family a collector yields empty still names its labels (``_labelnames``).
            labels = labels or tuple(getattr(family, "_labelnames", ())) or _declared_labels(registry, family.name)
            rows.append((name, family.type, family.documentation, labels))
        out[server] = sorted(rows)
    return out


def _declared_labels(registry: CollectorRegistry, name: str) -> tuple[str, ...]:
    """Labels of a family that has no sample yet (a labelled metric before its first use)."""
    for collector in list(registry._collector_to_names):
        labelnames = getattr(collector, "_labelnames", None)
        if labelnames and getattr(collector, "_name", None) == name:
            return tuple(labelnames)
    return ()


def metrics_reference() -> str:
    parts = []
    for server, rows in metric_families().items():
        body = "\n".join(
            f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels) or ''} | {_cell(help_text)} |"
            for name, kind, help_text, labels in rows
        )
        table = "| metric | type | labels | meaning |\n|---|---|---|---|\n"
        parts.append(f"### The {server}'s `/metrics`\n\n{table}{body}\n")
    return "\n".join(parts)


# -- errors -------------------------------------------------------------------------------------------------


def _errors_modules() -> Iterator[str]:
    """Every subsystem's errors module, by its import name (``client/dataquay/client/errors.py`` is
    ``dataquay.client.errors``)."""
    for root in (REPO / "client", REPO / "server"):
        for path in sorted(root.rglob("errors.py")):
            yield ".".join(path.relative_to(root).with_suffix("").parts)


def error_classes() -> list[type[Exception]]:
    """Every error class of the errors modules of the client and the server."""
    from dataquay.client.errors import DataquayError

    found: dict[str, type[Exception]] = {}
    for name in _errors_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, DataquayError) and obj.__module__ == name:
                found[f"{name}.{attr}"] = obj
    return [found[key] for key in sorted(found)]


def errors_reference() -> str:
    from dataquay.client.wire.status_codes import ERROR_CODES

    codes: dict[type[Exception], str] = {cls: code.name for cls, code in ERROR_CODES}
    rows = []
    for cls in error_classes():
        code = codes.get(cls, "")
        doc = inspect.getdoc(cls) or ""
        summary = doc.split("\n\n")[0]
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        rows.append(f"| `{cls.__module__}.{cls.__name__}` | {bases} | {code and f'`{code}`'} | {_cell(summary)} |")
    return "| error | is a | gRPC status | when |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"


# -- Python API ---------------------------------------------------------------------------------------------

#: The trainer's API: module (under client/dataquay/client) and its public classes and functions.
API = {
    "client.py": ("connect", "Client"),
    "dataset.py": ("Dataset",),
    "sampler.py": ("Sampler", "JobSampler"),
    "coordinated.py": ("CoordinatedLoader",),
    "stats.py": ("ClientStats",),
    "torch.py": ("TorchDataset", "TorchSampler", "IterableDataset", "TorchCoordinated"),
    "loading.py": ("SampleReader",),
    "decoders.py": ("sample_decoder", "tar_sample"),
    "grain.py": ("GrainSource", "GrainSampler"),
    "tf.py": ("sample_generator", "tf_dataset"),
}


def _without_self(args: ast.arguments) -> str:
    return re.sub(r"^(self|cls),?\s*", "", ast.unparse(args))


def _signature(node: ast.FunctionDef) -> str:
    args = _without_self(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({args}){returns}"


def _doc(node: ast.AST) -> str:
    doc = ast.get_docstring(node) if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.Module) else None
    return inspect.cleandoc(doc) if doc else ""


def _api_entry(module: str, node: ast.ClassDef | ast.FunctionDef) -> Iterator[str]:
    qualified = f"dataquay.client.{module.removesuffix('.py')}.{node.name}"
    if isinstance(node, ast.FunctionDef):
        yield f"### `{_signature(node)}`\n\n`{qualified}`\n\n{_doc(node)}\n"
        return
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    head = f"{node.name}({_without_self(init.args)})" if init else node.name
    yield f"### `class {head}`\n\n`{qualified}`\n\n{_doc(node)}\n"
    for item in node.body:
        if not isinstance(item, ast.FunctionDef) or item.name.startswith("_"):
            continue
        if not any(ast.unparse(d) == "overload" for d in item.decorator_list):
            first = _doc(item).split("\n\n")[0]
            yield f"- `{_signature(item)}`" + (f": {' '.join(first.split())}" if first else "")
    yield ""


def api_reference() -> str:
    """The trainer's classes and functions with their signatures and docstrings, read from the source
    (torch need not be installed)."""
    out: list[str] = []
    for module, names in API.items():
        tree = ast.parse((CLIENT / module).read_text())
        nodes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
        for name in names:
            out.extend(_api_entry(module, nodes[name]))
    return "\n".join(out)


def status_json_reference() -> str:
    """The objects of ``status --json``, from the messages the daemons and the directory answer with."""
    out: list[str] = []
    for name, rows in schema(cache_pb2.StatsReply.DESCRIPTOR, jobs_pb2.NodeStatus.DESCRIPTOR, jobs_pb2.Job.DESCRIPTOR):
        out += [f"### {name}", "", "| key | JSON type |", "|---|---|"]
        out += [f"| `{key}` | {_cell(kind)} |" for key, kind in rows]
        out.append("")
    return "\n".join(out)


# -- pages --------------------------------------------------------------------------------------------------

PARTS: dict[str, tuple[str, Callable[[], str]]] = {
    "cli": ("reference/cli.md", cli_reference),
    "config": ("reference/config.md", config_reference),
    "metrics": ("reference/metrics.md", metrics_reference),
    "errors": ("reference/errors.md", errors_reference),
    "api": ("reference/python.md", api_reference),
    "status_json": ("reference/status-json.md", status_json_reference),
}
_PART = re.compile(r"(<!-- reference:(\w+) -->\n)(.*?)(<!-- /reference -->)", re.S)


def render(page: Path) -> str:
    """``page`` with its generated parts written anew."""

    def fill(match: re.Match[str]) -> str:
        _path, make = PARTS[match.group(2)]
        return f"{match.group(1)}\n{make().strip()}\n\n{match.group(4)}"

    return _PART.sub(fill, page.read_text())


def stale_pages(docs: Path = DOCS) -> list[str]:
    """The reference pages whose generated parts differ from the code's."""
    return [path for path, _make in PARTS.values() if render(docs / path) != (docs / path).read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) the generated parts of docs/reference/.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale page")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"docs/{path} is stale: run python -m dataquay.server.cli.reference", file=sys.stderr)
        return 1 if stale else 0
    for path, _make in PARTS.values():
        (DOCS / path).write_text(render(DOCS / path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
