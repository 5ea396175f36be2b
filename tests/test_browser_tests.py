"""Every page test finds Chromium in one place and skips, with one reason line, where none starts.

A fresh machine without chromium once turned two page tests into errors: they launched the browser
before checking for it. Now ``attnscope.browser`` is the only place that knows the path and the
flags, the ``browser`` fixture (conftest) the only way a test gets a browser."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnscope import browser

ROOT = Path(__file__).resolve().parent.parent
# what launching Chromium by hand looks like: the path written out, or playwright's launcher called directly
OTHER_WAYS = (".chromium.launch(", "/usr/bin/chromium", "executable_path=")


def test_no_test_or_benchmark_launches_chromium_but_through_attnscope_browser():
    sources = [*(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    offenders = [f"{path.relative_to(ROOT)}: {way}" for path in sources if path != Path(__file__).resolve()
                 for way in OTHER_WAYS if way in path.read_text(encoding="utf-8")]
    assert sources and not offenders, offenders


def test_the_path_comes_from_the_variable_and_a_missing_browser_is_one_line(monkeypatch):
    monkeypatch.setenv(browser.CHROMIUM_VARIABLE, "/nonexistent/chromium")
    assert browser.chromium_path() == Path("/nonexistent/chromium")
    reason = browser.why_unavailable()
    assert reason and "/nonexistent/chromium" in reason and "\n" not in reason
    monkeypatch.delenv(browser.CHROMIUM_VARIABLE)
    assert browser.chromium_path() == Path(browser.DEFAULT_CHROMIUM)


def test_a_file_that_is_not_a_browser_is_refused_by_starting_it(monkeypatch, tmp_path):
    pytest.importorskip("playwright.sync_api")
    impostor = tmp_path / "chromium"
    impostor.write_text("#!/bin/sh\nexit 1\n")
    impostor.chmod(0o755)
    monkeypatch.setenv(browser.CHROMIUM_VARIABLE, str(impostor))
    reason = browser.why_unavailable()
    assert reason and reason.startswith(f"Chromium at {impostor} does not start") and "\n" not in reason


def test_with_the_browser_hidden_page_tests_skip_and_never_error(tmp_path):
    """The page test that once errored on a machine without chromium, run as `make test` would run it."""
    environment = {**os.environ, browser.CHROMIUM_VARIABLE: "/nonexistent/chromium"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "browser",
                           "tests/test_gemma3.py", "tests/test_steps_view.py"],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600, check=False)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and "skipped" in summary and "error" not in summary and "passed" not in summary, \
        done.stdout[-3000:]
    assert "no Chromium at /nonexistent/chromium" in done.stdout
