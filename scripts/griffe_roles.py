"""Griffe extension (mkdocs.yml, mkdocstrings' ``extensions:``): the docstrings' reST roles render on the API pages.

attnscope's docstrings name other objects the Sphinx way (``:func:`~.patching.activation_patching```), which
IDEs and ``help()`` read well; Markdown would show the role as literal text. Each role becomes an optional
cross-reference of mkdocs-autorefs on the object's full path: a link where the site documents that object,
the name in code font where it does not (torch's classes, private helpers), never a broken link.
"""

from __future__ import annotations

import html
import re
from typing import Any

from griffe import Extension, NameResolutionError, Object

# :func:`name`, :class:`~pkg.Name`, :py:meth:`.Class.method` ...: the role, then the target as written
ROLE = re.compile(r":(?:py:)?(?P<role>func|class|mod|meth|attr|data|exc|obj|const|type):`(?P<target>[^`]+)`")


class ReSTRoles(Extension):
    """Rewrite every reST role in every docstring into an optional autorefs cross-reference."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and ":" in docstring.value:
            docstring.value = ROLE.sub(lambda match: cross_reference(obj, match["target"]), docstring.value)


def cross_reference(obj: Object, target: str) -> str:
    """The autorefs tag for ``target`` as written in ``obj``'s docstring: shown like Sphinx shows it (``~``: the
    last part only; a leading ``.`` dropped), linked to the full path it names from ``obj``'s scope."""
    short = target.startswith("~")
    written = target.lstrip("~")
    shown = written.rsplit(".", 1)[-1] if short else written.lstrip(".")
    return (f'<autoref identifier="{html.escape(full_path(obj, written))}" optional>'
            f"<code>{html.escape(shown)}</code></autoref>")


def full_path(obj: Object, written: str) -> str:
    """The dotted path ``written`` names from ``obj``: its first part resolved in ``obj``'s scope (members,
    imports, enclosing scopes); a leading ``.`` relative to ``obj``'s package; else ``written`` as it is."""
    relative = written.startswith(".")
    first, _, rest = written.lstrip(".").partition(".")
    try:
        resolved = obj.resolve(first)
    except (NameResolutionError, AttributeError, KeyError):
        if not relative:
            return written
        module = obj.module
        package = module.path if module.is_init_module else module.path.rsplit(".", 1)[0]
        resolved = f"{package}.{first}"
    return f"{resolved}.{rest}" if rest else resolved
