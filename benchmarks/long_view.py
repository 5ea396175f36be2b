"""Size and load time of the long-input view at 8,192 tokens, 30 layers x 9 heads (SmolLM2's shape).

Run from the repository root (needs Debian's chromium, or ``ATTNSCOPE_CHROMIUM``, and ``pip install playwright``)::

    .venv/bin/python benchmarks/long_view.py
    .venv/bin/python benchmarks/long_view.py --tokens 4096 --loads 5 --keep out/

Input: synthetic causal attention with a known full matrix (``tests/long_attention.py``): per row
a sink on the first token, a diagonal on the previous token, 30 random earlier keys and an even
rest, so every query has 32 listed keys, as a top-32 capture gives. Its block-averaged overview
(blocks of 32 tokens, 256 x 256 cells) and top-32 rows go to ``attnscope.present.long_view``;
the page keeps itself under its default budget (36 MB) by grouping the overview and shipping fewer
keys per query (``top_k_in_page``, ``overview_cells_in_page``).

* ``html_mb``: size of the written file (MB = 10^6 bytes); target < 40.
* ``view_load_ms``: Chromium (Debian's, or ``$ATTNSCOPE_CHROMIUM``; headless) opens the file; the time from
  navigation start until the heatmap has drawn: the page sets the performance mark
  ``attnscope:<id>:drawn`` after reading back a pixel, which forces the canvas to be rasterized.
  Median of ``--loads`` fresh page loads; target < 2000.
* ``zoom_ms`` (zooming to 64 tokens: decode the head's top-k rows, draw labels),
  ``model_view_ms`` (open the thumbnails) and ``window_ms`` (open the window head view: decode the
  layer's heads, draw the lines) are timed in the page, medians of the same loads.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' synthetic attention
from bench_json import add_smoke_flag, emit
from render import fresh_loads, log, time_in_page

from attnscope.browser import launch
from attnscope.present import long_view
from tests.long_attention import synthetic_long_attention


def measure(browser: Any, path: Path, tokens: int = 8192) -> dict[str, float]:
    """One fresh load: ms to the drawn heatmap, then zoom, model view and window head view timings
    (zoom and window near the middle of ``tokens``: at 8,192 tokens, query 4,000)."""
    middle = tokens * 4000 // 8192
    return time_in_page(browser, path, f"""
        let t = performance.now(); await app.views.heatmap.setZoom({middle}, {max(0, middle - 32)}, {min(64, tokens)});
        flush('heatmap'); const zoom = performance.now() - t;
        t = performance.now(); await app.setView('model'); flush('model'); const model = performance.now() - t;
        app.setWindow({middle}, {min(128, tokens)});
        t = performance.now(); await app.setView('window'); flush('window'); const window = performance.now() - t;
        return {{view_load_ms: load, zoom_ms: zoom, model_view_ms: model, window_ms: window}};""", height=1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the long-input view at 8,192 tokens (prints one JSON line last)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--loads", type=int, default=3, help="fresh page loads; the median counts")
    parser.add_argument("--keep", type=Path, help="folder to keep the generated HTML file in")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.layers, args.heads, args.loads = 256, 2, 2, 1
    from playwright.sync_api import sync_playwright

    wall = time.perf_counter()
    log(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    attention = synthetic_long_attention(args.tokens, args.layers, args.heads, k=32, block=32, random_keys=30)
    synth_s = time.perf_counter() - start
    log(f"synthetic attention: overview {list(attention.overview.shape)}, top-k {list(attention.indices.shape)} "
        f"in {synth_s:.1f} s")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="attnscope-long-view-"))
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    page = long_view(attention.tokens, attention.overview, attention.block, attention.indices, attention.weights,
                     layers=range(args.layers), heads=range(args.heads), causal=True,
                     special_mask=np.arange(args.tokens) == 0)
    path = page.save(folder / "long_view.html")
    build_s = time.perf_counter() - start
    payload = page.payload
    log(f"page: {path.stat().st_size / 1e6:.1f} MB in {build_s:.1f} s; notes: {payload['notes']}")

    with sync_playwright() as playwright:
        browser = launch(playwright)
        runs = fresh_loads(browser, partial(measure, tokens=args.tokens), path, args.loads)
        browser.close()

    median = {key: round(statistics.median(run[key] for run in runs), 1) for key in runs[0]}
    result = {
        "tokens": args.tokens,
        "html_mb": round(path.stat().st_size / 1e6, 2),
        "view_load_ms": median["view_load_ms"],
        "view_load_ms_runs": [round(run["view_load_ms"], 1) for run in runs],
        "zoom_ms": median["zoom_ms"],
        "model_view_ms": median["model_view_ms"],
        "window_ms": median["window_ms"],
        "layers": args.layers,
        "heads": args.heads,
        "top_k_in_page": payload["top_k"]["k"],
        "top_k_captured": payload["top_k"]["source_k"],
        "overview_cells_in_page": payload["overview"]["size"],
        "build_s": round(build_s, 1),
        "synthetic_s": round(synth_s, 1),
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    log(f"html {result['html_mb']} MB (target < 40), view load {result['view_load_ms']} ms (target < 2000)")
    emit("long_view", result, keep=(args.tokens, args.layers, args.heads) == (8192, 30, 9))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
