"""Generation with capture against plain generation and the naive way, SmolLM2, greedy.

Run from the repository root::

    .venv/bin/python benchmarks/generate.py            # 256 new tokens after a 64-token prompt
    .venv/bin/python benchmarks/generate.py --quick    # 64 new tokens (about 3 minutes here)

The prompt is the first 64 tokens of the shipped Brown sample joined into one text. In one
process, side by side, each variant generating the same number of new tokens:

(a) plain    transformers' ``model.generate`` (key/value cache) on the model attnscope loaded,
             outside any capture: attnscope's attention function delegates to PyTorch's fused SDPA;
(b) capture  ``attnscope.generate``: every step's attention row of every layer and head, the top-10
             candidates and the value norms (the defaults), with the cache on;
(c) naive    after every step, a full forward pass of the text so far with transformers' eager
             implementation and ``output_attentions=True`` (no cache), the way one gets every
             step's attention without attnscope; its next token is the argmax, as greedy decoding.

``rows_max_abs_err``: the largest difference between (b)'s rows and the rows of (c)'s last forward
pass (every position but the last, which (c) never feeds back). ``peak_mb_capture``: the process's
peak resident set size during (b) alone (VmHWM, reset before it), model weights included.

Thread policy, measured rather than assumed: (a) and (b) run at one thread and at torch's default
(every core), each pair interleaved ``--repeats`` times after a short warm-up, each variant's best
run counting. ``by_threads`` holds both; the top-level ``plain_tok_s``, ``capture_tok_s`` and
``capture_overhead`` are at the policy the CLI uses for generation here (one thread on a machine of
two cores or fewer, ``threads``), and ``capture_overhead_worst_policy`` is the larger of the two.
(c) runs once, at torch's default. The first line names the CPU with the vector instructions torch
uses on it; the last line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_smoke_flag, cpu_name, emit
from long import document_ids, peak_mb, reset_peak

import attnscope
from attnscope.cli import ONE_STREAM_MAX_CORES
from attnscope.records.generation import row_offset

PROMPT_TOKENS = 64


def plain_generate(loaded, ids: list[int], new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    temperature=None, top_k=None, top_p=None, use_cache=True,
                                    pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0].tolist()


def naive_generate(loaded, ids: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:  # type: ignore[no-untyped-def]
    """Greedy decoding by full eager forward passes with output_attentions=True; the last pass's
    attention ``[layer, head, q_pos, k_pos]``."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    sequence = list(ids)
    try:
        with torch.inference_mode():
            for _ in range(new_tokens):
                out = model(input_ids=torch.tensor([sequence]), output_attentions=True, use_cache=False)
                sequence.append(int(out.logits[0, -1].argmax()))
    finally:
        model.set_attn_implementation(previous)
    return sequence, torch.stack([layer[0] for layer in out.attentions]).float().numpy()


def rows_error(record: attnscope.GenerationRecord, naive_attention: np.ndarray) -> float:
    """Largest |capture row - naive row| over every position the naive pass computed."""
    n = naive_attention.shape[-1]
    queries, keys = np.tril_indices(n)
    return float(np.abs(record.arrays["rows"][:, :, : row_offset(n)] - naive_attention[:, :, queries, keys]).max())


def timed(run, *args, **kwargs):  # type: ignore[no-untyped-def]
    reset_peak()
    start = time.perf_counter()
    result = run(*args, **kwargs)
    return result, time.perf_counter() - start, peak_mb()


def thread_policies() -> list[int]:
    """The thread counts measured side by side: one (attnscope's choice for generation on a machine of two cores or
    fewer, ``attnscope.cli.ONE_STREAM_MAX_CORES``) and torch's default (every core)."""
    return sorted({1, torch.get_num_threads()})


