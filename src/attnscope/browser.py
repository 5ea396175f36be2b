"""Debian's Chromium, found in one place: the page tests, the view benchmarks and the screenshots
all launch it through :func:`launch` and ask :func:`why_unavailable` before they need it.

The path is ``/usr/bin/chromium`` (Debian's package ``chromium``) unless ``ATTNSCOPE_CHROMIUM``
names another executable. A browser is never downloaded (``playwright install`` reaches the
network, which this project never does at run time).
"""

from __future__ import annotations

import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any

DEFAULT_CHROMIUM = "/usr/bin/chromium"
CHROMIUM_VARIABLE = "ATTNSCOPE_CHROMIUM"
# headless as root; without the network flags Chromium keeps dialling Google's hosts, which a closed network refuses
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
HOW_TO_INSTALL = f"apt-get install -y chromium, or set {CHROMIUM_VARIABLE} to a Chromium executable"


def chromium_path() -> Path:
    """The Chromium executable to drive: ``$ATTNSCOPE_CHROMIUM``, else Debian's ``/usr/bin/chromium``."""
    return Path(os.environ.get(CHROMIUM_VARIABLE) or DEFAULT_CHROMIUM)


def launch(playwright: Any, **options: Any) -> Any:
    """A headless Chromium (``playwright.chromium.launch``) on :func:`chromium_path` with the offline flags."""
    return playwright.chromium.launch(executable_path=str(chromium_path()), args=CHROMIUM_ARGS, **options)


def why_unavailable() -> str | None:
    """None when a headless Chromium starts here, else one line saying why not (and how to get one).

    Starting it is the only check that cannot be fooled (a file at the path that is not a browser, a
    missing shared library); the answer is kept for the life of the process."""
    return _start_failure(str(chromium_path()))


@cache
def _start_failure(executable: str) -> str | None:
    if not Path(executable).exists() and shutil.which(executable) is None:
        return f"no Chromium at {executable} ({HOW_TO_INSTALL})"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "playwright is not installed (pip install playwright; its own browser download is never used)"
    try:
        with sync_playwright() as playwright:
            launch(playwright).close()
    except Exception as error:  # noqa: BLE001 - any failure to start means: no browser here, say why
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"Chromium at {executable} does not start: {first_line[:200]}"
    return None
