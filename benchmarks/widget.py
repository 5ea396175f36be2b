"""Saved notebook size: the widget against the HTML views, for SmolLM2 on a 1,000-token input.

Run from the repository root (``make bench-widget``)::

    .venv/bin/python benchmarks/widget.py                  # 1,000 tokens
    .venv/bin/python benchmarks/widget.py --tokens 300     # a quick look

The text is the shipped Brown sample joined into one document, cut to the length in SmolLM2's
tokens. Two notebooks, each executed by nbclient in its own fresh kernel (as the test suite runs
docs/widget.ipynb), side by side in one run:

(a) widget  ``attnscope.widget(rec)``: the output holds tokens, shapes and scales; the page asks the
            kernel for each layer it draws, so no weights are saved;
(b) view    ``attnscope.view(rec)``: the self-contained HTML views, every layer in the output.

Figures: each saved notebook's size in bytes (nbformat's writer, widget state included), and, from
the widget's kernel, the size of the message answering one layer's request (layer 15, attention)
and the time to build it. The last line is one JSON object of figures; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.notebooks: the kernel's environment

import nbclient
import nbformat
from bench_json import add_smoke_flag, cpu_name, emit

from tests.notebooks import kernel_environment

DATA = Path(__file__).resolve().parents[1] / "src" / "attnscope" / "data" / "brown_sample.txt"

SETUP = """import attnscope
from pathlib import Path
text = " ".join(line.strip() for line in Path({data!r}).read_text(encoding="utf-8").splitlines() if line.strip())
rec = attnscope.extract(attnscope.load_model("smollm2"), text, max_length={tokens})
print(len(rec.tokens))"""

LAYER_MESSAGE = """import json, time
from attnscope.present.payload import layer_arrays
start = time.perf_counter()
message = json.dumps({"type": "layer", "id": 1, "packed": layer_arrays(rec, "self", "attention", 15)})
print(json.dumps({"layer_message_bytes": len(message), "layer_answer_ms": 1000 * (time.perf_counter() - start)}))"""


def run(cells: list[str], folder: Path) -> tuple[nbformat.NotebookNode, int, float]:
    """(executed notebook, its saved size in bytes, seconds to execute) of a notebook of ``cells``."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = nbclient.NotebookClient(notebook, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    start = time.perf_counter()
    client.execute(env=kernel_environment())
    seconds = time.perf_counter() - start
    return notebook, len(nbformat.writes(notebook).encode()), seconds


def printed(notebook: nbformat.NotebookNode, index: int) -> str:
    return "".join(output.get("text", "") for output in notebook.cells[index].outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="input length in SmolLM2 tokens (default 1000)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tokens = 16
    print(f"CPU: {cpu_name()}", flush=True)
    setup = SETUP.format(data=str(DATA), tokens=args.tokens)
    with tempfile.TemporaryDirectory() as work:
        widget_nb, widget_bytes, widget_s = run([setup, "attnscope.widget(rec)", LAYER_MESSAGE], Path(work))
        view_nb, view_bytes, view_s = run([setup, "attnscope.view(rec)"], Path(work))
    tokens = int(printed(widget_nb, 0).split()[-1])
    assert tokens == int(printed(view_nb, 0).split()[-1])
    layer = json.loads(printed(widget_nb, 2).strip().splitlines()[-1])
    figures = {
        "model": "smollm2",
        "tokens": tokens,
        "widget_notebook_bytes": widget_bytes,
        "view_notebook_bytes": view_bytes,
        "view_over_widget": round(view_bytes / widget_bytes, 1),
        "layer_message_bytes": layer["layer_message_bytes"],
        "layer_answer_ms": round(layer["layer_answer_ms"], 1),
        "widget_notebook_s": round(widget_s, 1),
        "view_notebook_s": round(view_s, 1),
    }
    emit("widget", figures)


if __name__ == "__main__":
    main()
