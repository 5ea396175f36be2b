"""Size of the step view's page for 64 and 500 generated tokens, and a page of 1,024 steps with attribution and routes
opened and clicked through in Chromium; SmolLM2's shape (30 layers x 9 heads).

Run from the repository root (the 1,024-step page needs Debian's chromium, or ``ATTNSCOPE_CHROMIUM``, and
``pip install playwright``)::

    .venv/bin/python benchmarks/steps_page.py
    .venv/bin/python benchmarks/steps_page.py --quick   # the 1,024-step page in a small shape (6 x 3 heads)
    .venv/bin/python benchmarks/steps_page.py --generation gen.safetensors   # also a real saved generation

Input: synthetic :class:`attnscope.GenerationRecord` s after a 64-token prompt (``tests/long_steps.py``; generating
1,024 real tokens takes many minutes on a CPU): every row is a softmax over its keys of random logits (standard normal
x 1.5) plus a sink on the first token (+4) and a bump on the last three keys (+2), the shape decoder attention usually
has; value norms log-normal. The 1,024-step record also holds each step's attribution (10 ranked heads split over the
step's tokens, a 3-token logit lens per layer) and route (60 edges per step). The page ships every head's row
quantized to one byte (present/steps.py), raw and norm-weighted, and the attribution and routes as packed arrays,
deflated, their per-step parts in blocks of steps that the page decodes when it first shows one of their steps.

* ``page_mb_64`` / ``page_mb_500``: size of the written HTML file (MB = 10^6 bytes); target < 20 at 500.
* ``build_s_64`` / ``build_s_500``: seconds to build the payload and write the page.
* ``page_1024_mb``: the 1,024-step page with attribution and routes; ``page_1024_attribution_mb`` and
  ``page_1024_routes_mb`` the JSON of those two parts of its payload.
* ``page_1024_open_ms``: Chromium opens the file; ms from navigation until the first step has drawn (the page's
  ``attnscope:<id>:drawn`` performance mark); target <= 2,000.
* ``page_step_click_ms``: the slowest of clicks on steps across the page (first, last, middle, ...): ms from the click
  until the step has drawn (decoding its blocks first where no step of theirs was shown) and the next animation frame;
  target <= 100. ``page_step_click_median_ms`` beside it.
* with ``--generation``: ``real_tokens`` generated and ``real_page_mb`` of that record's page.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' synthetic generations
from bench_json import add_smoke_flag, emit

from attnscope.present.payload import to_json
from attnscope.present.steps import StepsView, generation_payload
from attnscope.records.generation import GenerationRecord
from tests.long_steps import click_ms, opened_ms, synthetic_generation

CLICKED = (1023, 0, 1, 256, 511, 512, 700, 1000, 1022)  # steps clicked on the 1,024-step page, in this order


def page_size(record: GenerationRecord, folder: Path) -> tuple[float, float]:
    """(MB of the written page, seconds to build and write it)."""
    start = time.perf_counter()
    path = StepsView(generation_payload(record)).save(folder / "steps.html")
    return path.stat().st_size / 1e6, time.perf_counter() - start


def long_page(folder: Path, steps: int, layers: int, heads: int) -> dict[str, float]:
    """The page of ``steps`` steps with attribution and routes: its sizes, then its opening and clicks in Chromium."""
    from playwright.sync_api import sync_playwright

    from attnscope.browser import launch

    record = synthetic_generation(steps, layers=layers, heads=heads, attribution=True, routes=True)
    payload = generation_payload(record)
    path = StepsView(payload).save(folder / "steps_long.html")
    figures = {"page_1024_mb": path.stat().st_size / 1e6,
               "page_1024_attribution_mb": len(to_json(payload["attribution"])) / 1e6,
               "page_1024_routes_mb": len(to_json(payload["routes"])) / 1e6}
    with sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        figures["page_1024_open_ms"] = opened_ms(page, path)
        clicks = [click_ms(page, step) for step in CLICKED if step < steps]
        browser.close()
    figures.update(page_step_click_ms=max(clicks), page_step_click_median_ms=statistics.median(clicks))
    print(f"{steps} steps ({layers} x {heads} heads): " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
          file=sys.stderr)
    return {key: round(value, 2) for key, value in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", type=Path, help="a saved GenerationRecord to measure as well")
    parser.add_argument("--quick", action="store_true", help="64 new tokens; the 1,024-step page in 6 x 3 heads")
    add_smoke_flag(parser)
    args = parser.parse_args()
    figures: dict[str, float | int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for new_tokens in (4,) if args.smoke else (64,) if args.quick else (64, 500):
            size, seconds = page_size(synthetic_generation(new_tokens), Path(folder))
            figures[f"page_mb_{new_tokens}"], figures[f"build_s_{new_tokens}"] = round(size, 2), round(seconds, 1)
            print(f"{new_tokens} new tokens: {size:.2f} MB in {seconds:.1f} s", file=sys.stderr)
        steps, layers, heads = (16, 2, 2) if args.smoke else (1024, 6, 3) if args.quick else (1024, 30, 9)
        figures.update(long_page(Path(folder), steps, layers, heads))
        if args.generation:
            real = GenerationRecord.load(args.generation)
            size, _ = page_size(real, Path(folder))
            figures.update(real_tokens=real.n_steps, real_page_mb=round(size, 2))
    emit("steps_page", figures, keep=not (args.smoke or args.quick))


if __name__ == "__main__":
    main()
