"""Long inputs at bounded memory: SmolLM2 on real text of 512 to 8,192 tokens.

Run from the repository root (``make bench-long``)::

    .venv/bin/python benchmarks/long.py                    # 512, 1024, 2048, 4096, 8192 tokens
    .venv/bin/python benchmarks/long.py --lengths 512,1024  # a quick look

The text is one real long document, the longest shipped State of the Union address
(``attnscope.data.document("sotu-1981-jimmy-carter")``, 33,558 words), cut to each length in
SmolLM2's tokens. For each length, in one process, side by side:

(a) plain   the base model's forward pass under ``torch.inference_mode`` with attnscope's attention
            function outside any capture (it delegates to PyTorch's fused SDPA): nothing is kept;
(b) stats   ``extract(..., plan=CapturePlan(attention=False, statistics=True))``: per-row
            statistics of every layer and head, computed in query chunks of 256;
(c) layer   ``extract(..., plan=CapturePlan(layers=(15,)))``: the full ``[head, q, k]`` attention of
            one layer, in memory (float32);
(d) top32   ``extract_to_file(..., plan=CapturePlan(attention=False, top_k=32), float16=True)``:
            the 32 strongest keys of every row of every layer and head, streamed to disk; its size
            on disk is ``sparse_bytes``.

Peak memory is the process's peak resident set size during each variant alone (``VmHWM`` of
``/proc/self/status``, reset before each variant by writing 5 to ``/proc/self/clear_refs``), so it
includes the model's own weights (about 0.6 GB in float32). ``stats_memory_exponent`` is the slope
of log(peak RSS of (b)) against log(length) over all lengths. Timing is wall clock; each variant runs
once per length after one warm-up of (a) and (b) at the shortest length.
The last line is one JSON object of figures; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json, render.py and long_view.py (page timer)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # long_view.py imports the tests' synthetic data

from bench_json import add_smoke_flag, emit

from attnscope import load_model
from attnscope.capture.extract import extract, extract_to_file
from attnscope.capture.plan import CapturePlan
from attnscope.data import document
from attnscope.memory import peak_mb, reset_peak, rss_mb  # noqa: F401 - rss_mb: imported from here by others

DOCUMENT = "sotu-1981-jimmy-carter"
LENGTHS = (512, 1024, 2048, 4096, 8192)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def measure(run, *args, **kwargs) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(seconds, peak RSS in MB) of ``run(*args, **kwargs)`` alone."""
    reset_peak()
    start = time.perf_counter()
    run(*args, **kwargs)
    return time.perf_counter() - start, peak_mb()


def document_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    return tokenizer(document(DOCUMENT), add_special_tokens=False)["input_ids"]


def view_figures(model, text: str, length: int, folder: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The long view of the longest text as ``attnscope view --file`` makes it, loaded in Chromium:
    ms from navigation to the drawn heatmap (median of 3 fresh loads), the page's size, the keys it kept."""
    import statistics

    from long_view import measure as measure_page
    from playwright.sync_api import sync_playwright
    from render import fresh_loads

    from attnscope.browser import launch
    from attnscope.capture.plan import long_view_plan
    from attnscope.present.longview import long_view_of

    start = time.perf_counter()
    plan = long_view_plan(model, text, None, length, force=True)
    page = long_view_of(extract(model, text, plan=plan, max_length=length))
    path = page.save(folder / "long_view.html")
    build_s = time.perf_counter() - start
    with sync_playwright() as playwright:
        browser = launch(playwright)
        loads = [run["view_load_ms"] for run in fresh_loads(browser, partial(measure_page, tokens=length), path, 3)]
        browser.close()
    return {"view_load_ms_at_max": round(statistics.median(loads), 1), "view_html_mb": round(path.stat().st_size / 1e6, 1),
            "view_capture_and_build_s": round(build_s, 1), "view_top_k_in_page": page.payload["top_k"]["k"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.lengths = "64,128"
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"cpu: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    model = load_model("smollm2")
    ids = document_ids(model.tokenizer)
    texts = {n: model.tokenizer.decode(ids[: n - 1]) for n in lengths}  # the tokenizer adds no BOS here
    middle_layer = 15

    def plain(n: int) -> None:
        encoded = model.tokenizer(texts[n], return_tensors="pt")
        with torch.inference_mode():
            model.model.base_model(**encoded)

    stats_plan = CapturePlan(attention=False, statistics=True)
    extract(model, texts[lengths[0]], plan=stats_plan, max_length=lengths[0])  # warm-up
    plain(lengths[0])
    figures: dict[str, list] = {key: [] for key in ("tokens", "plain_s", "plain_peak_mb", "stats_s", "stats_peak_mb",
                                                      "layer_s", "layer_peak_mb", "sparse_s", "sparse_peak_mb",
                                                      "sparse_bytes")}
    with tempfile.TemporaryDirectory() as folder:
        for n in lengths:
            tokens = len(model.tokenizer(texts[n])["input_ids"])
            plain_s, plain_mb = measure(plain, n)
            stats_s, stats_mb = measure(extract, model, texts[n], plan=stats_plan, max_length=n)
            layer_s, layer_mb = measure(extract, model, texts[n], plan=CapturePlan(layers=(middle_layer,)),
                                        max_length=n)
            path = Path(folder) / f"top32_{n}.safetensors"
            sparse_s, sparse_mb = measure(extract_to_file, model, texts[n], path=path,
                                          plan=CapturePlan(attention=False, top_k=32), float16=True, max_length=n,
                                          progress=False)
            row = {"tokens": tokens, "plain_s": plain_s, "plain_peak_mb": plain_mb, "stats_s": stats_s,
                   "stats_peak_mb": stats_mb, "layer_s": layer_s, "layer_peak_mb": layer_mb, "sparse_s": sparse_s,
                   "sparse_peak_mb": sparse_mb, "sparse_bytes": path.stat().st_size}
            for key, value in row.items():
                figures[key].append(round(value, 2) if isinstance(value, float) else value)
            print(json.dumps({"length": n, **{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}}),
                  flush=True)
            path.unlink()
        view = view_figures(model, texts[lengths[-1]], lengths[-1], Path(folder))
    exponent = float(np.polyfit(np.log(figures["tokens"]), np.log(figures["stats_peak_mb"]), 1)[0])
    summary = {
        "cpu": cpu_name(),
        "document": f"the State of the Union address {DOCUMENT} (shipped)",
        "lengths": figures["tokens"],
        **{key: figures[key] for key in figures if key != "tokens"},
        "stats_over_plain_at_max": round(figures["stats_s"][-1] / figures["plain_s"][-1], 2),
        "stats_memory_exponent": round(exponent, 3),
        **view,
        "targets": {"stats_peak_mb_at_8192": "< 4096", "stats_over_plain_at_max": "<= 2",
                    "stats_memory_exponent": "<= 1.2", "sparse_bytes_at_8192": "< 1e9",
                    "view_load_ms_at_max": "< 2000"},
    }
    emit("long", summary, keep=lengths == list(LENGTHS))


if __name__ == "__main__":
    main()
