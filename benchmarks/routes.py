"""Information-flow routes: exactness against a naive computation, cost against one capture forward pass, peak memory
at whole-document lengths.

Run from the repository root, alone on a quiet machine::

    .venv/bin/python benchmarks/routes.py            # every figure (the Gemma 3 32k route takes the longest)
    .venv/bin/python benchmarks/routes.py --quick    # without the Gemma 3 32k route
    .venv/bin/python benchmarks/routes.py --smoke    # a tiny random Llama, short texts (seconds; figures mean nothing)

Figures (the last line printed is one JSON object):

* ``equal_to_naive_max_abs_err``: the largest difference between the chunked importances (every row of every
  layer, :meth:`~attnscope.attribution.routes.RouteTensors.importance`) and a naive computation that materialises
  every part ``[q_pos, k_pos, head, d_model]`` (``tests/test_routes.py``'s), on short texts of a tiny random Llama
  (grouped heads), a tiny Gemma 3 (sliding window of 4) and SmolLM2. Target <= 1e-5.
* ``routes_over_capture``: the route graph of the last token of a 1,024-token document (SmolLM2, ``attnscope.routes``
  at the default tau: the forward pass keeping its inputs, then the walk) over one forward pass capturing the same
  text (attnscope's planned capture of every row's statistics, query chunks: what a long input's capture costs);
  best of ``--repeats`` runs each, interleaved. Target <= 3. ``routes_nodes_1k``: the graph's size.
* ``generate_routes_over_generate``: a greedy 64-token SmolLM2 generation keeping every step's route
  (``recorders=[StepRoutes()]``, ``generate --routes``) over the same generation with capture only; best of
  ``--repeats`` each, interleaved. Target <= 2.
* ``routes_4k_peak_mb``: the peak resident memory (``VmHWM``) of a child process that loads SmolLM2 and builds the
  route of the last token of a 4,096-token document (the weights included). Target <= 2,048.
* ``routes_gemma3_32k_peak_mb`` and ``routes_gemma3_32k_s``: the same for Gemma 3 270M at 32,768 tokens (skipped by
  ``--quick``). Target <= 8,192 MB.

The document is the longest shipped State of the Union address (``sotu-1981-jimmy-carter``), cut to each length in
the model's tokens, as in ``benchmarks/big.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the naive reference)
from attribution import best_times  # least seconds of each callable, interleaved
from bench_json import add_smoke_flag, cpu_name, emit

import attnscope
from attnscope.capture.extract import extract
from attnscope.capture.plan import CapturePlan
from attnscope.data import document

DOCUMENT = "sotu-1981-jimmy-carter"
SHORT = "The capital of France is Paris, and the capital of Italy is"
TARGETS = {"equal_to_naive_max_abs_err": "<= 1e-5", "routes_over_capture": "<= 3", "routes_4k_peak_mb": "<= 2048",
           "routes_gemma3_32k_peak_mb": "<= 8192", "generate_routes_over_generate": "<= 2"}


def tiny_models(folder: Path) -> list[Any]:
    """A tiny random Llama (grouped heads) and Gemma 3 (sliding window of 4), with the default model's tokenizer."""
    import transformers

    from attnscope.models.loading import resolve_source

    ids = {"vocab_size": 30522, "pad_token_id": 0}
    configs = {
        "llama": transformers.LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                                          num_key_value_heads=2, intermediate_size=37,
                                          architectures=["LlamaForCausalLM"], **ids),
        "gemma3": transformers.Gemma3TextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                                num_key_value_heads=1, head_dim=8, intermediate_size=37,
                                                sliding_window=4, query_pre_attn_scalar=16,
                                                layer_types=["sliding_attention", "full_attention",
                                                             "sliding_attention"],
                                                architectures=["Gemma3ForCausalLM"], **ids),
    }
    loaded = []
    for name, config in configs.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / name)
        transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder / name)
        loaded.append(attnscope.load_model(str(folder / name)))
    return loaded


def text_of(loaded: Any, n_tokens: int) -> str:
    """The document cut to ``n_tokens`` of ``loaded``'s tokens (its own special tokens included)."""
    ids = loaded.tokenizer(document(DOCUMENT), add_special_tokens=False)["input_ids"]
    specials = len(loaded.tokenizer("")["input_ids"])
    return str(loaded.tokenizer.decode(ids[: n_tokens - specials]))


