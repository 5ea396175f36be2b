"""Every text model type of the installed transformers: captured exactly, or refused clearly.

Run from the repository root (``make bench-architectures``)::

    .venv/bin/python benchmarks/architectures.py                    # every text model type (~10 minutes)
    .venv/bin/python benchmarks/architectures.py --types bert,llama  # a few

For each model type of transformers' ``CONFIG_MAPPING`` that has a causal LM, masked LM, seq2seq LM or
text base model class (vision, audio and multimodal-only types, and those whose forward pass needs other
inputs than tokens, such as bounding boxes or audio features, are counted and skipped), a tiny random
model (hidden 64, 2 layers, 4 heads, every window it has shorter than the 16-token input and used by a layer, seeded
noise on every weight so attention is far from uniform) is saved to a folder, loaded with ``attnscope.load_model`` and captured with ``extract``; every attention
kind (self, encoder, decoder, cross) is compared with the same folder loaded with
``attn_implementation="eager"`` and ``output_attentions=True`` (``tests/tiny_architectures.py``).

Outcomes: ``equal`` (largest absolute difference at most 1e-5), ``differs``, ``refused`` (attnscope's own
one-line error), ``crash`` (any other exception, a timeout or a dead process: a defect), ``no_eager``
(transformers' eager forward returns no attentions) and ``unbuilt`` (the tiny config or model does not
build, or eager cannot run it). ``eligible`` counts the types whose eager forward returns attentions.
Each type runs in its own process (forked from this one, which imported torch and transformers once)
with a timeout, two at a time. The last line is one JSON object of figures; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny models of any type

# torch, transformers and attnscope are imported once here: each forked process starts warm
import torch
import transformers
import transformers.modeling_utils
from bench_json import add_smoke_flag, cpu_name, emit

import attnscope.capture.extract  # noqa: F401
from tests.tiny_architectures import NEEDS_OTHER_INPUTS, TOLERANCE, check_type, text_model_types

SMOKE_TYPES = ("bert", "llama", "t5", "eurobert", "falcon", "hrm_text")
TIMEOUT_S = 120  # per type; a hang counts as a crash
PARALLEL = 2


def run_one(model_type: str, conn: Connection) -> None:
    """In a forked process: check one type, send its result, print nothing (stdout carries the figures)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    torch.set_num_threads(1)  # two types run at once on two cores
    with tempfile.TemporaryDirectory() as folder:
        try:
            result = check_type(model_type, Path(folder))
        except BaseException as error:  # noqa: BLE001 - the harness itself failing is reported, not raised
            result = {"outcome": "crash", "reason": f"harness: {type(error).__name__}: {error}"[:300]}
    conn.send(result)
    conn.close()


def sweep(types: list[str], parallel: int = PARALLEL, timeout: float = TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """Each type's result, ``parallel`` forked processes at a time, each stopped after ``timeout`` seconds."""
    context = multiprocessing.get_context("fork")
    pending, running, results = list(types), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            model_type = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=run_one, args=(model_type, send), daemon=True)
            process.start()
            send.close()
            running[model_type] = (process, receive, time.monotonic())
        wait([process.sentinel for process, _, _ in running.values()], timeout=1.0)
        for model_type, (process, receive, started) in list(running.items()):
            if receive.poll():
                try:
                    results[model_type] = receive.recv()
                except EOFError:
                    results[model_type] = {"outcome": "crash", "reason": "the process ended without a result"}
            elif not process.is_alive():
                results[model_type] = {"outcome": "crash", "reason": f"the process died (exit code {process.exitcode})"}
            elif time.monotonic() - started > timeout:
                process.kill()
                results[model_type] = {"outcome": "crash", "reason": f"timeout after {timeout:.0f} s"}
            else:
                continue
            process.join()
            receive.close()
            del running[model_type]
            print(f"{model_type}: {json.dumps(results[model_type])}", flush=True)
    return results


def figures(results: dict[str, dict[str, Any]], n_total: int, n_other: int) -> dict[str, Any]:
    """The sweep's summary (see the module docstring)."""
    by = {outcome: sorted(t for t, r in results.items() if r["outcome"] == outcome)
          for outcome in ("equal", "differs", "refused", "crash", "no_eager", "unbuilt")}
    errors = [results[t]["error"] for t in by["equal"]]
    return {
        "cpu": cpu_name(),
        "transformers_version": transformers.__version__,
        "total": n_total,
        "skipped_non_text": n_other,
        "skipped_needs_other_inputs": NEEDS_OTHER_INPUTS,  # among the skipped: a text vocabulary, other inputs
        "text_types": len(results),
        "eligible": sum(len(by[o]) for o in ("equal", "differs", "refused", "crash")),
        "equal": len(by["equal"]),
        "differs": len(by["differs"]),
        "refused": len(by["refused"]),
        "crashes": len(by["crash"]),
        "no_eager": len(by["no_eager"]),
        "unbuilt": len(by["unbuilt"]),
        "tolerance": TOLERANCE,
        "max_abs_err": max(errors, default=0.0),
        "equal_types": by["equal"],
        "differs_types": {t: {"error": results[t]["error"], "reason": results[t]["reason"]} for t in by["differs"]},
        "refused_types": {t: results[t]["reason"] for t in by["refused"]},
        "crashed_types": {t: results[t]["reason"] for t in by["crash"]},
        # why: "" where eager returns none; the reason where what it returns is not attention weights
        "no_eager_types": {t: results[t].get("reason", "") for t in by["no_eager"]},
        "unbuilt_types": {t: results[t]["reason"] for t in by["unbuilt"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="", help="comma-separated model types (default: every text model type)")
    parser.add_argument("--parallel", type=int, default=PARALLEL)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per type")
    add_smoke_flag(parser)
    args = parser.parse_args()
    print(f"cpu: {cpu_name()}; transformers {transformers.__version__}", flush=True)
    text, other = (list(SMOKE_TYPES), []) if args.smoke else text_model_types()  # a smoke run classifies nothing
    chosen = text if args.smoke else [t for t in args.types.split(",") if t] or text
    start = time.perf_counter()
    results = sweep(chosen, args.parallel, args.timeout)
    summary = figures(results, len(text) + len(other), len(other))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    emit("architectures", summary, keep=chosen == text)


if __name__ == "__main__":
    main()
