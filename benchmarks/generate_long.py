"""Generation with capture after a long prompt, up to SmolLM2's whole context window, on a laptop.

Run from the repository root::

    .venv/bin/python benchmarks/generate_long.py                    # prompts of 4,096 and 8,176 tokens
    .venv/bin/python benchmarks/generate_long.py --lengths 1024     # a quick look
    .venv/bin/python benchmarks/generate_long.py --model gemma3      # Gemma 3 after a 16,384-token prompt

The prompt is the longest shipped State of the Union address
(``attnscope.data.document("sotu-1981-jimmy-carter")``), cut to each length in SmolLM2's tokens;
8,176 + 16 new tokens fill the 8,192-token window. For each length, in one process, side by side, greedy, the same 16 new tokens:

(a) plain    transformers' ``model.generate`` (key/value cache) outside any capture: attnscope's
             attention function delegates to PyTorch's fused SDPA; nothing is kept;
(b) capture  ``attnscope.generate(..., prompt_rows=False)``: every step's attention row of every layer
             and head (from the prompt's last position on), the top-10 candidates and the value norms;
             the prompt runs fused (SDPA) but for its last row, whose probabilities are computed alone;
(c) check    a teacher-forced, chunked capture of the final text (``CapturePlan`` of the last rows,
             256 queries at a time, no cache): ``rows_max_abs_err`` is its largest difference from
             (b)'s rows.

``peak_mb_*`` is the process's peak resident set size during that variant alone (``VmHWM``, reset
before it), model weights included. ``tok_s`` counts the new tokens over the whole call, the prompt's
forward pass included (it dominates at these lengths). ``estimate_gib`` is what ``check_generation``
now expects (b) to need besides the model; ``old_estimate_gib`` what it expected before prompt rows
could be dropped (every position's row kept, and every layer's prompt block, so it refused);
``keep_all_estimate_gib`` the estimate today with ``prompt_rows=True``.

The long generation (issue 47), in the same run (``--only trace`` alone): SmolLM2 writes 1,024 tokens greedily after
512 tokens of the same address, side by side: ``attnscope.generate`` keeping every row (``rows``), with
``StepAttribution`` (``attribute``: direct logit attribution, ``--attribute``), with ``StepAttribution(lens=True)``
(``lens``: and the logit lens, ``--lens``) and with ``StepRoutes`` (``routes``), then plain ``model.generate``. For
each: ``trace_s_per_token`` (the whole call over its tokens; ``capture_over_plain``, ``attribute_over_plain``,
``lens_over_plain``, ``routes_over_plain``: ratios to plain), ``trace_peak_mb`` (VmHWM reset before it), ``trace_start_mb`` (RSS just before,
garbage collected and heap trimmed: the model's weights and what the process held, the model's share),
``trace_record_mb`` (the ``nbytes`` of the record's arrays), ``peak_rss_over_model_and_record`` = peak / (start +
record), ``trace_estimate_mb`` (``check_generation``'s estimate above the start), ``trace_same_tokens`` (as plain) and
``trace_rows_max_abs_err`` (kept rows of a few positions against a teacher-forced capture). ``--model qwen1.5b`` runs
Qwen2.5 1.5B (in bfloat16, as on a laptop) for 2,048 tokens with ``attribute`` only (``qwen1.5b_trace_2048_peak_mb``).
``--quick``: prompts of 1,024 tokens and 64 tokens after 128.
The last line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_smoke_flag, cpu_name, emit
from generate import plain_generate
from long import peak_mb, reset_peak, rss_mb

import attnscope
from attnscope.attribution import StepAttribution, StepRoutes
from attnscope.capture.attention import capture
from attnscope.capture.extract import n_config_heads, n_main_layers
from attnscope.capture.generate import GenerationRecorder, generation_estimate, generation_memory
from attnscope.capture.plan import CapturePlan, QuerySelection
from attnscope.capture.rows import BatchFacts
from attnscope.data import document
from attnscope.records.generation import packed_length

NEW_TOKENS = 16
LENGTHS = {"smollm2": (4096, 8192 - NEW_TOKENS), "gemma3": (16384,)}  # each model's default prompt lengths
GIB = 2**30


def prompt_of(tokenizer, length: int) -> tuple[str, list[int]]:  # type: ignore[no-untyped-def]
    """The longest shipped address cut to ``length`` tokens, as text, and its ids as ``attnscope.generate`` feeds
    them."""
    ids = tokenizer(document("sotu-1981-jimmy-carter"), add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids[:length])
    fed = tokenizer(text)["input_ids"]
    while len(fed) > length:  # decoding and encoding again can merge differently: trim to fit the window
        text = tokenizer.decode(fed[: length - (len(fed) - length)])
        fed = tokenizer(text)["input_ids"]
    return text, fed


def old_estimate(n_layers: int, n_heads: int, n_prompt: int, new_tokens: int) -> int:
    """Bytes ``check_generation`` expected before ``first_row``: every position's row twice, and every
    layer's ``[head, P, P]`` prompt block three times over."""
    kept = n_layers * n_heads * packed_length(n_prompt + new_tokens) * 4 * 2
    working = n_layers * n_heads * n_prompt * n_prompt * 4 * 3
    return kept + working


