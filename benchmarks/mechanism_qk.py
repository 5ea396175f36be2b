"""QK attribution (issue 40, part 3): exactness and cost.

Run from the repository root, alone (it times)::

    .venv/bin/python benchmarks/mechanism_qk.py            # SmolLM2, Gemma 3 and Qwen 0.5B; 256-token timing
    .venv/bin/python benchmarks/mechanism_qk.py --quick    # SmolLM2 only; 128-token timing, fewer repeats
    .venv/bin/python benchmarks/mechanism_qk.py --smoke    # a tiny random Llama, seconds

Figures (the last line printed is one JSON object; :func:`qk_figures` returns them for
``benchmarks/mechanism.py``):

* ``qk_sum_max_abs_err``: the largest |sum of a table − what it splits| over several layers, heads and keys of
  each model: the score table against the model's pre-softmax score, and the centred table plus the row term
  against the model's log attention. Target <= 1e-4. ``qk_sum_err_by_model`` gives each model's.
* ``qk_over_capture``: one score's full table (``qk_attribution`` of the last layer's head 0, the last query of a
  ``qk_tokens``-token text) over one forward pass with attnscope's capture of every head (``capture(sites)``);
  best of ``repeats`` runs each, interleaved. Target <= 3. ``qk_over_forward``: over a plain forward pass
  without capture, for scale.

Layers and heads are 0-indexed. The machine may be shared: the JSON gives the load average and the other
processes' share of the cpus.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attribution import best_times, tiny_model
from bench_json import add_smoke_flag, cpu_name, emit
from extract import CpuWatch

import attnscope
from attnscope.attribution.qk import qk_attribution
from attnscope.capture.attention import capture
from attnscope.data import brown_sentences

FULL_MODELS = ("smollm2", "gemma3", "qwen0.5b")
SUM_TEXT = "The cat sat on the mat and looked at the dog. Then the cat sat on the"


def sum_error(loaded: Any, text: str) -> float:
    """The largest table-sum error over the first, a middle and the last layer, the first and last head, and two
    keys of the last query."""
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    n_layers = len([s for s in loaded.sites.values() if s.kind == "self"])
    n_heads = int(loaded.config.num_attention_heads)
    query, worst = len(ids) - 1, 0.0
    for layer in sorted({0, n_layers // 2, n_layers - 1}):
        for head in sorted({0, n_heads - 1}):
            for key in (1, query - 1):
                qk = qk_attribution(loaded, ids, layer, head, query, key)
                worst = max(worst, abs(qk.total() - qk.score))
                total = qk.softmax_total()
                if total is not None:
                    worst = max(worst, abs(total - qk.log_attention))
    return worst


def long_ids(loaded: Any, n_tokens: int) -> list[int]:
    """About ``n_tokens`` tokens of Brown sentences."""
    return list(loaded.tokenizer(" ".join(brown_sentences(15)), add_special_tokens=False)["input_ids"][:n_tokens])


def timings(loaded: Any, ids: list[int], repeats: int) -> dict[str, float]:
    """Best seconds of one score's table, a forward pass with capture, and a plain forward pass."""
    n_layers = len([s for s in loaded.sites.values() if s.kind == "self"])
    input_ids = torch.tensor([ids])
    query = len(ids) - 1

    def captured() -> None:
        with torch.inference_mode(), capture(loaded.sites):
            loaded.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)

    def plain() -> None:
        with torch.inference_mode():
            loaded.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)

    return best_times({"qk": lambda: qk_attribution(loaded, ids, n_layers - 1, 0, query, query // 2),
                       "capture": captured, "forward": plain}, repeats)


def qk_figures(quick: bool = False, smoke: bool = False) -> dict[str, Any]:
    """The figures of this benchmark (see the module's docstring); ``smoke``: a tiny random Llama; ``quick``:
    SmolLM2 only, a 128-token timing."""
    with tempfile.TemporaryDirectory() as folder:
        models = [tiny_model(Path(folder))] if smoke else [attnscope.load_model("smollm2")]
    if not smoke and not quick:
        models += [attnscope.load_model(name) for name in FULL_MODELS[1:]]
    errors = {loaded.name: sum_error(loaded, SUM_TEXT) for loaded in models}
    for name, error in errors.items():
        print(f"  {name}: largest |table sum - what it splits| {error:.3g} (target <= 1e-4)", flush=True)
    n_tokens, repeats = (16, 1) if smoke else (128, 3) if quick else (256, 5)
    ids = long_ids(models[0], n_tokens)
    watch = CpuWatch()
    times = timings(models[0], ids, repeats)
    busy = watch.other_share()
    print(f"  {models[0].name}, {len(ids)} tokens: one score's table {times['qk'] * 1e3:.1f} ms; a forward pass with "
          f"capture {times['capture'] * 1e3:.1f} ms; without {times['forward'] * 1e3:.1f} ms "
          f"(other processes: {busy:.0%} of the cpus)", flush=True)
    return {
        "qk_models": [loaded.name for loaded in models],
        "qk_sum_max_abs_err": float(f"{max(errors.values()):.3g}"),
        "qk_sum_err_by_model": {name: float(f"{error:.3g}") for name, error in errors.items()},
        "qk_tokens": len(ids),
        "qk_ms": round(times["qk"] * 1e3, 2),
        "qk_capture_ms": round(times["capture"] * 1e3, 2),
        "qk_forward_ms": round(times["forward"] * 1e3, 2),
        "qk_over_capture": round(times["qk"] / times["capture"], 3),
        "qk_over_forward": round(times["qk"] / times["forward"], 3),
        "qk_other_cpu_share": round(busy, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="QK attribution: table sums and cost (one JSON line last)")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 only, a 128-token timing, 3 repeats")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    print(f"attnscope {attnscope.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_name()}, load average {load_before:.2f}", flush=True)
    figures = qk_figures(quick=args.quick, smoke=args.smoke)
    figures.update(torch_threads=torch.get_num_threads(), load_avg_before=round(load_before, 2),
                   load_avg_after=round(os.getloadavg()[0], 2))
    print(f"qk_sum_max_abs_err {figures['qk_sum_max_abs_err']} (target <= 1e-4), qk_over_capture "
          f"{figures['qk_over_capture']} (target <= 3)")
    emit("mechanism_qk", figures, keep=not args.smoke and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
