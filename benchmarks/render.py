"""Size and load time of the HTML views at 512 tokens: attnscope vs BertViz, for the same attention.

Run from the repository root (needs Debian's chromium, ``pip install playwright`` and
``pip install --no-deps bertviz ipython``)::

    .venv/bin/python benchmarks/render.py
    .venv/bin/python benchmarks/render.py --bertviz-deps /path/to/deps    # see "BertViz's scripts" below

Input: Brown-corpus sentences (:func:`attnscope.data.brown_sentences`) joined and cut to the
default model's limit of 512 tokens; ``attnscope.extract`` on the default model ``minilm``
(all-MiniLM-L6-v2: 6 layers x 12 heads). Both tools get this record's attention
``[layer, head, q_pos, k_pos]``.

* ours: ``attnscope.present.view(record, ["head", "model"], norms=False)``, saved as one file;
  ``html_bytes`` is its size.
* BertViz (PyPI ``bertviz``): ``head_view(...)`` and ``model_view(...)`` with
  ``html_action="return"`` on the same attention (one tensor per layer, ``[1, head, q, k]``);
  ``bertviz_html_bytes`` is the sum of the two HTML strings (BertViz writes one per view).
* ``load_ms``: Chromium (Debian's, or ``$ATTNSCOPE_CHROMIUM``; headless) opens our file; the time from
  navigation start until the head view has drawn: the page sets the performance mark
  ``attnscope:<id>:drawn`` after reading back a pixel, which forces the canvas to be rasterized.
  Median of ``--loads`` fresh page loads (each load printed). ``model_view_ms`` (click to the
  drawn model view), ``layer_ms`` (switching layer) and ``hover_ms`` (hovering a token) are
  timed in the page, medians of the same loads.
* ``bertviz_load_ms``: BertViz's head-view HTML in the same browser, from navigation until an
  ``<svg>`` appears, waiting at most ``--bertviz-timeout`` seconds. BertViz's HTML loads
  require.js, d3 and jQuery from cdnjs.cloudflare.com; offline those requests fail, so it is
  null with the reason in ``bertviz_error``.

BertViz's scripts: with ``--bertviz-deps DIR`` (a folder holding ``require.js``, ``d3.min.js``
and ``jquery.min.js``, e.g. from ``npm pack requirejs@2.3.6 d3@5.7.0 jquery@2.1.0`` unpacked), the
CDN requests are answered from those files and BertViz is timed a second time
(``bertviz_local_deps_load_ms`` / ``bertviz_local_deps_error``), so its failure is not just
the missing network.

The last line printed is one JSON object. Targets: size_ratio (ours / BertViz) <= 0.25 and
load_ms <= 1500 at 512 tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

from bench_json import add_smoke_flag, emit

import attnscope
from attnscope.browser import launch
from attnscope.data import brown_sentences
from attnscope.present import view

TOKENS = 512
ROOT_ID = "attnscope-view"
APP = f'AttnscopeViews.instances["{ROOT_ID}"]'
BERTVIZ_DEPS = {"require.min.js": "require.js", "d3.min.js": "d3.min.js", "jquery.min.js": "jquery.min.js"}


def log(message: str) -> None:
    print(message, flush=True)


def long_record(tokens: int) -> attnscope.AttentionRecord:
    """The default model's record of Brown sentences cut to ``tokens`` tokens (the model's limit)."""
    model = attnscope.load_model("minilm")
    text = " ".join(brown_sentences(80))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cut to the limit is intended
        record = next(attnscope.extract_corpus(model, [text], max_length=tokens, progress=False))
    if len(record.tokens) != tokens:
        raise SystemExit(f"expected {tokens} tokens, got {len(record.tokens)}")
    return record


def bertviz_pages(record: attnscope.AttentionRecord) -> tuple[str, str]:
    """BertViz's head-view and model-view HTML for the record's attention."""
    import torch
    from bertviz import head_view, model_view

    attention = [torch.from_numpy(record.attention[layer][None].copy()) for layer in range(record.n_layers)]
    tokens = list(record.tokens)
    head = head_view(attention, tokens, html_action="return").data
    model = model_view(attention, tokens, html_action="return").data
    return head, model


def time_in_page(browser: Any, path: Path, steps: str, height: int = 900) -> dict[str, float]:
    """One fresh load of our page until its first view has drawn, then the JS ``steps`` (a function body
    that sees ``app``, ``load`` (ms from navigation to drawn) and ``flush(view)``, and returns timings)."""
    page = browser.new_page(viewport={"width": 1200, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    # a function, not an expression string: the page's Content-Security-Policy forbids eval
    page.wait_for_function(f"() => document.getElementById('{ROOT_ID}').dataset.drawn", timeout=120_000)
    timings = page.evaluate(f"""async () => {{
        const app = {APP};
        const load = performance.getEntriesByName('attnscope:{ROOT_ID}:drawn')[0].startTime;
        const flush = (view) => app.views[view].canvas.getContext('2d').getImageData(0, 0, 1, 1);
        {steps}
    }}""")
    page.close()
    if errors:
        raise SystemExit(f"our page reported errors: {errors}")
    return timings


def fresh_loads(browser: Any, measure: Any, path: Path, loads: int) -> list[dict[str, float]]:
    """``measure(browser, path)`` on ``loads`` fresh loads of the page, each logged."""
    runs = []
    for index in range(loads):
        runs.append(measure(browser, path))
        log(f"  load {index + 1}/{loads}: " + ", ".join(f"{k} {v:.0f}" for k, v in runs[-1].items()))
    return runs


def measure_ours(browser: Any, path: Path, hover: int = 100) -> dict[str, float]:
    """One fresh load of our page: load time to the drawn head view, then interaction timings (hovering the
    query at position ``hover``)."""
    return time_in_page(browser, path, """
        let t = performance.now(); await app.setLayer(3); flush('head'); const layer = performance.now() - t;
        const head = app.views.head;
        t = performance.now(); head.setHover({side: 'query', pos: """ + str(hover) + """});
        flush('head'); const hover = performance.now() - t;
        head.setHover(null);
        t = performance.now(); await app.setView('model'); flush('model'); const model = performance.now() - t;
        return {load_ms: load, layer_ms: layer, hover_ms: hover, model_view_ms: model};""")


def measure_bertviz(browser: Any, path: Path, timeout_s: float, deps: Path | None) -> tuple[float | None, str | None]:
    """BertViz's head view: ms from navigation to its first <svg>, or None and why not."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("requestfailed", lambda request: problems.append(f"{request.url} failed: {request.failure}"))
    if deps is not None:
        def answer(route: Any) -> None:
            name = route.request.url.rsplit("/", 1)[-1]
            if route.request.url.startswith("https://") and name in BERTVIZ_DEPS:
                route.fulfill(path=str(deps / BERTVIZ_DEPS[name]), content_type="application/javascript")
            else:
                route.continue_()
        page.route("**/*", answer)
    try:
        page.goto(path.as_uri(), timeout=timeout_s * 1000, wait_until="load")
        page.wait_for_function("() => document.querySelector('svg') !== null", timeout=timeout_s * 1000)
        drawn = page.evaluate("performance.now()")
        return float(drawn), None
    except Exception as error:  # noqa: BLE001 - any failure to render is the figure we report
        reason = f"nothing drawn within {timeout_s:.0f} s ({type(error).__name__})"
        return None, "; ".join([*dict.fromkeys(problems), reason])
    finally:
        page.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="attnscope views vs BertViz at 512 tokens (prints one JSON line last)")
    parser.add_argument("--loads", type=int, default=5, help="fresh page loads of our file; the median counts")
    parser.add_argument("--bertviz-timeout", type=float, default=60.0, help="seconds to wait for BertViz to draw")
    parser.add_argument("--bertviz-deps", type=Path, help="folder with require.js, d3.min.js, jquery.min.js")
    parser.add_argument("--keep", type=Path, help="folder to keep the generated HTML files in")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    tokens = 32 if args.smoke else TOKENS
    if args.smoke:
        args.loads, args.bertviz_timeout = 1, 10.0
    if args.bertviz_deps is not None and not all((args.bertviz_deps / f).exists() for f in BERTVIZ_DEPS.values()):
        parser.error(f"--bertviz-deps needs {', '.join(BERTVIZ_DEPS.values())}")
    from playwright.sync_api import sync_playwright

    wall = time.perf_counter()
    load_before = os.getloadavg()[0]
    log(f"attnscope {attnscope.__version__}, {os.cpu_count()} cpus, load average {load_before:.2f}")
    record = long_record(tokens)
    log(f"record: {len(record.tokens)} tokens, attention {list(record.attention.shape)} [layer, head, q_pos, k_pos]")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="attnscope-render-"))
    folder.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    ours = view(record, ["head", "model"], norms=False).save(folder / "attnscope_views.html")
    build_s = time.perf_counter() - start
    log(f"ours: {ours.stat().st_size:,} bytes, built in {build_s:.2f} s")
    start = time.perf_counter()
    bertviz_head, bertviz_model = bertviz_pages(record)
    bertviz_build_s = time.perf_counter() - start
    bertviz_bytes = len(bertviz_head.encode()) + len(bertviz_model.encode())
    bertviz_path = folder / "bertviz_head_view.html"
    bertviz_path.write_text(bertviz_head, encoding="utf-8")
    del bertviz_model
    log(f"bertviz: {bertviz_bytes:,} bytes (head + model view), built in {bertviz_build_s:.1f} s")

    with sync_playwright() as playwright:
        browser = launch(playwright)
        runs = fresh_loads(browser, partial(measure_ours, hover=min(100, len(record.tokens) - 1)), ours, args.loads)
        bertviz_ms, bertviz_error = measure_bertviz(browser, bertviz_path, args.bertviz_timeout, None)
        log(f"bertviz offline: {bertviz_ms} ms; {bertviz_error}")
        local: dict[str, Any] = {}
        if args.bertviz_deps is not None:
            ms, error = measure_bertviz(browser, bertviz_path, args.bertviz_timeout, args.bertviz_deps)
            local = {"bertviz_local_deps_load_ms": None if ms is None else round(ms, 1),
                     "bertviz_local_deps_error": error}
            log(f"bertviz with local require.js/d3/jQuery: {ms} ms; {error}")
        browser.close()

    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    html_bytes = ours.stat().st_size
    result = {
        "tokens": len(record.tokens),
        "html_bytes": html_bytes,
        "bertviz_html_bytes": bertviz_bytes,
        "size_ratio": round(html_bytes / bertviz_bytes, 5),
        "load_ms": round(median["load_ms"], 1),
        "bertviz_load_ms": None if bertviz_ms is None else round(bertviz_ms, 1),
        "bertviz_error": bertviz_error,
        **local,
        "load_ms_runs": [round(run["load_ms"], 1) for run in runs],
        "model_view_ms": round(median["model_view_ms"], 1),
        "layer_ms": round(median["layer_ms"], 1),
        "hover_ms": round(median["hover_ms"], 1),
        "build_s": round(build_s, 2),
        "bertviz_build_s": round(bertviz_build_s, 1),
        "layers": record.n_layers,
        "heads": record.n_heads,
        "load_avg_before": round(load_before, 2),
        "load_avg_after": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    log(f"size ratio {result['size_ratio']} (target <= 0.25), load {result['load_ms']} ms (target <= 1500)")
    emit("render", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
