"""attnscope's floors, written once and enforced: a module imports only from its own floor or the
floors below it, counting imports inside functions and under TYPE_CHECKING (a lazy import that
goes up is still two modules that must change together). docs/ARCHITECTURE.md explains them.

From the bottom:

1. ``base``: errors, files, progress lines, inputs, argument types, shipped data, the version, lazy exports,
   where Chromium is (page tests and view benchmarks);
2. ``records``: what is stored (both record types, the file format and its checks);
3. ``models``: what a model is (aliases, adapters that find attention sites, offline loading);
4. ``capture``: the one attention function, its recorders and interventions, extract and generate;
5. ``analysis``: measures on records (never a model);
6. ``attribution``: direct logit attribution and the logit lens, of a prompt and of a generation's steps
   (analyses over what one capture pass recorded);
7. ``experiments``: interventions and measures that run a model;
8. ``probing``: what heads encode (dependencies, coreference, probes);
9. ``present``: views, functions of records and measures (no model);
10. ``corpus``: corpus jobs (engines, Ray, the report with its views);
11. ``lab``: the teaching lab (primer, toy translator);
12. ``serve``: the explorer;
13. ``cli``: the command line (the ``cli`` package: every command, the output folders they write, and
    ``__main__``) and the package's public face (``attnscope/__init__``, and ``text_view``: a text to its
    views in one call, the one public function that runs a model to draw).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

import attnscope

PACKAGE = Path(attnscope.__file__).parent

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("version", "_lazy", "errors", "files", "progress", "inputs", "arguments", "data", "browser", "memory")),
    ("records", ("records", "record", "generation")),  # record, generation: old import paths, re-exports
    ("models", ("models",)),
    ("capture", ("capture",)),
    ("analysis", ("analysis", "report")),
    ("attribution", ("attribution",)),
    ("experiments", ("experiments",)),
    ("probing", ("probing",)),
    ("present", ("present",)),
    ("corpus", ("corpus",)),
    ("lab", ("lab",)),
    ("serve", ("serve",)),
    ("cli", ("cli", "__main__", "text_view")),
]

# Imports that go up a floor on purpose, each with a comment saying why. None today: keep it so.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> int:
    """The floor index of an attnscope module (``attnscope`` itself, the public face, is on the top floor)."""
    if module == "attnscope":
        return len(FLOORS) - 1
    first = module.split(".")[1]
    for index, (_, names) in enumerate(FLOORS):
        if first in names:
            return index
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS")


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
    assert graph.has_edge("attnscope", "attnscope.records")  # under TYPE_CHECKING
    assert graph.has_edge("attnscope.records.attention", "attnscope.records.checks")


def test_no_module_imports_itself_through_others():
    circles = [sorted(group) for group in nx.strongly_connected_components(import_graph()) if len(group) > 1]
    assert circles == []


def test_every_module_is_on_a_floor():
    modules = list(import_graph())
    assert "attnscope.cli.main" in modules and "attnscope.records.attention" in modules  # the graph saw the package
    assert [module for module in modules if not _has_a_floor(module)] == []


def _has_a_floor(module: str) -> bool:
    try:
        floor_of(module)
    except AssertionError:  # a module of a package FLOORS does not name
        return False
    return True


def upward_imports(edges: list[tuple[str, str]]) -> list[str]:
    """The imports among ``edges`` (importer, imported) that go up a floor and are not allowed."""
    return sorted(f"{a} ({FLOORS[floor_of(a)][0]}) imports {b} ({FLOORS[floor_of(b)][0]})"
                  for a, b in edges if floor_of(b) > floor_of(a) and (a, b) not in ALLOWED_UPWARD)


def test_no_import_goes_up_a_floor():
    assert upward_imports(list(import_graph().edges())) == []


def test_every_allowed_upward_import_is_still_needed():
    graph = import_graph()
    assert [edge for edge in ALLOWED_UPWARD if not graph.has_edge(*edge)] == []


def test_the_floor_check_catches_an_upward_import():
    """The check itself can fail: a record that imports a view, a model that imports capture, or a command
    module left in a lower package (no name puts a module on the CLI's floor but its package)."""
    edges = [("attnscope.records.attention", "attnscope.present.html"), ("attnscope.models.loading",
             "attnscope.capture.attention"), ("attnscope.present.html", "attnscope.records.attention"),
             ("attnscope.cli.analysis", "attnscope.serve.app"),
             ("attnscope.capture.commands", "attnscope.experiments.interventions")]
    assert upward_imports(edges) == [
        "attnscope.capture.commands (capture) imports attnscope.experiments.interventions (experiments)",
        "attnscope.models.loading (models) imports attnscope.capture.attention (capture)",
        "attnscope.records.attention (records) imports attnscope.present.html (present)"]
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("attnscope.somewhere_new.module")


def test_records_import_no_view_when_loaded():
    """Loading the records (and a generation record file's class) imports nothing above them."""
    import subprocess
    import sys

    code = ("import sys, attnscope.records.generation, attnscope.records.attention, attnscope.records.format; "
            "print(sorted(m for m in sys.modules if m.startswith('attnscope.') and not m.startswith("
            "('attnscope.records', 'attnscope.errors', 'attnscope.files', 'attnscope._lazy', 'attnscope.version'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
