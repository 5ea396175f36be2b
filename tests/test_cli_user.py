"""Small things a new user notices (issue 19): --version, a fast --help, the licence and project
links, the toy translator's strongest source token in a pipe, a line before a slow first step."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import attnscope

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnscope", *args], check=False, capture_output=True, text=True,
                          timeout=300)


def test_version_names_the_package_version():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"attnscope {attnscope.__version__}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == attnscope.__version__


# ablate and prune list their choices from registries that live beside torch code
@pytest.mark.parametrize("args", [[], ["report"], ["extract"], ["view"], ["plot"], ["patterns"], ["heads"],
                                  ["probe"], ["toy", "translate"], ["primer"], ["models"], ["serve"]])
def test_help_does_not_import_torch(args):
    code = ("import sys\nfrom attnscope.cli import main\ntry:\n    main(sys.argv[1:] + ['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True,
                            timeout=120)
    assert "usage: attnscope" in result.stdout and result.stderr.strip() == "False", result.stderr


def test_licence_and_project_links():
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "attnscope authors" in licence
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and "LICENSE" in project["license-files"]
    assert project["urls"] == {"Homepage": "https://github.com/attnscope/attnscope",
                               "Repository": "https://github.com/attnscope/attnscope",
                               "Issues": "https://github.com/attnscope/attnscope/issues"}


def test_toy_translate_in_a_pipe_prints_the_strongest_source_token_as_text():
    from attnscope import load_model
    from attnscope.capture.decode import decode_steps

    sentence = "he wants to read the letter today"
    result = run("toy", "translate", sentence)
    assert result.returncode == 0, result.stderr
    assert "strongest" in result.stdout  # the header wraps at 80 columns
    trace = decode_steps(load_model("toy-translator"), sentence)
    rows = [line.split("│") for line in result.stdout.splitlines() if line.startswith("│")]
    shown = [cells[5].split() for cells in rows if cells[1].strip().isdigit()]  # first line of each step
    assert len(shown) == len(trace.steps)
    for (token, weight), step in zip(shown, trace.steps):
        mean = step.cross_attention.mean(axis=(0, 1))  # [source_pos], computed here independently
        assert token == trace.source_tokens[int(np.argmax(mean))]
        assert float(weight) == pytest.approx(mean.max(), abs=0.006)


def test_converting_a_gguf_says_so_before_the_slow_step(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF but damaged")
    result = subprocess.run([sys.executable, "-m", "attnscope", "report", "hi", "--model", str(gguf)], check=False,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "ATTNSCOPE_CACHE": str(tmp_path)})
    lines = result.stderr.splitlines()
    assert lines[0].startswith("attnscope: converting model.gguf to float32 safetensors once"), result.stderr
    assert result.returncode == 2 and lines[-1].startswith("attnscope: error: cannot read")

