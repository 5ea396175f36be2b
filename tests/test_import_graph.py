"""attnscope's modules import each other one way only: no circle, counting imports inside functions
and under TYPE_CHECKING (a circle there is still two modules that must change together)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import attnscope

PACKAGE = Path(attnscope.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """attnscope modules that ``path`` names in any import statement, resolved to module names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found |= {candidate for candidate in [target, *(f"{target}.{a.name}" for a in node.names)]
                      if candidate in modules}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
    return found - {name}


def import_graph() -> nx.DiGraph:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    graph.add_edges_from((module_name(path), target) for path in paths for target in imported_modules(path, modules))
    return graph


def test_the_graph_sees_lazy_and_type_checking_imports():
    graph = import_graph()
    assert graph.has_edge("attnscope.experiments.sweeps", "attnscope.experiments.report")  # inside a method
    assert graph.has_edge("attnscope", "attnscope.record")  # under TYPE_CHECKING
    assert graph.has_edge("attnscope.record", "attnscope.record_checks")


def test_no_module_imports_itself_through_others():
    circles = [sorted(group) for group in nx.strongly_connected_components(import_graph()) if len(group) > 1]
    assert circles == []
