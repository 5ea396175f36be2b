"""Size of the step view's page for 64 and 500 generated tokens, SmolLM2's shape (30 layers x 9 heads).

Run from the repository root::

    .venv/bin/python benchmarks/steps_page.py
    .venv/bin/python benchmarks/steps_page.py --generation gen.safetensors   # also a real saved generation

Input: a synthetic :class:`attnscope.GenerationRecord` after a 64-token prompt (generating 500 real
tokens takes many minutes on a CPU): every row is a softmax over its keys of random logits
(standard normal x 1.5) plus a sink on the first token (+4) and a bump on the last three keys
(+2), the shape decoder attention usually has; value norms log-normal. The page ships every head's
row quantized to one byte (present/steps.py), raw and norm-weighted, deflated.

* ``page_mb_64`` / ``page_mb_500``: size of the written HTML file (MB = 10^6 bytes); target < 20 at 500.
* ``build_s_64`` / ``build_s_500``: seconds to build the payload and write the page.
* with ``--generation``: ``real_tokens`` generated and ``real_page_mb`` of that record's page.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_json import add_smoke_flag, emit

from attnscope.present.steps import steps_view
from attnscope.records.attention import ModelInfo
from attnscope.records.generation import GenerationRecord, packed_length, row_offset

LAYERS, HEADS, PROMPT, CANDIDATES = 30, 9, 64, 10


def synthetic_generation(new_tokens: int, seed: int = 0) -> GenerationRecord:
    """A GenerationRecord of SmolLM2's shape with decoder-like rows (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n = PROMPT + new_tokens
    rows = np.zeros((LAYERS, HEADS, packed_length(n)), dtype=np.float32)
    for position in range(n):
        logits = rng.standard_normal((LAYERS, HEADS, position + 1), dtype=np.float32) * 1.5
        logits[..., 0] += 4.0  # the attention sink
        logits[..., -3:] += 2.0  # the last few tokens
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        rows[..., row_offset(position) : row_offset(position + 1)] = weights / weights.sum(axis=-1, keepdims=True)
    tokens = tuple(f" w{i % 997}" for i in range(n))
    probs = np.sort(rng.dirichlet(np.ones(CANDIDATES), size=new_tokens).astype(np.float32), axis=1)[:, ::-1]
    arrays = {"rows": rows, "value_norms": rng.lognormal(0.0, 0.5, (LAYERS, HEADS, n)).astype(np.float32),
              "token_ids": np.arange(n), "special_mask": np.zeros(n, bool), "word_ids": np.arange(n),
              "candidate_ids": np.tile(np.arange(CANDIDATES), (new_tokens, 1)), "candidate_probs": probs,
              "chosen_probs": probs[:, 0].copy()}
    model = ModelInfo("synthetic", "llama", LAYERS, HEADS, 3, 64, True, False, 0.125)
    return GenerationRecord(model=model, tokens=tokens, prompt_length=PROMPT, arrays=arrays,
                            candidate_tokens=tuple(tuple(f" c{k}" for k in range(CANDIDATES)) for _ in range(new_tokens)),
                            prompt="synthetic", settings={"do_sample": False})


def page_size(record: GenerationRecord, folder: Path) -> tuple[float, float]:
    """(MB of the written page, seconds to build and write it)."""
    start = time.perf_counter()
    path = steps_view(record).save(folder / "steps.html")
    return path.stat().st_size / 1e6, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", type=Path, help="a saved GenerationRecord to measure as well")
    add_smoke_flag(parser)
    args = parser.parse_args()
    figures: dict[str, float | int] = {}
    with tempfile.TemporaryDirectory() as folder:
        for new_tokens in (4,) if args.smoke else (64, 500):
            size, seconds = page_size(synthetic_generation(new_tokens), Path(folder))
            figures[f"page_mb_{new_tokens}"], figures[f"build_s_{new_tokens}"] = round(size, 2), round(seconds, 1)
            print(f"{new_tokens} new tokens: {size:.2f} MB in {seconds:.1f} s", file=sys.stderr)
        if args.generation:
            real = GenerationRecord.load(args.generation)
            size, _ = page_size(real, Path(folder))
            figures.update(real_tokens=real.n_steps, real_page_mb=round(size, 2))
    emit("steps_page", figures)


if __name__ == "__main__":
    main()
