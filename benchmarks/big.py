"""Bigger models and whole context windows: statistics capture against the plain forward pass.

Run from the repository root (``make bench-big``; the full run takes tens of minutes on 2 cores)::

    .venv/bin/python benchmarks/big.py            # every model of MODELS at its lengths
    .venv/bin/python benchmarks/big.py --quick    # Qwen2.5 0.5B at 1,024 and 2,048 tokens (minutes)
    .venv/bin/python benchmarks/big.py --smoke    # SmolLM2 at 64 and 128 tokens (seconds; figures mean nothing)

The text is the longest shipped State of the Union address (``sotu-1981-jimmy-carter``, about 42,000
tokens), cut to each length in the model's tokens. Models are loaded one at a time (never two at
once) in the dtype of :data:`MODELS` (the Qwens in bfloat16 only where this CPU multiplies faster in
it). For each model and length, in one process, side by side:

(a) plain   the base model's forward pass under ``torch.inference_mode`` with attnscope's attention
            function outside any capture (PyTorch's fused SDPA): nothing is kept; up to ``plain_max``
            tokens (Gemma 3's plain pass at 32,768 tokens builds an additive mask of 4 GiB per mask type
            and computes every key of its sliding layers: tens of minutes on 2 cores; Qwen 1.5B's at 8,192
            would add minutes to a run whose figure at that length is the statistics' peak memory);
(b) stats   ``extract(..., plan=CapturePlan(attention=False, statistics=True))``: per-row statistics
            of every layer and head, in query chunks;
(c) layer   ``extract(..., plan=CapturePlan(layers=(middle,)))``: one layer's full ``[head, q, k]``
            matrix (float32), at the lengths where it fits (``layer_max_tokens``; None above).

Peak memory is the process's peak resident set size during each variant alone (``VmHWM``, reset
before each variant as in ``benchmarks/long.py``), so it includes the weights; ``weights_mb`` is the
resident size right after loading. ``stats_memory_exponent`` is the slope of log(stats peak minus
weights) against log(length): the memory a capture adds must grow at most linearly. Timing is wall
clock, each variant once per length after one warm-up of (a) and (b) at the shortest length. The last
line is one JSON object of figures; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json, long (peak RSS)

from bench_json import add_smoke_flag, cpu_name, emit
from long import measure

from attnscope import load_model
from attnscope.capture.extract import extract
from attnscope.capture.plan import CapturePlan
from attnscope.data import document

DOCUMENT = "sotu-1981-jimmy-carter"
# model: (dtype, lengths, longest length of the plain pass, longest length at which one layer's full matrix is
# also captured); "auto": bfloat16 where this CPU multiplies in bfloat16 at least as fast as in float32, else
# float32 (see gemm_bf16_over_fp32). The lengths keep the full run within about 40 minutes on 2 cores.
MODELS: dict[str, tuple[str, tuple[int, ...], int, int]] = {
    "smollm2": ("float32", (1024, 2048, 4096, 8192), 8192, 8192),
    "gemma3": ("float32", (2048, 8192, 32768), 8192, 8192),
    "qwen0.5b": ("auto", (1024, 2048, 4096, 8192), 8192, 4096),
    "qwen1.5b": ("auto", (1024, 8192), 1024, 1024),  # its plain pass at 8,192 would add minutes; the peak is the target
}
QUICK = {"qwen0.5b": ("auto", (1024, 2048), 2048, 2048)}
SMOKE = {"smollm2": ("float32", (64, 128), 128, 128)}
TARGETS = {"stats_over_plain": "<= 1.3 at every length", "stats_memory_exponent": "<= 1.1",
           "gemma3_32k_stats_peak_mb": "<= 8192", "qwen1_5b_8k_stats_peak_mb": "<= 12288"}


def resident_mb() -> float:
    """The process's resident set size now (VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def resident_after_trim() -> float:
    """The resident size once loading's garbage is collected and glibc has returned its free pages to the system
    (``malloc_trim``): the weights, without the converted copies a load leaves behind (over a GB for the Qwens),
    which later variants would reuse and so hide the memory they add."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_mb()


def gemm_bf16_over_fp32() -> float:
    """How many times faster this CPU multiplies a Qwen 0.5B MLP shape in bfloat16 than in float32 (PyTorch's
    default GEMM, best of 3): about 2 with AVX-512 bf16 dot products, 0.03 on an AVX2-only AMD EPYC here,
    where bfloat16 halves the memory but multiplies some thirty times slower."""
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 896, dtype=dtype), torch.randn(896, 4864, dtype=dtype)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            runs.append(time.perf_counter() - start)
        seconds[dtype] = min(runs)
    return seconds[torch.float32] / seconds[torch.bfloat16]


def texts_of(model, lengths: tuple[int, ...]) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """The document cut to each length in ``model``'s tokens (the tokenizer's own specials included)."""
    ids = model.tokenizer(document(DOCUMENT), add_special_tokens=False)["input_ids"]
    if len(ids) < max(lengths):
        raise SystemExit(f"{DOCUMENT} has {len(ids):,} tokens of {model.name}, fewer than {max(lengths):,}")
    specials = len(model.tokenizer("")["input_ids"])
    return {n: model.tokenizer.decode(ids[: n - specials]) for n in lengths}


def run_model(name: str, dtype: str, lengths: tuple[int, ...], plain_max: int, layer_max: int) -> dict[str, list]:
    """Figures of one model at each length: (a), (b) and (c) side by side (the model is freed on return)."""
    start = time.perf_counter()
    model = load_model(name, dtype=dtype)
    load_s = time.perf_counter() - start
    weights = resident_after_trim()
    texts = texts_of(model, lengths)
    middle = model.config.num_hidden_layers // 2
    stats_plan = CapturePlan(attention=False, statistics=True)

    def plain(n: int) -> None:
        encoded = model.tokenizer(texts[n], return_tensors="pt")
        with torch.inference_mode():
            model.model.base_model(**encoded)

    plain(lengths[0])  # warm-up
    extract(model, texts[lengths[0]], plan=stats_plan, max_length=lengths[0])
    rows: dict[str, list] = {key: [] for key in ("tokens", "plain_s", "plain_peak_mb", "stats_s", "stats_peak_mb",
                                                 "stats_over_plain", "layer_s", "layer_peak_mb")}
    for n in lengths:
        tokens = len(model.tokenizer(texts[n])["input_ids"])
        plain_s, plain_mb = measure(plain, n) if n <= plain_max else (None, None)
        stats_s, stats_mb = measure(extract, model, texts[n], plan=stats_plan, max_length=n)
        layer_s, layer_mb = (measure(extract, model, texts[n], plan=CapturePlan(layers=(middle,)), max_length=n)
                             if n <= layer_max else (None, None))
        row = {"tokens": tokens, "plain_s": plain_s, "plain_peak_mb": plain_mb, "stats_s": stats_s,
               "stats_peak_mb": stats_mb, "stats_over_plain": None if plain_s is None else stats_s / plain_s,
               "layer_s": layer_s,
               "layer_peak_mb": layer_mb}
        for key, value in row.items():
            rows[key].append(round(value, 2) if isinstance(value, float) else value)
        print(json.dumps({"model": name, "length": n, **{k: rows[k][-1] for k in rows}}), flush=True)
    extra = np.array(rows["stats_peak_mb"]) - weights
    exponent = float(np.polyfit(np.log(rows["tokens"]), np.log(np.maximum(extra, 1.0)), 1)[0])
    return {**rows, "dtype": dtype, "load_s": round(load_s, 1), "weights_mb": round(weights, 1),
            "stats_memory_exponent": round(exponent, 3)}


def at(figures: dict[str, dict], name: str, tokens: int) -> float | None:
    """``name``'s stats peak at ``tokens`` (None when that model or length was not run)."""
    found = figures.get(name)
    if not found or tokens not in found["requested_lengths"]:
        return None
    return found["stats_peak_mb"][found["requested_lengths"].index(tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Qwen2.5 0.5B at 1,024 and 2,048 tokens (minutes)")
    parser.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)}")
    add_smoke_flag(parser)
    args = parser.parse_args()
    table = SMOKE if args.smoke else QUICK if args.quick else MODELS
    if args.models:
        unknown = sorted(set(args.models.split(",")) - set(MODELS))
        if unknown:
            raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
        table = {name: MODELS[name] for name in args.models.split(",")}
    print(f"cpu: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    started = time.perf_counter()
    ratio = gemm_bf16_over_fp32()
    print(f"bfloat16 GEMM {ratio:.2f}x float32 on this CPU", flush=True)
    figures = {}
    for name, (dtype, lengths, plain_max, layer_max) in table.items():
        dtype = dtype if dtype != "auto" else "bfloat16" if ratio >= 1 else "float32"
        rows = run_model(name, dtype, lengths, plain_max, layer_max)
        gc.collect()  # the model went with run_model's frame: never two models at once
        figures[name] = {"lengths": rows.pop("tokens"), "requested_lengths": list(lengths), **rows}
    peak = max(max(rows["stats_peak_mb"]) for rows in figures.values())
    summary = {
        "cpu": cpu_name(),
        "document": DOCUMENT,
        "models": list(figures),
        "lengths": {name: rows["requested_lengths"] for name, rows in figures.items()},
        **{key: {name: rows[key] for name, rows in figures.items()}
           for key in ("plain_s", "stats_s", "stats_over_plain", "plain_peak_mb", "stats_peak_mb", "layer_s",
                       "layer_peak_mb", "stats_memory_exponent", "weights_mb", "load_s", "dtype")},
        "gemm_bf16_over_fp32": round(ratio, 3),
        "stats_over_plain_max": max(max(r for r in rows["stats_over_plain"] if r is not None)
                                    for rows in figures.values()),
        "stats_peak_mb_max": peak,
        "gemma3_32k_stats_peak_mb": at(figures, "gemma3", 32768),
        "qwen1_5b_8k_stats_peak_mb": at(figures, "qwen1.5b", 8192),
        "total_s": round(time.perf_counter() - started, 1),
        "targets": TARGETS,
    }
    emit("big", summary, keep=not (args.quick or args.models))  # only the full run is kept for the README


if __name__ == "__main__":
    main()
