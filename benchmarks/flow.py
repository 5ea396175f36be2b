"""Attention flow: attnscope's solver vs the networkx formulation of Abnar & Zuidema (2020), same input.

Input: the attention of the default model (all-MiniLM-L6-v2, 6 layers x 12 heads) on a pair of
adjacent Brown Corpus sentences truncated to ``--tokens`` tokens (default 64), so the graph is
``tokens x (layers + 1)`` nodes. Both sides use the same residual-adjusted matrices
(``0.5 * mean_heads(A) + 0.5 * I``, rows normalised) as capacities:

* ours: ``attnscope.analysis.rollout.attention_flow`` (SciPy's compiled Dinic max-flow on the
  layered graph built once, integer capacities scaled by 2**30);
* networkx: the paper's formulation written from its description: a ``DiGraph`` with an edge from
  every token of layer ``l + 1`` to every token of layer ``l`` whose ``capacity`` is the float
  weight, and ``networkx.maximum_flow_value(G, output_node, input_node, flow_func=...)`` for each
  (output token, input token) pair (``--nx-flow``: ``edmonds_karp``, the default, or
  ``preflow_push``, networkx's own default).

networkx with Edmonds-Karp needs several seconds per pair here (about 4.5 s on this machine), so
it solves ``--nx-pairs`` pairs (output token 0 to input tokens spread evenly over the input) and
its time for the full ``tokens x tokens`` problem is that time scaled by ``tokens**2 / nx_pairs``
(every pair is one independent max-flow problem on the same graph, so the cost is linear in the
number of pairs; the scaled figure is an estimate, stated as such in the JSON). Ours is timed on
the full problem (best of ``--repeats``). ``max_abs_diff`` is the largest |ours - networkx| over
the pairs networkx solved, at a capacity scale of 1 (an attention weight of 1.0).

Last line: one JSON object with ``tokens``, ``layers``, ``ours_s``, ``networkx_s``, ``speedup``,
``max_abs_diff`` and details. Targets: max_abs_diff <= 1e-6, speedup >= 20 at 64 tokens x 6 layers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_smoke_flag, emit
from extract import CpuWatch  # sibling benchmark script, not a package

import attnscope
from attnscope.analysis.rollout import attention_flow, residual_attention
from attnscope.data import brown_pairs


def networkx_flows(adjusted: np.ndarray, pairs: list[tuple[int, int]], flow_func_name: str) -> np.ndarray:
    """Max flow from output token ``i`` (top level) to input token ``j`` (level 0) for each ``(i, j)``, floats.

    ``adjusted``: residual-adjusted attention ``[layer, q_pos, k_pos]``; returns ``[pair]``.
    """
    import networkx as nx
    from networkx.algorithms import flow

    n_layers, n, _ = adjusted.shape
    graph = nx.DiGraph()
    for layer in range(n_layers):
        for i in range(n):
            for j in range(n):
                if adjusted[layer, i, j] > 0:
                    graph.add_edge((layer + 1, i), (layer, j), capacity=float(adjusted[layer, i, j]))
    flow_func = getattr(flow, flow_func_name)
    return np.array([nx.maximum_flow_value(graph, (n_layers, output), (0, token), flow_func=flow_func)
                     for output, token in pairs])


def long_input(tokens: int) -> tuple[str, str]:
    """The first Brown pair whose default-model tokenization has at least ``tokens`` tokens."""
    model = attnscope.load_model("minilm")
    for first, second in brown_pairs():
        if len(model.tokenizer(first, second)["input_ids"]) >= tokens:
            return first, second
    raise SystemExit(f"no Brown pair has {tokens} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="attention flow: attnscope vs networkx (prints one JSON line last)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--nx-pairs", type=int, default=16, help="(output, input) pairs networkx solves")
    parser.add_argument("--nx-flow", choices=["edmonds_karp", "preflow_push"], default="edmonds_karp")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of ours on the full problem; best counts")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.nx_pairs, args.repeats = 16, 2, 1
    if args.tokens < 2 or not 1 <= args.nx_pairs <= args.tokens or args.repeats < 1:
        parser.error("need --tokens >= 2, 1 <= --nx-pairs <= --tokens and --repeats >= 1")

    load_before = os.getloadavg()[0]
    first, second = long_input(args.tokens)
    model = attnscope.load_model("minilm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the truncation to --tokens is intended
        record = next(attnscope.extract_corpus(model, [(first, second)], max_length=args.tokens, progress=False))
    attention = np.asarray(record.attention, dtype=np.float64)  # [layer, head, q_pos, k_pos]
    n_layers, n = attention.shape[0], attention.shape[-1]
    print(f"input: {n} tokens x {n_layers} layers ({first[:50]}... / {second[:40]}...), "
          f"load average {load_before:.2f}", flush=True)

    ours_runs, ours_share = [], []
    for _ in range(args.repeats):
        watch = CpuWatch()
        start = time.perf_counter()
        ours = attention_flow(attention).values
        ours_runs.append(time.perf_counter() - start)
        ours_share.append(watch.other_share())
        print(f"  ours, full {n}x{n}: {ours_runs[-1]:.3f} s (other processes: {ours_share[-1]:.0%} of the cpus)",
              flush=True)
    ours_s = min(ours_runs)

    pairs = [(0, int(token)) for token in np.linspace(0, n - 1, args.nx_pairs).round().astype(int)]
    adjusted = residual_attention(attention)
    watch = CpuWatch()
    start = time.perf_counter()
    reference = networkx_flows(adjusted, pairs, args.nx_flow)
    networkx_pairs_s = time.perf_counter() - start
    nx_share = watch.other_share()
    networkx_s = networkx_pairs_s * n * n / len(pairs)
    print(f"  networkx ({args.nx_flow}), {len(pairs)} pairs: {networkx_pairs_s:.1f} s -> "
          f"{networkx_s:.0f} s estimated for {n}x{n} (other processes: {nx_share:.0%})", flush=True)
    max_abs_diff = float(np.abs(np.array([ours[i, j] for i, j in pairs]) - reference).max())
    result = {
        "tokens": n,
        "layers": n_layers,
        "ours_s": round(ours_s, 4),
        "networkx_s": round(networkx_s, 2),
        "speedup": round(networkx_s / ours_s, 1),
        "max_abs_diff": float(f"{max_abs_diff:.3g}"),
        "networkx_s_is_estimate": True,
        "networkx_flow_func": args.nx_flow,
        "networkx_pairs_timed": len(pairs),
        "networkx_pairs_s": round(networkx_pairs_s, 2),
        "ours_runs_s": [round(t, 4) for t in ours_runs],
        "other_cpu_share_ours": [round(v, 3) for v in ours_share],
        "other_cpu_share_networkx": round(nx_share, 3),
        "load_avg_before": round(load_before, 2),
        "load_avg_after": round(os.getloadavg()[0], 2),
    }
    print(f"speed-up {result['speedup']}x (target >= 20), max abs diff {result['max_abs_diff']:.3g} (<= 1e-6)")
    emit("flow", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
