"""The shape of the code: imports point one way.

A cycle among modules means neither can be read, tested or moved without the
other, and a function-level import only hides one; the directory must work
without the daemon's code (it is deployed apart from it). Imports under
``if TYPE_CHECKING:`` are for annotations only and do not count.
"""

from __future__ import annotations

import ast
import tomllib
from collections import deque
from collections.abc import Iterator
from functools import cache
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The roots pyproject's package-dir names, each holding a part of the dataquay namespace.
ROOTS = ("protos", "client", "server")
DIRECTORY = "dataquay.server.directory"
NODE = "dataquay.server.node"
TOOLS = "dataquay.server.tools"
CLI = "dataquay.server.cli"

Graph = dict[str, set[str]]


def module_files() -> dict[str, Path | None]:
    """Every dataquay module, by dotted name: its source, or None for a compiled
    extension (known by its stub), which imports no dataquay module."""
    modules: dict[str, Path | None] = {}
    for root in ROOTS:
        for path in sorted((REPO / root / "dataquay").rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            parts = path.relative_to(REPO / root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if path.suffix == ".py":
                modules[name] = path
            else:
                modules.setdefault(name, None)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth (functions too), but not under ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _imports(child)


def imported_modules(name: str, path: Path, modules: dict[str, Path | None]) -> set[str]:
    """The dataquay modules that module ``name`` imports: ``from a import b`` counts
    as importing ``a.b`` when that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for statement in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(statement, ast.Import):
            targets = [alias.name for alias in statement.names]
        else:
            base = statement.module or ""
            if statement.level:
                anchor = package.split(".")[: len(package.split(".")) - statement.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in statement.names
            ]
        found |= {target for target in targets if target in modules and target != name}
    return found


@cache
def import_graph() -> Graph:
    modules = module_files()
    return {name: imported_modules(name, path, modules) if path else set() for name, path in modules.items()}


def shortest_path(graph: Graph, start: str, goal: set[str], within: set[str] | None = None) -> list[str]:
    """The shortest import chain from ``start`` to a module in ``goal`` (empty if none)."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node]):
            if within is not None and target not in within:
                continue
            if target in goal:
                path = [target, node]
                while (previous := came_from[path[-1]]) is not None:
                    path.append(previous)
                return path[::-1]
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    return []


def test_the_graph_sees_modules_and_their_imports() -> None:
    graph = import_graph()
    assert {"dataquay.protos.cache_pb2", "dataquay.client.manifest", "dataquay.server.node.daemon"} <= set(graph)
    assert "dataquay.server.node.cache.store" in graph["dataquay.server.node.daemon"]


def test_imports_in_functions_count_and_those_for_type_checking_do_not() -> None:
    source = """
import a
if TYPE_CHECKING:
    import b
else:
    import c
if typing.TYPE_CHECKING:
    import d
def f():
    from e import g
"""
    found = [
        alias.name if isinstance(s, ast.Import) else s.module for s in _imports(ast.parse(source)) for alias in s.names
    ]
    assert found == ["a", "c", "e"]


def test_no_import_cycles_among_dataquay_modules() -> None:
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as exc:
        raise AssertionError("import cycle: " + " -> ".join(reversed(exc.args[1]))) from None


def _inside(graph: Graph, *packages: str) -> set[str]:
    return {name for name in graph if any(name == p or name.startswith(p + ".") for p in packages)}


def test_the_directory_imports_nothing_of_the_daemon() -> None:
    graph = import_graph()
    node = _inside(graph, NODE)
    chains = [
        " -> ".join(chain) for name in sorted(_inside(graph, DIRECTORY)) if (chain := shortest_path(graph, name, node))
    ]
    assert not chains, "the directory reaches the daemon's code:\n" + "\n".join(chains)


def test_only_the_cli_uses_the_tools_and_nothing_uses_the_cli() -> None:
    graph = import_graph()
    tools, cli = _inside(graph, TOOLS), _inside(graph, CLI)
    # `python -m dataquay` is the command itself: above the CLI, which it runs.
    below = sorted(set(graph) - tools - cli - {"dataquay.__main__"})
    chains = [" -> ".join(chain) for name in below if (chain := shortest_path(graph, name, tools | cli))] + [
        f"{name} -> {target}" for name in sorted(tools) for target in sorted(graph[name] & cli)
    ]
    assert not chains, "imports that point down at tools/ or cli/:\n" + "\n".join(chains)


def test_every_package_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {
        ".".join(init.parent.relative_to(REPO / root).parts)
        for root in ROOTS
        for init in (REPO / root / "dataquay").rglob("__init__.py")
    }
    # Folders of data alone (the deploy files): listed, with package data, and no code.
    data = {name for name in set(setuptools["packages"]) - packages if name in setuptools["package-data"]}
    assert all(not list((REPO / "server" / Path(*name.split("."))).rglob("*.py")) for name in data)
    # The package itself (its version, `python -m dataquay`) lives in server/; the
    # protos' and client's folders only add to it.
    assert sorted(p.name for p in (REPO / "server" / "dataquay").glob("*.py")) == ["__init__.py", "__main__.py"]
    assert not [p for root in ("protos", "client") for p in (REPO / root / "dataquay").glob("*.py")]
    assert packages | data == set(setuptools["packages"])


#: The rooms of node/ and what each may import of the others and of node/'s root
#: (directly: a room reaches further only through the rooms it may import). The
#: root keeps the wiring and the faces; no room imports the daemon, its servicer,
#: the stager or the healer, which sit above them all.
ROOMS: dict[str, set[str]] = {
    "cache": set(),
    "cluster": set(),
    "prep": set(),
    "users": set(),
    "peers": {"cache"},
    # forwarding writes a read's result into a trainer's segment
    "handoff": {"reads", "users"},
    # caching behind reads the payload from a trainer's segment
    "reads": {"cache", "cluster", "peers", "handoff", "datasets", "metrics"},
    "exchange": {"cache", "cluster", "peers", "datasets"},
}
#: node/'s root: the daemon's wiring and faces, their counters and snapshot, the
#: stager, which spans cache and PFS, and the healer, which spans cluster, peers, cache and PFS.
NODE_ROOT = {"daemon", "servicer", "metrics", "datasets", "client_stats", "stager", "healer", "counters", "snapshot"}
PLANNING = "dataquay.server.planning"


def _part_of_node(name: str) -> str | None:
    """The room (or root module) of node/ that module ``name`` is in, None outside node/."""
    if not name.startswith(NODE + "."):
        return None
    return name.removeprefix(NODE + ".").split(".")[0]


def test_every_module_of_node_is_in_a_room_or_is_the_roots_wiring() -> None:
    graph = import_graph()
    parts = {part for name in graph if (part := _part_of_node(name))}
    assert not parts - set(ROOMS) - NODE_ROOT, "put these in a room of node/ (see ROOMS)"
    assert parts >= set(ROOMS) | NODE_ROOT


def test_each_room_imports_only_the_rooms_below_it() -> None:
    graph = import_graph()
    wrong = [
        f"{name} -> {target}"
        for name in sorted(graph)
        if (room := _part_of_node(name)) in ROOMS
        for target in sorted(graph[name])
        if (part := _part_of_node(target)) is not None and part != room and part not in ROOMS[room]
    ]
    assert not wrong, "imports across node/'s rooms that the layout does not allow:\n" + "\n".join(wrong)


def test_handoff_and_peers_do_not_import_each_other() -> None:
    graph = import_graph()
    handoff, peers = _inside(graph, NODE + ".handoff"), _inside(graph, NODE + ".peers")
    assert not [name for name in handoff if graph[name] & peers]
    assert not [name for name in peers if graph[name] & handoff]


def test_planning_does_no_io_so_reaches_nothing_of_the_daemon_but_the_write_batchs_size() -> None:
    graph = import_graph()
    allowed = {NODE + ".cache.write_queue"}
    assert not graph[NODE + ".cache.write_queue"]
    node = _inside(graph, NODE) - allowed
    chains = [
        " -> ".join(chain) for name in sorted(_inside(graph, PLANNING)) if (chain := shortest_path(graph, name, node))
    ]
    assert not chains, "planning reaches the daemon's code:\n" + "\n".join(chains)


def test_only_the_daemon_imports_every_room() -> None:
    graph = import_graph()
    rooms_imported = {
        name: {part for target in graph[name] if (part := _part_of_node(target)) in ROOMS} for name in graph
    }
    assert [name for name, rooms in rooms_imported.items() if rooms == set(ROOMS)] == [NODE + ".daemon"]


def test_no_part_of_the_daemon_is_handed_the_daemon() -> None:
    """The daemon builds its parts and hands each face the handlers it needs:
    nothing of node/ names the Daemon, not even in an annotation."""
    daemon = NODE + ".daemon"
    naming = []
    for name, path in module_files().items():
        if path is None or not name.startswith(NODE + ".") or name == daemon:
            continue
        for statement in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(statement, ast.ImportFrom) and (
                statement.module == daemon
                or (statement.module == NODE and any(a.name == "daemon" for a in statement.names))
            ):
                naming.append(name)
    assert not naming, "these take the whole daemon: hand them its parts instead:\n" + "\n".join(sorted(naming))


CLIENT = "dataquay.client"
WIRE = "dataquay.client.wire"
#: What of the trainer's API the daemon and the directory may import beside the
#: wire core: pure logic and formats both sides must agree on (the placement, a
#: job's plan and settings, the manifest and its PFS ranges, prepped batches)
#: and the error classes they raise. cli/ and tools/ start trainers, so they may
#: use all of it.
SHARED_WITH_SERVER = {
    f"{CLIENT}.{name}"
    for name in ("errors", "manifest", "pfs", "file_systems", "units", "jobs", "job_settings", "prepped")
}


def test_the_server_imports_of_the_client_only_the_wire_core_and_what_both_sides_share() -> None:
    graph = import_graph()
    client = _inside(graph, CLIENT)
    allowed = _inside(graph, WIRE, f"{CLIENT}.placement") | SHARED_WITH_SERVER
    wrong = [
        f"{name} -> {target}"
        for name in sorted(_inside(graph, "dataquay.server") - _inside(graph, TOOLS, CLI))
        for target in sorted(graph[name] & client - allowed)
    ]
    assert not wrong, "the server imports the trainer's API (move what both need into client/wire/):\n" + "\n".join(
        wrong
    )


def test_the_wire_core_imports_nothing_of_the_trainers_api_but_its_errors() -> None:
    graph = import_graph()
    wire = _inside(graph, WIRE)
    above = _inside(graph, CLIENT) - wire - {f"{CLIENT}.errors"}
    wrong = [f"{name} -> {target}" for name in sorted(wire) for target in sorted(graph[name] & above)]
    assert not wrong, "the wire core reaches up into the trainer's API:\n" + "\n".join(wrong)
    assert {f"{WIRE}.records", f"{WIRE}.batch_reads", f"{WIRE}.read_stream", f"{WIRE}._records"} <= wire
