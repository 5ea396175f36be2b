"""Memory of the keys a sparse-attention indexer selects (DeepSeek sparse attention's ``indices``) under planned
capture: one attention call at 8,192 tokens.

Run from the repository root::

    .venv/bin/python benchmarks/selected_keys.py                  # 8,192 tokens
    .venv/bin/python benchmarks/selected_keys.py --tokens 2048    # a quick look
    .venv/bin/python benchmarks/selected_keys.py --record         # kept in docs/bench/selected_keys.json
    .venv/bin/python benchmarks/selected_keys.py --smoke          # 256 tokens, seconds (make test runs it)

A call of the attention function (4 heads of 16 dims, causal, no mask: what the lazy mask gives planned capture)
that hands it the ``top_k`` (default 64) keys each query's indexer selected, recorded by a planned capture of
per-row statistics (``CapturePlan(attention=False, statistics=True)``, query chunks of 256). Its queries, keys, values
and indices are built first; the figure is the peak resident memory of the call alone above what the process held
before it (``VmHWM`` after resetting it, minus ``VmRSS``), in MB, beside the same call without a selection (every
earlier key seen: the planned path every other call takes). A ``[q_pos, k_pos]`` bool mask at 8,192 tokens is
64 MB; a chunk's is 2 MB. Memory only: the timing of one call says nothing here. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json, long
from bench_json import add_smoke_flag, cpu_name, emit
from long import peak_mb, reset_peak

from attnscope.capture.attention import attnscope_attention, capture
from attnscope.capture.plan import CapturePlan
from attnscope.capture.rows import BatchFacts
from attnscope.models.adapters import AttentionSite

HEADS, D_HEAD = 4, 16


def causal_selection(n: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """``[1, n, top_k]``: for each query, ``top_k`` keys at or before it (-1 where it has fewer), as an indexer
    gives them."""
    scores = torch.rand((n, n), generator=generator).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1.0)
    chosen = scores.topk(top_k, dim=-1)
    return chosen.indices.masked_fill(chosen.values < 0, -1)[None]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def planned_call_peak(n: int, top_k: int) -> float:
    """The peak memory (MB above the start) of one planned capture of a call on ``n`` tokens with ``top_k`` selected
    keys per query (0: none selected, every earlier key seen)."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn((1, HEADS, n, D_HEAD), generator=generator) for _ in range(3))
    selected: dict[str, Any] = {"indices": causal_selection(n, top_k, generator)} if top_k else {}
    module = nn.Module()
    site = AttentionSite("self", 0, "layers.0.self_attn", True, None)
    module.attnscope_site = site  # type: ignore[assignment]  # as load_model marks a site
    plan = CapturePlan(attention=False, statistics=True)
    facts = BatchFacts([n], torch.zeros((1, n), dtype=torch.bool), [np.arange(n)])
    start = rss_mb()
    reset_peak()
    with torch.inference_mode(), capture({module: site}, plan=plan, facts=facts):
        attnscope_attention(module, query, key, value, None, scaling=D_HEAD ** -0.5, **selected)
    return peak_mb() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=64)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.top_k = 256, 16
    torch.set_num_threads(1)
    print(f"cpu: {cpu_name()}", flush=True)
    peak = planned_call_peak(args.tokens, args.top_k)
    unselected = planned_call_peak(args.tokens, 0)
    emit("selected_keys", {"tokens": args.tokens, "top_k": args.top_k, "heads": HEADS,
                           "planned_call_peak_mb": round(peak, 1), "unselected_call_peak_mb": round(unselected, 1),
                           "whole_mask_mb": round(args.tokens * args.tokens / 2**20, 1)}, keep=args.tokens == 8192)


if __name__ == "__main__":
    main()
