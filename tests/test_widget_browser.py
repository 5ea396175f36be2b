"""The notebook widget in JupyterLab: a real Jupyter server started here (loopback, a token), a real
kernel, Debian's Chromium driven by Playwright (never a downloaded browser).

A small notebook shows ``attnscope.widget(rec)``; the test runs its cells one at a time as a user
would (JupyterLab's own run command), checks that the widget draws what the record holds, that
setting ``w.layer`` / ``w.heads`` from Python changes the drawing, and that a double-click in the
drawing reaches Python (``w.heads`` read back by the next cell). Waits are on conditions, with
generous limits: a first JupyterLab load on a busy 2-core machine takes a while.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from attnscope import extract

from .notebooks import kernel_environment

pytest.importorskip("jupyterlab", reason="the notebook extra is not installed (pip install -e '.[notebook]')")
pytest.importorskip("anywidget", reason="the notebook extra is not installed (pip install -e '.[notebook]')")
nbformat = pytest.importorskip("nbformat")

TEXT = "I went to the store."
CELLS = [
    (f"import attnscope\nrec = attnscope.extract(attnscope.load_model('minilm'), {TEXT!r}, qkv=True)\n"
     "w = attnscope.widget(rec)\nw"),
    "w.layer = 3\nw.heads = [5]",
    "print('selection', w.layer, w.heads, w.selected_token)",
    "w.view = 'model'",
    "w.view = 'neuron'\nw.selected_token = 4",
]
LONG = 180_000  # ms: server start, first JupyterLab load, kernel start with torch
APP = "AttnscopeViews.instances[document.querySelector('.attnscope-root').id]"
ARTIFACTS = Path(__file__).parent / "artifacts"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_server(url: str, process: subprocess.Popen, limit: float = LONG / 1000) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} in {limit:.0f} s")


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """A JupyterLab server on a free loopback port serving a folder with the test notebook."""
    root = tmp_path_factory.mktemp("notebooks")
    home = tmp_path_factory.mktemp("jupyter-home")  # settings, workspaces, runtime files: not in the served folder
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "widget.ipynb")
    token, port = secrets.token_hex(16), free_port()
    env = kernel_environment()
    for name, folder in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")]:
        env[name] = str(home / folder)
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
               "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    log = (home / "server.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", process)
        yield f"http://127.0.0.1:{port}", token
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def record(minilm):
    return extract(minilm, TEXT, qkv=True)


class Lab:
    """A JupyterLab page with the test notebook open; cells are run with JupyterLab's own command."""

    def __init__(self, browser, base: str, token: str) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.goto(f"{base}/lab/tree/widget.ipynb?token={token}", timeout=LONG)
        self.wait("window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'")

    def wait(self, expression: str) -> None:
        self.page.wait_for_function(f"() => {{ try {{ return !!({expression}); }} catch (e) {{ return false; }} }}",
                                    timeout=LONG, polling=250)

    def js(self, expression: str):
        return self.page.evaluate(f"() => ({expression})")

    def run_cell(self, index: int) -> None:
        """Select cell ``index`` and run it, then wait until the kernel has finished it."""
        notebook = "jupyterapp.shell.currentWidget"
        self.page.evaluate(f"() => {{ {notebook}.content.activeCellIndex = {index}; "
                           f"return jupyterapp.commands.execute('notebook:run-cell'); }}")
        self.wait(f"{notebook}.content.widgets[{index}].model.executionCount !== null && "
                  f"{notebook}.sessionContext.session.kernel.status === 'idle'")

    def lines(self) -> list[dict]:
        return self.js(f"{APP}.views.head.drawnLines()")


def expected_lines(weights: np.ndarray) -> int:
    return int((np.rint(weights * 255) >= 1).sum())


def test_widget_draws_and_follows_python_both_ways(browser, jupyter, record):
    lab = Lab(browser, *jupyter)
    lab.run_cell(0)
    lab.wait("document.querySelector('.attnscope-root')?.dataset.drawn")
    assert lab.js(f"{APP}.state.layer") == 0
    assert len(lab.lines()) == expected_lines(record.attention[0])  # layer 0, every head, fetched from the kernel
    assert lab.js(f"{APP}.payload.kinds[0].attention.data") == ""  # nothing was carried in the output

    lab.run_cell(1)  # w.layer = 3; w.heads = [5]
    lab.wait(f"{APP}.views.head.drawnWith.layer === 3 && [...{APP}.state.heads].join() === '5'")
    lines = lab.lines()
    assert {line["head"] for line in lines} == {5}
    assert len(lines) == expected_lines(record.attention[3, 5])
    for line in lines[:200]:
        assert abs(line["weight"] - record.attention[3, 5, line["q_pos"], line["k_pos"]]) <= 0.5 / 255 + 1e-6
    ARTIFACTS.mkdir(exist_ok=True)
    lab.page.screenshot(path=str(ARTIFACTS / "widget_jupyterlab.png"))

    lab.page.dblclick(".attnscope-root div[data-view=head] span[data-head='2']")  # only head 2, in the page
    lab.wait(f"[...{APP}.state.heads].join() === '2' && {APP}.views.head.drawnLines().every(line => line.head === 2)")
    # ipywidgets keeps one message in flight and sends the latest state when the kernel is idle again,
    # so the kernel sees the page's last selection a moment after the drawing: read it back until then
    for _ in range(30):
        lab.run_cell(2)
        printed = lab.js("jupyterapp.shell.currentWidget.content.widgets[2].outputArea.node.textContent")
        if printed.split() == ["selection", "3", "[2]", "None"]:
            break
    assert printed.split() == ["selection", "3", "[2]", "None"]

    lab.run_cell(3)  # w.view = 'model': every layer is fetched for the thumbnails
    lab.wait("(document.querySelector('.attnscope-root').dataset.drawn || '').includes('model')")
    assert lab.js(f"{APP}.views.model.scene.ofType('image').length") == record.n_layers * record.n_heads

    lab.run_cell(4)  # w.view = 'neuron'; w.selected_token = 4: queries and keys of layer 3 are fetched
    lab.wait("(document.querySelector('.attnscope-root').dataset.drawn || '').includes('neuron')")
    lab.wait(f"{APP}.state.query === 4 && {APP}.views.neuron.displayed().length > 0")
    rows = lab.js(f"{APP}.views.neuron.displayed()")
    q = record.queries[3, 2, 4].astype(np.float64)  # layer 3, head 2 (the head chosen above), query 4
    keys = record.keys[3, 2].astype(np.float64)  # [k_pos, d_head]
    assert len(rows) == len(record.tokens)
    for row in rows:
        assert abs(row["qk"] - keys[row["k_pos"]] @ q) <= 0.02 * max(1.0, abs(keys[row["k_pos"]] @ q))  # float16 q, k
        assert abs(row["recorded"] - record.attention[3, 2, 4, row["k_pos"]]) <= 0.5 / 255 + 1e-3
    lab.page.screenshot(path=str(ARTIFACTS / "widget_jupyterlab_neuron.png"))
    assert lab.errors == [], lab.errors
    base = jupyter[0]
    assert all(url.startswith((base, "data:", "blob:")) for url in lab.requests), "a request left the machine"
    lab.page.close()