def side_by_side(loaded, prompt: str, ids: list[int], new_tokens: int, threads: int, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    """Plain and capture at ``threads``, interleaved ``repeats`` times (a burst of load hits both alike), each
    variant's best run counting: their seconds, the last capture record, plain's tokens and capture's peak MB."""
    torch.set_num_threads(threads)
    best = {"plain": float("inf"), "capture": float("inf")}
    peak = 0.0
    for _ in range(repeats):
        record, seconds, capture_mb = timed(attnscope.generate, loaded, prompt, max_new_tokens=new_tokens)
        best["capture"], peak = min(best["capture"], seconds), max(peak, capture_mb)
        plain, seconds, _ = timed(plain_generate, loaded, ids, record.n_steps)
        best["plain"] = min(best["plain"], seconds)
        print(f"{threads} thread(s): capture {record.n_steps / best['capture']:.2f} tok/s, "
              f"plain {record.n_steps / best['plain']:.2f} tok/s (best so far)", flush=True)
    return {"seconds": best, "record": record, "plain": plain, "peak_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 new tokens instead of 256")
    parser.add_argument("--new-tokens", type=int, help="new tokens (overrides --quick)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of plain and capture per thread "
                        "count; each variant's best counts (default 2)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    new_tokens = 4 if args.smoke else args.new_tokens or (64 if args.quick else 256)
    repeats = 1 if args.smoke else args.repeats
    if new_tokens < 1 or repeats < 1:
        parser.error("--new-tokens and --repeats must be at least 1")
    default_threads = torch.get_num_threads()
    print(f"cpu: {cpu_name()}; torch {torch.__version__}, thread counts measured: {thread_policies()}", flush=True)
    loaded = attnscope.load_model("smollm2")
    ids = document_ids(loaded.tokenizer)[:PROMPT_TOKENS]
    prompt = loaded.tokenizer.decode(ids)
    ids = loaded.tokenizer(prompt)["input_ids"]  # what attnscope.generate will feed
    attnscope.generate(loaded, prompt, max_new_tokens=4)  # warm-up
    plain_generate(loaded, ids, 4)

    runs = {threads: side_by_side(loaded, prompt, ids, new_tokens, threads, repeats) for threads in thread_policies()}
    torch.set_num_threads(default_threads)
    cli_threads = 1 if (os.cpu_count() or 1) <= ONE_STREAM_MAX_CORES else default_threads  # the CLI's choice here
    chosen = runs[cli_threads]
    record, produced = chosen["record"], chosen["record"].n_steps
    (naive, naive_attention), naive_s, _ = timed(naive_generate, loaded, ids, produced)
    print(f"naive ({default_threads} threads): {naive_s:.1f} s", flush=True)
    same = all(run["plain"] == naive == run["record"].token_ids.tolist() for run in runs.values())
    per_policy = {str(threads): {"plain_tok_s": round(produced / run["seconds"]["plain"], 2),
                                 "capture_tok_s": round(produced / run["seconds"]["capture"], 2),
                                 "capture_overhead": round(run["seconds"]["capture"] / run["seconds"]["plain"], 3)}
                  for threads, run in runs.items()}
    plain_s, capture_s = chosen["seconds"]["plain"], chosen["seconds"]["capture"]
    figures = {
        "new_tokens": produced,
        "prompt_tokens": len(ids),
        "threads": cli_threads,
        "plain_tok_s": round(produced / plain_s, 2),
        "capture_tok_s": round(produced / capture_s, 2),
        "naive_tok_s": round(produced / naive_s, 2),
        "capture_overhead": round(capture_s / plain_s, 3),
        "capture_overhead_worst_policy": max(policy["capture_overhead"] for policy in per_policy.values()),
        "by_threads": per_policy,
        "speedup_vs_naive": round(naive_s / capture_s, 2),
        "plain_speedup_vs_naive": round(naive_s / plain_s, 2),
        "peak_mb_capture": round(max(run["peak_mb"] for run in runs.values())),
        "rows_max_abs_err": float(f"{rows_error(record, naive_attention):.2e}"),
        "same_tokens": same,
        "repeats": repeats,
        "cpu": cpu_name(),
    }
    emit("generate", figures, keep=not (args.quick or args.smoke) and args.new_tokens is None)


if __name__ == "__main__":
    main()
