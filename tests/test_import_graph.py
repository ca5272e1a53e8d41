"""The import graph of the installed packages (``infeng_common``, ``infeng_compiler``,
``infeng_runtime``), read from the source with ``ast``: no cycle among the modules' import-time
imports, none in the runtime even counting the imports inside functions, the layers point one
way (the runtime never imports the compiler), and no runtime module is over ~500 lines."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"infeng_common": REPO / "common", "infeng_compiler": REPO / "infeng_compiler",
            "infeng_runtime": REPO / "runtime"}
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


#: Compiler modules that sit above both layers and so may import the runtime: the ``infeng``
#: command, the interpreter behind the runtime's engine surface (``infeng generate``), and the IR
#: explorer, served behind the runtime's HTTP guard and page headers (``infeng explore``); all
#: belong to the command-line package that will sit above the compiler and the runtime.
ABOVE_BOTH = ("infeng_compiler.cli", "infeng_compiler.interp_engine", "infeng_compiler.explore")


def test_layers_point_one_way():
    """common <- compiler, common <- runtime; the compiler reaches the runtime only from the
    modules that sit above both (``ABOVE_BOTH``)."""
    graph = import_graph(top_level_only=False)
    assert [(a, b) for a, b in graph.edges if a.startswith(("infeng_runtime", "infeng_common"))
            and b.startswith("infeng_compiler")] == []
    assert [(a, b) for a, b in graph.edges if a.startswith("infeng_common") and b.startswith("infeng_runtime")] == []
    assert [(a, b) for a, b in graph.edges if a.startswith("infeng_compiler") and a not in ABOVE_BOTH
            and b.startswith("infeng_runtime")] == []


@pytest.mark.parametrize("path", sorted((REPO / "runtime").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_runtime_modules_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_RUNTIME_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most ~500: split it by concern)"
