"""Every Python and shell example of the README and the documentation pages runs, or says why not.

Each page's examples run in order in one fresh temporary folder (tests/docs_examples.py): Python fences in one
namespace, shell fences with ``attnscope`` meaning ``python -m attnscope`` with this checkout's sources. The
folder holds the small input files the examples name (sentences.txt, pairs.jsonl, report.txt). An example that
is not run has ``<!-- not run: REASON -->`` right before it: a download, a GPU, a cluster, or minutes of work.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_examples import examples, markers, segments

ROOT = Path(__file__).resolve().parent.parent
# the design page's fences are diagrams of the code, not examples
NO_EXAMPLES = {"docs/ARCHITECTURE.md"}
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
         if path.relative_to(ROOT).as_posix() not in NO_EXAMPLES}
FOUND = {page: examples(page, text) for page, text in PAGES.items()}
RUN = sorted(page for page, found in FOUND.items() if any(example.not_run is None for example in found))

# the inputs the examples name, small so that each runs in seconds
INPUTS = {
    "sentences.txt": "The cat sat on the mat.\nI went to the store.\nShe gave him the book.\n",
    "pairs.jsonl": ('{"text": "I went to the store.", "pair": "At the store, I bought fresh strawberries."}\n'
                    '{"text": "The cat sat.", "pair": "It was tired."}\n'),
    "report.txt": ("The committee met on Monday to review the budget. It found that spending on roads had grown "
                   "faster than planned, and it asked the council to explain why. The council said that the winter "
                   "had been hard and that repairs could not wait. The committee will meet again next month.\n"),
}


def test_the_examples_are_found_on_the_pages():
    assert any(example.kind == "python" for example in FOUND["README.md"])
    assert sum(example.not_run is None for found in FOUND.values() for example in found) >= 12


def test_a_fence_is_an_example_and_a_marker_before_it_says_why_it_is_not_run():
    page = ("text\n\n<!-- not run: starts a server -->\n```shell\nattnscope serve\n```\n\n```python\nx = 1\n```\n"
            "\n```text\nnot an example\n```\n")
    found = examples("page.md", page)
    assert [(e.line, e.kind, e.not_run) for e in found] == [(4, "shell", "starts a server"), (8, "python", None)]
    assert found[1].code == "x = 1\n"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_not_run_marker_gives_a_reason_and_stands_before_an_example(page):
    marked = {example.line for example in FOUND[page] if example.not_run is not None}
    assert all(example.not_run for example in FOUND[page] if example.not_run is not None), (
        f"{page}: a `<!-- not run: REASON -->` marker without a reason")
    assert len(markers(PAGES[page])) == len(marked), (
        f"{page}: a `<!-- not run: ... -->` marker stands before no Python or shell fence "
        f"(markers on lines {markers(PAGES[page])}, marked fences on lines {sorted(marked)})")


def _attnscope_on_path(folder: Path) -> dict[str, str]:
    """An environment in which ``attnscope`` is this checkout's ``python -m attnscope``."""
    bin_folder = folder / ".bin"
    bin_folder.mkdir()
    script = bin_folder / "attnscope"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m attnscope "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    python_path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": python_path,
            "MPLBACKEND": "Agg"}


@pytest.mark.parametrize("page", RUN)
def test_the_examples_of_the_page_run(page, tmp_path):
    for name, text in INPUTS.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    plan = tmp_path / ".examples.json"
    plan.write_text(json.dumps(segments(FOUND[page])), encoding="utf-8")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_examples.py"), str(plan)], check=False,
                          cwd=tmp_path,
                          env=_attnscope_on_path(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"an example of {page} failed:\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"

