"""The import graph of the installed packages (``infeng_common``, ``infeng_compiler``,
``infeng_runtime``, ``infeng_cli``), read from the source with ``ast``: no cycle among the modules'
import-time imports, none in the runtime even counting the imports inside functions, the layers
point one way (the runtime never imports the compiler; nothing imports the command line, the top
layer), and no runtime or command-line module is over ~500 lines."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"infeng_common": REPO / "common", "infeng_compiler": REPO / "infeng_compiler",
            "infeng_runtime": REPO / "runtime", "infeng_cli": REPO / "cli"}
#: The most lines a runtime module may have (the serving layer's modules are one idea each).
MAX_RUNTIME_LINES = 520


@cache
def modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(module: str, path: Path, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The known modules an import statement loads (``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
        names = subs if subs and len(subs) == len(node.names) else [source, *subs]
    else:
        return []
    out = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


@cache
def import_graph(top_level_only: bool) -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        statements = tree.body if top_level_only else ast.walk(tree)
        for node in statements:
            for target in imported(module, path, node, known):
                graph.add_edge(module, target)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_no_import_cycle_at_import_time():
    assert cycles(import_graph(top_level_only=True)) == []


def test_no_import_cycle_in_the_runtime_even_inside_functions():
    graph = import_graph(top_level_only=False)
    runtime = graph.subgraph(m for m in graph if m.startswith(("infeng_runtime", "infeng_common")))
    assert cycles(runtime) == []


#: Compiler modules that use the runtime as a library: the interpreter behind the runtime's engine
#: surface (``infeng generate``, tests serving the golden model), and the IR explorer, served
#: behind the runtime's HTTP guard and page headers (``infeng explore``).
ABOVE_BOTH = ("infeng_compiler.interp_engine", "infeng_compiler.explore")


def test_layers_point_one_way():
    """common <- compiler, common <- runtime, all of them <- cli; the compiler reaches the runtime
    only from the modules that use it as a library (``ABOVE_BOTH``); nothing imports the cli."""
    graph = import_graph(top_level_only=False)
    assert [(a, b) for a, b in graph.edges if not a.startswith("infeng_cli") and b.startswith("infeng_cli")] == []
    assert [(a, b) for a, b in graph.edges if a.startswith(("infeng_runtime", "infeng_common"))
            and b.startswith("infeng_compiler")] == []
    assert [(a, b) for a, b in graph.edges if a.startswith("infeng_common") and b.startswith("infeng_runtime")] == []
    assert [(a, b) for a, b in graph.edges if a.startswith("infeng_compiler") and a not in ABOVE_BOTH
            and b.startswith("infeng_runtime")] == []


@pytest.mark.parametrize("path", sorted([*(REPO / "runtime").rglob("*.py"), *(REPO / "cli").rglob("*.py")]),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_runtime_and_cli_modules_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_RUNTIME_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most ~500: split it by concern)"