def teacher_forced_rows(loaded, token_ids: list[int], queries: QuerySelection) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The rows of the final text's ``queries``, ``[layer, head, query, T]``, from a chunked capture (no cache)."""
    plan = CapturePlan(queries=queries)
    length = len(token_ids)
    facts = BatchFacts([length], torch.zeros((1, length), dtype=torch.bool), [plan.queries.positions(length)])
    with torch.inference_mode(), capture(loaded.sites, plan=plan, facts=facts) as session:
        loaded.model(input_ids=torch.tensor([token_ids]), use_cache=False, logits_to_keep=1)
    return np.stack([layer.attention[0].cpu().numpy() for layer in session.layers("self")])


def rows_error(record: attnscope.GenerationRecord, reference: np.ndarray) -> float:
    """Largest |generation row - teacher-forced row| over the rows the record kept."""
    first = record.first_row
    return max(float(np.abs(record.row(position) - reference[:, :, position - first, : position + 1]).max())
               for position in range(first, len(record.tokens)))


def timed(run, *args, **kwargs):  # type: ignore[no-untyped-def]
    reset_peak()
    start = time.perf_counter()
    result = run(*args, **kwargs)
    return result, time.perf_counter() - start, peak_mb()


def measure(loaded, length: int) -> dict[str, float | int | bool]:  # type: ignore[no-untyped-def]
    prompt, ids = prompt_of(loaded.tokenizer, length)
    layers, heads = n_main_layers(loaded), n_config_heads(loaded)
    record, capture_s, capture_mb = timed(attnscope.generate, loaded, prompt, max_new_tokens=NEW_TOKENS,
                                          prompt_rows=False, progress=True)
    produced = record.n_steps
    print(f"{len(ids)} prompt tokens: capture {capture_s:.1f} s, peak {capture_mb:.0f} MB", flush=True)
    plain, plain_s, plain_mb = timed(plain_generate, loaded, ids, produced)
    print(f"{len(ids)} prompt tokens: plain {plain_s:.1f} s, peak {plain_mb:.0f} MB", flush=True)
    reference = teacher_forced_rows(loaded, record.token_ids.tolist(),
                                    QuerySelection("last", n=len(record.tokens) - record.first_row))
    return {
        "prompt_tokens": len(ids), "new_tokens": produced, "first_row": record.first_row,
        "capture_s": round(capture_s, 1), "capture_tok_s": round(produced / capture_s, 3),
        "plain_s": round(plain_s, 1), "plain_tok_s": round(produced / plain_s, 3),
        "capture_overhead": round(capture_s / plain_s, 2),
        "peak_mb_capture": round(capture_mb), "peak_mb_plain": round(plain_mb),
        "rows_max_abs_err": float(f"{rows_error(record, reference):.2e}"),
        "same_tokens": plain == record.token_ids.tolist(),
        "estimate_gib": round(generation_memory(layers, heads, len(ids), NEW_TOKENS,
                                                first_row=record.first_row).total / GIB, 2),
        "keep_all_estimate_gib": round(generation_memory(layers, heads, len(ids), NEW_TOKENS).total / GIB, 1),
        "old_estimate_gib": round(old_estimate(layers, heads, len(ids), NEW_TOKENS) / GIB, 1),
    }