def peak_in_child(model: str, n_tokens: int, timeout: float) -> dict[str, float]:
    """Seconds and peak RSS (MB) of a fresh process that loads ``model`` and builds one route at ``n_tokens``."""
    done = subprocess.run([sys.executable, __file__, "--child", model, str(n_tokens)], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the {model} route at {n_tokens} tokens failed: {done.stderr.strip()[-500:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def child(model: str, n_tokens: int) -> None:
    """(In the child process.) Load, build the route of the last token, print seconds, peak MB and the graph size."""
    loaded = attnscope.load_model(model)
    text = text_of(loaded, n_tokens)
    start = time.perf_counter()
    graph = attnscope.routes(loaded, text)
    seconds = time.perf_counter() - start
    peak = next(int(line.split()[1]) / 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": round(seconds, 2), "peak_mb": round(peak, 1), "tokens": len(graph.tokens),
                      "edges": len(graph.edges), "nodes": len(graph.nodes)}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="routes: exactness, cost over capture, peak memory (one JSON line)")
    parser.add_argument("--quick", action="store_true", help="leave out the Gemma 3 32k route")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of routes and of capture (default: 5)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "TOKENS"), help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    print(f"attnscope {attnscope.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_name()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    smollm2_installed = attnscope.ALIASES["smollm2"].installed
    with tempfile.TemporaryDirectory() as folder:
        models = tiny_models(Path(folder))
        if not args.smoke and smollm2_installed:
            models.append(attnscope.load_model("smollm2"))
        from tests.test_routes import chunked_vs_naive_error

        error = max(chunked_vs_naive_error(loaded, SHORT) for loaded in models)
        print(f"  chunked vs naive importances ({', '.join(m.name for m in models)}): {error:.3g} (target <= 1e-5)",
              flush=True)
        figures: dict[str, Any] = {"equal_to_naive_max_abs_err": float(f"{error:.3g}"), "targets": TARGETS}
        main_model = models[0] if args.smoke else models[-1]
        n_tokens, repeats = (64, 1) if args.smoke else (1024, args.repeats)
        figures.update(cost_figures(main_model, text_of(main_model, n_tokens), repeats))
        figures.update(generation_figures(main_model, 8 if args.smoke else 64, repeats))
        if args.smoke:
            long = peak_in_child(str(Path(folder) / "llama"), 128, timeout=600)
        else:
            long = peak_in_child("smollm2", 4096, timeout=3600)
    figures.update({"routes_4k_peak_mb": long["peak_mb"], "routes_4k_s": long["seconds"],
                    "routes_4k_nodes": long["nodes"]})
    print(f"  route at {long['tokens']} tokens: {long['seconds']:.1f} s, peak {long['peak_mb']:.0f} MB, "
          f"{long['nodes']} nodes", flush=True)
    if not args.smoke and not args.quick:
        gemma = peak_in_child("gemma3", 32768, timeout=4 * 3600)
        figures.update({"routes_gemma3_32k_peak_mb": gemma["peak_mb"], "routes_gemma3_32k_s": gemma["seconds"],
                        "routes_gemma3_32k_nodes": gemma["nodes"]})
        print(f"  Gemma 3 route at 32,768 tokens: {gemma['seconds']:.0f} s, peak {gemma['peak_mb']:.0f} MB",
              flush=True)
    figures["load_avg_after"] = round(os.getloadavg()[0], 2)
    emit("routes", figures, keep=not args.smoke and not args.quick)
    return 0


def cost_figures(loaded: Any, text: str, repeats: int) -> dict[str, Any]:
    """Best seconds of the route graph of the last token and of one capture forward pass of ``text``."""
    plan = CapturePlan(attention=False, statistics=True)
    graph = attnscope.routes(loaded, text)
    times = best_times({"routes": lambda: attnscope.routes(loaded, text),
                        "capture": lambda: extract(loaded, text, plan=plan, progress=False)}, repeats)
    print(f"  {len(graph.tokens)} tokens: routes {times['routes']:.2f} s ({len(graph.nodes)} nodes), capture "
          f"{times['capture']:.2f} s", flush=True)
    return {"routes_tokens": len(graph.tokens), "routes_s": round(times["routes"], 3),
            "capture_s": round(times["capture"], 3), "routes_over_capture": round(times["routes"] / times["capture"], 3),
            "routes_nodes_1k": len(graph.nodes), "routes_edges_1k": len(graph.edges)}


def generation_figures(loaded: Any, n_tokens: int, repeats: int) -> dict[str, Any]:
    """Best seconds of a greedy ``n_tokens``-token generation with capture, without and with every step's route."""
    from attnscope.attribution import StepRoutes

    prompt = "The history of the city begins"
    times = best_times({"generate": lambda: attnscope.generate(loaded, prompt, max_new_tokens=n_tokens),
                        "routes": lambda: attnscope.generate(loaded, prompt, max_new_tokens=n_tokens,
                                                             recorders=[StepRoutes()])}, repeats)
    print(f"  generating {n_tokens} tokens: {times['generate']:.2f} s, with every step's route {times['routes']:.2f} s",
          flush=True)
    return {"generate_s": round(times["generate"], 3), "generate_routes_s": round(times["routes"], 3),
            "generate_routes_over_generate": round(times["routes"] / times["generate"], 3)}


if __name__ == "__main__":
    raise SystemExit(main())
