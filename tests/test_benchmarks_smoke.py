"""Every benchmark still runs: each script in benchmarks/ at its smallest sizes (``--smoke``, seconds).

A benchmark that nothing runs breaks silently (``make bench-views`` threw a JavaScript SyntaxError
for days after a refactor); ``make test`` runs them all, so a broken one fails CI. The real runs,
with their timings, stay out of the test suite (``make bench*``). A smoke run prints its figures
like a real one but never keeps them: docs/bench/ must be unchanged afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnscope.browser import why_unavailable

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted(path for path in (ROOT / "benchmarks").glob("*.py") if path.stem != "bench_json")
BROWSER = ("render", "long", "long_view", "steps_page")  # these drive Debian's chromium
SMOKE_TIMEOUT_S = 900  # seconds on a loaded 2-core machine; a smoke run takes well under a minute alone


def _kept_figures() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in (ROOT / "docs" / "bench").glob("*.json")}


def test_every_benchmark_offers_a_smoke_run_and_record():
    missing = [path.name for path in BENCHMARKS if "add_smoke_flag(parser)" not in path.read_text()
               and not ("--smoke" in path.read_text() and "add_record_flag(parser)" in path.read_text())]
    assert not missing, f"benchmarks without --smoke or --record: {missing}"


@pytest.fixture
def bench_json(monkeypatch, tmp_path):
    """benchmarks/bench_json.py with its two folders moved under tmp_path."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_json

    monkeypatch.setattr(bench_json, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(bench_json, "DOCS_BENCH", tmp_path / "docs_bench")
    return bench_json


@pytest.mark.parametrize("arguments, folders", [([], {"runs"}), (["--record"], {"runs", "docs_bench"}),
                                                (["--smoke"], set())])
def test_a_run_keeps_its_figures_apart_from_the_record_unless_asked(bench_json, monkeypatch, tmp_path, capsys,
                                                                   arguments, folders):
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", *arguments])
    bench_json.emit("x", {"tok_s": 1.5})
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tok_s"] == 1.5
    written = {folder.name for folder in tmp_path.iterdir() if (folder / "x.json").exists()}
    assert written == folders
    for folder in written:  # the command that re-runs the figures, without --record
        kept = json.loads((tmp_path / folder / "x.json").read_text())
        assert kept["figures"]["tok_s"] == 1.5 and kept["command"] == "python benchmarks/x.py"


def test_record_on_a_run_that_is_not_full_size_says_it_recorded_nothing(bench_json, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--quick", "--record"])
    with pytest.raises(SystemExit, match="not recorded"):
        bench_json.emit("x", {"tok_s": 1.5}, keep=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("script", [pytest.param(path, marks=[pytest.mark.browser] if path.stem in BROWSER else [])
                                    for path in BENCHMARKS], ids=[path.stem for path in BENCHMARKS])
def test_benchmark_runs_at_smoke_size(script: Path):
    if script.stem in BROWSER and (reason := why_unavailable()):
        pytest.skip(reason)
    kept = _kept_figures()
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(script), "--smoke"], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT_S, env=environment)
    assert done.returncode == 0, f"{script.name} --smoke failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(figures, dict) and set(figures) == {"skipped"}:
        pytest.skip(f"{script.name}: {figures['skipped']}")  # e.g. the gold treebanks are not beside this checkout
    assert isinstance(figures, dict) and figures.get("device_name"), f"{script.name}: last line is not its figures"
    assert _kept_figures() == kept, f"{script.name} --smoke changed docs/bench/ (a smoke run must keep nothing)"
