"""Run needle-in-a-haystack trials on one model and print its retrieval heads (issue 48), as one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/needle_trials.py qwen0.5b --lengths 1024 --depths 0.1 0.5 0.9

Prints each trial (answer, counted, seconds), the top-10 heads (0-indexed layer, head, score) and the share of heads
whose retrieval score exceeds 0.1.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import attnscope
from attnscope.experiments.needles import (
    DEFAULT_DEPTHS,
    DEFAULT_DOCUMENT,
    DEFAULT_NEEDLES,
    MAX_NEW_TOKENS,
    needle_trials,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS))
    parser.add_argument("--needles", nargs="+", default=list(DEFAULT_NEEDLES))
    parser.add_argument("--document", default=DEFAULT_DOCUMENT)
    parser.add_argument("--form", choices=["plain", "chat"], default=None)
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--save", help="an .npz of each trial's top keys [step, layer, head], token ids and spans")
    args = parser.parse_args()
    started = time.perf_counter()
    loaded = attnscope.load_model(args.model)
    loading = time.perf_counter() - started
    result = needle_trials(loaded, lengths=args.lengths, depths=args.depths, needles=args.needles,
                           document_name=args.document, form=args.form, max_new_tokens=args.max_new_tokens,
                           progress=True)
    if args.save:
        np.savez_compressed(args.save, **{f"{name}_{index}": value for index, trial in enumerate(result.trials)
                                          for name, value in (("top_keys", trial.top_keys), ("token_ids", trial.token_ids),
                                                              ("spans", np.array([trial.prompt.needle_span,
                                                                                  trial.prompt.answer_span])))})
    print(json.dumps({"model": result.model, "load_seconds": round(loading, 1),
                      "trials": result.trials_frame().to_dict(orient="records"), "counted": result.n_counted,
                      "top10": [[layer, head, round(score, 3)] for layer, head, score in result.top(10)],
                      "share_above_0.1": round(result.share_above(0.1), 4),
                      "n_heads": int(result.scores.size)}, indent=1))


if __name__ == "__main__":
    main()