# The long generation (issue 47): each model's prompt tokens and new tokens, and the recorders' variants it runs
TRACE = {"smollm2": (512, 1024), "qwen1.5b": (512, 2048)}
TRACE_QUICK, TRACE_SMOKE = (128, 64), (32, 4)
TRACE_VARIANTS = {"smollm2": ("rows", "attribute", "lens", "routes"), "qwen1.5b": ("attribute",)}
# Qwen2.5 1.5B in bfloat16, as a laptop runs it: its float32 weights (6 GB) beside 2,048 steps' rows (4.4 GB) leave
# no room under the 12 GB target (session 21, float32, 2 cores: peak 14,194 MB from 7,318 MB before the call)
DTYPES = {"qwen1.5b": "bfloat16"}
CHECKED_ROWS = 8  # positions, spread over the text, whose rows are compared with a teacher-forced capture


def recorders_of(variant: str) -> tuple[GenerationRecorder, ...]:
    """What ``attnscope.generate`` records beside its rows in ``variant`` (rows: nothing more)."""
    return {"rows": (), "attribute": (StepAttribution(),), "lens": (StepAttribution(lens=True),),
            "routes": (StepRoutes(),)}[variant]


def settled_rss_mb() -> float:
    """RSS once the garbage is collected and the heap's free pages handed back: what the process holds."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # no glibc: RSS as it is
        pass
    return rss_mb()


def record_mb(record: attnscope.GenerationRecord) -> float:
    """The record's own bytes: its arrays' ``nbytes`` (rows, candidates, and what the recorders added)."""
    return sum(array.nbytes for array in record.arrays.values()) / 2**20


def checked_positions(first_row: int, n_tokens: int) -> list[int]:
    """``CHECKED_ROWS`` positions from ``first_row`` to the last, evenly spread (the first step's row among them)."""
    return sorted({int(p) for p in np.linspace(first_row, n_tokens - 1, CHECKED_ROWS).round()})


def trace_variant(loaded, prompt: str, new_tokens: int, variant: str) -> tuple[dict, attnscope.GenerationRecord]:  # type: ignore[no-untyped-def]
    """One recorder variant's figures (the record's rows checked later), and its record."""
    recorders = recorders_of(variant)
    start = settled_rss_mb()
    record, seconds, peak = timed(attnscope.generate, loaded, prompt, max_new_tokens=new_tokens, recorders=recorders,
                                  progress=True)
    n_prompt = record.prompt_length
    estimate = generation_estimate(loaded, n_prompt, new_tokens, first_row=record.first_row, recorders=recorders)
    kept = record_mb(record)
    print(f"{variant}: {record.n_steps} tokens in {seconds:.1f} s, peak {peak:.0f} MB from {start:.0f} MB, "
          f"record {kept:.0f} MB, estimate {estimate.total / 2**20:.0f} MB", flush=True)
    return {"s": seconds / record.n_steps, "peak_mb": peak, "start_mb": start, "record_mb": kept,
            "over_model_and_record": peak / (start + kept), "estimate_mb": estimate.total / 2**20}, record


def trace(loaded, model: str, prompt_tokens: int, new_tokens: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Plain generation and each recorder variant of ``TRACE_VARIANTS`` over the same text, side by side; the kept rows
    of a few positions compared with a teacher-forced capture of the final text."""
    prompt, ids = prompt_of(loaded.tokenizer, prompt_tokens)
    variants, rows, tokens = {}, {}, {}
    for variant in TRACE_VARIANTS[model]:
        variants[variant], record = trace_variant(loaded, prompt, new_tokens, variant)
        tokens[variant] = record.token_ids.tolist()
        positions = checked_positions(record.first_row, len(record.tokens))
        rows[variant] = {position: record.row(position).copy() for position in positions}
        del record
    produced = len(next(iter(tokens.values()))) - len(ids)
    start = settled_rss_mb()
    plain, plain_s, plain_peak = timed(plain_generate, loaded, ids, produced)
    print(f"plain: {produced} tokens in {plain_s:.1f} s, peak {plain_peak:.0f} MB from {start:.0f} MB", flush=True)
    variants["plain"] = {"s": plain_s / produced, "peak_mb": plain_peak, "start_mb": start}
    errors = {variant: rows_of_variant_error(loaded, tokens[variant], kept) for variant, kept in rows.items()}
    per_variant = {name: {variant: round(figures[name], 4 if name == "s" else 2)
                          for variant, figures in variants.items() if name in figures}
                   for name in ("s", "peak_mb", "start_mb", "record_mb", "over_model_and_record", "estimate_mb")}
    recorded = TRACE_VARIANTS[model]
    over_plain = {f"{'capture' if v == 'rows' else v}_over_plain": round(variants[v]["s"] / variants["plain"]["s"], 2)
                  for v in recorded}
    return {
        "trace_prompt_tokens": len(ids), "trace_new_tokens": produced,
        "trace_s_per_token": per_variant["s"], **over_plain,
        "trace_peak_mb": per_variant["peak_mb"], "trace_start_mb": per_variant["start_mb"],
        "trace_record_mb": per_variant["record_mb"], "trace_estimate_mb": per_variant["estimate_mb"],
        "peak_rss_over_model_and_record": per_variant["over_model_and_record"],
        f"{model}_trace_{produced}_peak_mb": round(max(variants[v]["peak_mb"] for v in recorded)),
        "trace_same_tokens": {variant: kept == plain for variant, kept in tokens.items()},
        "trace_rows_max_abs_err": {variant: float(f"{error:.2e}") for variant, error in errors.items()},
        "weights_mb": round(sum(p.nbytes for p in loaded.model.parameters()) / 2**20),
        "attribute_has_lens": False,  # runs before --lens existed kept the lens in `attribute` (and lack this key)
    }


def rows_of_variant_error(loaded, token_ids: list[int], kept: dict[int, np.ndarray]) -> float:  # type: ignore[no-untyped-def]
    """Largest |kept row - teacher-forced row| over ``kept`` (position -> ``[layer, head, position + 1]``)."""
    positions = sorted(kept)
    reference = teacher_forced_rows(loaded, token_ids, QuerySelection("list", given=tuple(positions)))
    return max(float(np.abs(kept[p] - reference[:, :, i, : p + 1]).max()) for i, p in enumerate(positions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = sorted({*LENGTHS, *TRACE})
    parser.add_argument("--model", choices=models, default="smollm2", help="the decoder (default: smollm2)")
    parser.add_argument("--lengths", help="prompt lengths in tokens (default: the model's, "
                        + "; ".join(f"{m}: {','.join(map(str, n))}" for m, n in LENGTHS.items()) + ")")
    parser.add_argument("--only", choices=("prompts", "trace"), help="run only the long prompts or only the long "
                        "generation (default: each the model has)")
    parser.add_argument("--quick", action="store_true", help=f"a quick check: prompts of 1,024 tokens, and the long "
                        f"generation at {TRACE_QUICK[1]} tokens after {TRACE_QUICK[0]}")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 while another process "
                        "holds a core, where two threads wait on each other)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke or args.quick:
        args.lengths = "64" if args.smoke else "1024"
    lengths = ([int(n) for n in args.lengths.split(",")] if args.lengths else list(LENGTHS.get(args.model, ())))
    lengths = [] if args.only == "trace" else lengths
    traced = args.model in TRACE and args.only != "prompts"
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    dtype = DTYPES.get(args.model, "float32")
    loaded = attnscope.load_model(args.model, dtype=dtype)
    attnscope.generate(loaded, "The sea is", max_new_tokens=4)  # warm-up
    plain_generate(loaded, loaded.tokenizer("The sea is")["input_ids"], 4)
    rows = [measure(loaded, length) for length in lengths]
    figures: dict[str, object] = {name: [row[name] for row in rows] for name in rows[0]} if rows else {}
    if traced:
        size = TRACE_SMOKE if args.smoke else TRACE_QUICK if args.quick else TRACE[args.model]
        figures.update(trace(loaded, args.model, *size))
    figures = {**figures, "threads": torch.get_num_threads(), "cpu": cpu_name(),
               "model": args.model, "dtype": dtype,
               "document": "the State of the Union address sotu-1981-jimmy-carter (shipped)"}
    name = "generate_long" if args.model == "smollm2" else f"generate_long_{args.model}"
    full = lengths == list(LENGTHS.get(args.model, ())) and not args.quick and args.only is None
    emit(name, figures, keep=full)


if __name__ == "__main__":
    main()
