"""docs/widget.ipynb executed by nbclient on a real kernel (ipykernel): every cell runs, the widget
is displayed as a widget with a one-line fallback, the selection reads back, ``from_attentions``
works on a plain transformers call, the saved notebook stays small, and its migration table is the
documentation's (docs/notebooks.md). ``ATTNSCOPE_WRITE_NOTEBOOK=1`` writes the executed notebook back to docs/."""

from __future__ import annotations

import json
import os
import re

import nbformat
import pytest

from .notebooks import REPO, kernel_environment

nbclient = pytest.importorskip("nbclient", reason="the notebook extra is not installed (pip install -e '.[notebook]')")
pytest.importorskip("ipykernel", reason="the notebook extra is not installed (pip install -e '.[notebook]')")
pytest.importorskip("anywidget", reason="the notebook extra is not installed (pip install -e '.[notebook]')")

NOTEBOOK = REPO / "docs" / "widget.ipynb"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after a run in a fresh kernel (working folder: a temporary one), and its saved bytes."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    folder = tmp_path_factory.mktemp("notebook")
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    client.execute(env=kernel_environment())  # the kernel imports this checkout's attnscope
    text = nbformat.writes(notebook)
    if os.environ.get("ATTNSCOPE_WRITE_NOTEBOOK") == "1":
        NOTEBOOK.write_text(text, encoding="utf-8")
    return notebook, text


def outputs_of(notebook, marker: str) -> list[dict]:
    """The outputs of the first code cell whose source contains ``marker``."""
    return next(cell.outputs for cell in notebook.cells if cell.cell_type == "code" and marker in cell.source)


def test_every_cell_runs_and_widgets_are_widgets(executed):
    notebook, _ = executed
    assert not any(output.output_type == "error" for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.outputs)
    shown = outputs_of(notebook, "w = attnscope.widget(rec")[0]["data"]
    assert WIDGET_VIEW in shown
    assert "the drawing needs a running kernel" in shown["text/plain"]
    assert "head, model, neuron view" in shown["text/html"]
    # the widget's state is saved with the notebook: tokens and shapes, never the weights
    states = notebook.metadata["widgets"][WIDGET_STATE]["state"]
    ours = [state["state"] for state in states.values() if "payload" in state["state"]]
    assert len(ours) == 2 and all(kind["attention"]["data"] == "" for state in ours for kind in state["payload"]["kinds"])


def test_selection_reads_back_and_observers_see_changes(executed):
    notebook, _ = executed
    printed = outputs_of(notebook, 'print(f"layer {w.layer}')[0]["text"]
    assert printed.strip() == "layer 3, heads [5], selected token 5 ('store')"
    changes = outputs_of(notebook, "changes = []")[0]["data"]["text/plain"]
    assert changes == "[('layer', 4), ('heads', [0, 7])]"


def test_from_attentions_on_a_plain_transformers_call(executed):
    notebook, _ = executed
    record = outputs_of(notebook, "from_attentions(outputs.attentions")[0]["data"]["text/plain"]
    assert "model='all-MiniLM-L6-v2'" in record and "self.attention[6, 12, 16, 16]" in record
    table = outputs_of(notebook, "patterns.to_frame()")[0]["data"]["text/plain"]
    assert "layer" in table and "head" in table


def test_saved_notebook_is_small(executed):
    _, text = executed
    assert len(text.encode()) < 1_000_000


def test_migration_table_is_the_notebooks_pages():
    notebook = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    cells = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "markdown"]
    ours = next(cell for cell in cells if "| you wrote |" in cell)
    page = (REPO / "docs" / "notebooks.md").read_text(encoding="utf-8")
    rows = lambda text: re.findall(r"^\|.*\|$", text[text.index("| you wrote |"):].split("\n\n")[0], re.MULTILINE)
    assert rows(ours) == rows(page) and len(rows(ours)) > 10
