"""Public names that a package imports on first use, so ``import attnscope`` (and ``--help``) stays
free of torch until a name that needs it is asked for.

A package writes each public name once, as an import under ``if TYPE_CHECKING:`` (what type
checkers and editors read); :func:`lazy_exports` reads those imports from the package's own source
and serves them at run time:

>>> if TYPE_CHECKING:
...     from .attention import capture as capture
>>> __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any


def lazy_exports(package: str, init_file: str, *, not_starred: Collection[str] = (),
                 also: Collection[str] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` of ``package`` (whose ``__init__.py`` is ``init_file``).

    The public names are those its ``if TYPE_CHECKING:`` block imports. ``not_starred``: public
    names left out of ``__all__`` (``from package import *`` must not need an optional extra);
    ``also``: names the package defines itself, added to ``__all__``.
    """
    exports = type_checking_imports(Path(init_file))

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    public = sorted({*exports, *also} - set(not_starred))

    def __dir__() -> list[str]:
        return public

    return __getattr__, __dir__, public


def type_checking_imports(init_file: Path) -> dict[str, str]:
    """Public name -> the module it comes from (relative, like ``".attention"``), for every
    ``from ... import name`` under ``if TYPE_CHECKING:`` in ``init_file``."""
    exports: dict[str, str] = {}
    for node in ast.parse(init_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    module = "." * statement.level + (statement.module or "")
                    exports.update({alias.asname or alias.name: module for alias in statement.names})
    return exports
