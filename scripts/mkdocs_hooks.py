"""MkDocs hooks (mkdocs.yml ``hooks:``): the README is the site's home page.

README.md sits at the repository root, outside ``docs/``, and links the pages as ``docs/NAME.md`` so that they
resolve on the repository's page; the pages link it as ``../README.md``. The site gets the README as its
``index.md``, with those links rewritten to where the files are in the site. Nothing is copied into ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"
HOME = "index.md"
# a Markdown link or image target that starts with docs/ (the README's links into the site)
INTO_DOCS = re.compile(r"\]\(docs/")
# a page's link to the README, with or without an anchor
TO_README = re.compile(r"\]\(\.\./README\.md")


def readme_as_home(markdown: str) -> str:
    """The README's Markdown with its links into ``docs/`` made relative to the site's root."""
    return INTO_DOCS.sub("](", markdown)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, HOME, content=readme_as_home(README.read_text(encoding="utf-8"))))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return TO_README.sub(f"]({HOME}", markdown)
