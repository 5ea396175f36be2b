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
The last line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_smoke_flag, cpu_name, emit
from generate import plain_generate
from long import peak_mb, reset_peak

import attnscope
from attnscope.capture.attention import capture
from attnscope.capture.extract import n_config_heads, n_main_layers
from attnscope.capture.generate import generation_memory
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


def teacher_forced_rows(loaded, token_ids: list[int], n_rows: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The last ``n_rows`` rows of the final text, ``[layer, head, n_rows, T]``, from a chunked capture (no cache)."""
    plan = CapturePlan(queries=QuerySelection("last", n=n_rows))
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
    reference = teacher_forced_rows(loaded, record.token_ids.tolist(), len(record.tokens) - record.first_row)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(LENGTHS), default="smollm2", help="the decoder (default: smollm2)")
    parser.add_argument("--lengths", help="prompt lengths in tokens (default: the model's, "
                        + "; ".join(f"{m}: {','.join(map(str, n))}" for m, n in LENGTHS.items()) + ")")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 while another process "
                        "holds a core, where two threads wait on each other)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.lengths = "64"
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else list(LENGTHS[args.model])
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    loaded = attnscope.load_model(args.model)
    attnscope.generate(loaded, "The sea is", max_new_tokens=4)  # warm-up
    plain_generate(loaded, loaded.tokenizer("The sea is")["input_ids"], 4)
    rows = [measure(loaded, length) for length in lengths]
    figures = {name: [row[name] for row in rows] for name in rows[0]}
    figures = {**figures, "threads": torch.get_num_threads(), "cpu": cpu_name(),
               "model": args.model, "document": "the State of the Union address sotu-1981-jimmy-carter (shipped)"}
    name = "generate_long" if args.model == "smollm2" else f"generate_long_{args.model}"
    emit(name, figures, keep=lengths == list(LENGTHS[args.model]))


if __name__ == "__main__":
    main()
