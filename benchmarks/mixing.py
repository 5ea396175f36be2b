"""Context-mixing measures: time per sentence against one capture pass, and value zeroing batched
against a loop of one forward per zeroed token.

Run from the repository root (``make bench-mixing``)::

    .venv/bin/python benchmarks/mixing.py                  # 64 Brown sentences on MiniLM and on SmolLM2
    .venv/bin/python benchmarks/mixing.py --sentences 8    # a quick look

For each model, in one process, side by side on the first ``--sentences`` sentences of the shipped
Brown sample, per sentence:

* ``capture_s``: ``extract(model, text)``, one capture forward pass (the attention record);
* ``{method}_s``: ``attnscope.mixing(model, text, method)`` for each measure, its own capture included;
* ``value_zeroing_speedup_vs_loop``: on the first ``--loop-sentences`` sentences, the zeroing part of
  value zeroing (after the shared capture) batched (each layer's block run once on T copies, copy j
  zeroing token j) against a loop running the same block once per zeroed token, the same numbers.
* ``value_zeroing_gflop_s`` and ``loop_gflop_s``: the rate of both at the blocks' matrix products
  (T copies x T positions through every linear layer; the same work in both), which says how close
  to the CPU's own matmul speed each runs, hence how much batching can still gain;
  ``matmul_gflop_s``: that speed, one large float32 product on one thread.

Torch runs one intra-op thread (as the evaluation does; on this 2-core machine shared with other
jobs, two threads stall at every parallel region). Each model gets one warm-up sentence first.
The last line is one JSON object of figures, each a ``{model: value}`` mapping.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_smoke_flag, emit

from attnscope import load_model
from attnscope.analysis.mixing import METHODS
from attnscope.capture.attention import intervene
from attnscope.capture.extract import extract
from attnscope.data import brown_sentences
from attnscope.experiments.interventions import ValueZeroing
from attnscope.experiments.mixing import Captured, capture_layers, mixing, value_zeroing_distances
from attnscope.experiments.sweeps import run_blocks_from

MODELS = ("minilm", "smollm2")


def per_sentence(function, sentences: list[str]) -> float:
    start = time.perf_counter()
    for sentence in sentences:
        function(sentence)
    return (time.perf_counter() - start) / len(sentences)


def zeroing_loop(captured: Captured) -> np.ndarray:
    """Value zeroing one forward per zeroed token: each block once per position, batch of one."""
    n = len(captured.tokens)
    distances = np.zeros((len(captured.blocks), n, n))
    with torch.inference_mode():
        for layer in range(len(captured.blocks)):
            intact = captured.outputs[layer].double()
            for position in range(n):
                with intervene(ValueZeroing(layer, torch.tensor([position]), captured.kind)):
                    zeroed = run_blocks_from(captured.blocks, captured.kept, layer, 1, 1, stop=layer + 1)[0]
                cosine = torch.nn.functional.cosine_similarity(zeroed.double(), intact, dim=-1)
                distances[layer, :, position] = (1.0 - cosine).numpy()
    return np.tril(distances) if captured.causal else distances


def zeroing_gflop(captured: Captured) -> float:
    """The matrix products of value zeroing one input, in GFLOP: every block's linear layers on T
    copies of T positions (2 flops per weight per token), the attention products left out."""
    n = len(captured.tokens)
    weights = sum(module.weight.numel() for block in captured.blocks for module in block.modules()
                  if isinstance(module, torch.nn.Linear))
    return 2 * weights * n * n / 1e9


def matmul_gflop_s(size: int = 1024, repeats: int = 10) -> float:
    """This CPU's own float32 matmul rate on one thread (a large square product), in GFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def measure(name: str, sentences: list[str], loop_sentences: int) -> dict[str, float]:
    loaded = load_model(name)
    mixing(loaded, sentences[0], method="value_zeroing")  # warm-up
    figures = {"sentences": len(sentences), "capture_s": per_sentence(lambda s: extract(loaded, s), sentences)}
    for method in METHODS:
        figures[f"{method}_s"] = per_sentence(lambda s, m=method: mixing(loaded, s, method=m), sentences)
    captured = [capture_layers(loaded, s) for s in sentences[:loop_sentences]]
    batched = per_sentence(value_zeroing_distances, captured)  # type: ignore[arg-type]
    looped = per_sentence(zeroing_loop, captured)  # type: ignore[arg-type]
    for one in captured[:2]:  # the loop computes the same distances
        np.testing.assert_allclose(zeroing_loop(one), value_zeroing_distances(one), atol=1e-5)
    figures["value_zeroing_speedup_vs_loop"] = looped / batched
    work = np.mean([zeroing_gflop(one) for one in captured])  # the same for both: T copies x T positions
    figures["value_zeroing_gflop_s"] = work / batched
    figures["loop_gflop_s"] = work / looped
    print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()), file=sys.stderr, flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=64, help="sentences per model")
    parser.add_argument("--loop-sentences", type=int, default=4, help="sentences of the loop comparison")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.sentences, args.loop_sentences = 2, 1
    torch.set_num_threads(1)
    start = time.perf_counter()
    texts = brown_sentences(args.sentences)
    per_model = {name: measure(name, texts, args.loop_sentences) for name in MODELS}
    keys = next(iter(per_model.values())).keys()
    figures = {key: {name: round(values[key], 4) for name, values in per_model.items()} for key in keys}
    figures["threads"] = 1
    figures["matmul_gflop_s"] = round(matmul_gflop_s(), 1)
    figures["total_s"] = round(time.perf_counter() - start, 1)
    emit("mixing", figures)


if __name__ == "__main__":
    main()
