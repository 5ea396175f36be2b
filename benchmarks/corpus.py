"""Corpus analysis, local engine vs Ray engine: the same 2,000 Brown sentences, side by side in one run.

Run from the repository root (``make bench-corpus``; needs ``pip install -e '.[ray]'``)::

    .venv/bin/python benchmarks/corpus.py                 # 2,000 sentences, 2 actors
    .venv/bin/python benchmarks/corpus.py --sentences 300  # a quick look

Both variants turn the shipped Brown sample into head rows (statistics, norm-weighted statistics,
labels, confidences of every head of every input) with the default model, float32, batches of 32:

(a) local  ``load_model`` + ``extract_corpus`` + ``head_rows`` a batch at a time, in this process
           (what ``attnscope heads`` runs before it writes the report);
(b) ray    ``compute_rows`` of the Ray engine on a local Ray started here with one CPU per core:
           an actor pool of ``--actors`` actors (each starts a process, imports torch and loads the
           model once), the rows written as Parquet part files and read back by the driver.

Timing is wall clock over the whole variant (model loads included); starting Ray itself
(``ray.init``, a cluster's one-time cost) is printed but not counted. The report, the same code for
both engines, is not timed. ``rows_equal``: same (input, layer, head) keys, every statistic within
1e-6, same labels. The CPU is printed first; the last line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pandas as pd
from bench_json import cpu_name, emit

from attnscope.analysis.corpus import head_rows, named_corpus
from attnscope.capture.extract import extract_corpus
from attnscope.models.loading import load_model

BATCH_SIZE = 32
TOLERANCE = 1e-6


def local_rows(texts: list[tuple[str, str | None]]) -> pd.DataFrame:
    """(a): the local engine's rows, ``BATCH_SIZE`` records at a time."""
    records = enumerate(extract_corpus(load_model("minilm"), texts, batch_size=BATCH_SIZE, norms=True, progress=False))
    frames = [head_rows([i for i, _ in batch], [r for _, r in batch])
              for batch in iter(lambda: list(islice(records, BATCH_SIZE)), [])]
    return pd.concat(frames, ignore_index=True)


def rows_equal(a: pd.DataFrame, b: pd.DataFrame) -> tuple[bool, float]:
    """Whether two engines' rows agree (keys, labels, statistics within TOLERANCE), and the largest difference."""
    keys = ["input_id", "layer", "head"]
    a, b = a.sort_values(keys, ignore_index=True), b.sort_values(keys, ignore_index=True)
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return False, float("inf")
    floats = [c for c in a.columns if a[c].dtype.kind == "f"]
    others = [c for c in a.columns if c not in floats]
    diff = np.abs(a[floats].to_numpy(float) - b[floats].to_numpy(float))
    same_nan = (np.isnan(a[floats].to_numpy(float)) == np.isnan(b[floats].to_numpy(float))).all()
    largest = float(np.nanmax(diff)) if np.isfinite(diff).any() else 0.0
    return bool(same_nan and largest <= TOLERANCE and (a[others] == b[others]).all().all()), largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    import ray

    from attnscope.analysis.distributed import actor_resources, compute_rows

    print(f"CPU: {cpu_name()}", flush=True)
    inputs = named_corpus("brown")[:args.sentences]
    start = time.perf_counter()
    local = local_rows([entry.item for entry in inputs])
    local_s = time.perf_counter() - start
    print(f"local: {local_s:.1f} s", flush=True)

    start = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    print(f"ray.init: {time.perf_counter() - start:.1f} s (not counted)", flush=True)
    _, threads, cpus = actor_resources(os.cpu_count() or 1, args.actors)
    print(f"{args.actors} actors x {threads} torch thread(s), {cpus} CPU asked each", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as work:
        start = time.perf_counter()
        on_ray = compute_rows(ray, inputs, Path(work) / "head_stats", model="minilm", dtype="float32",
                              batch_size=BATCH_SIZE, num_actors=args.actors, progress=False)
        ray_s = time.perf_counter() - start
    ray.shutdown()
    print(f"ray: {ray_s:.1f} s", flush=True)
    equal, largest = rows_equal(local, on_ray)
    print(f"largest difference of a statistic between the engines: {largest:.2g}", flush=True)
    emit("corpus", {"sentences": len(inputs), "local_per_s": round(len(inputs) / local_s, 1),
                    "ray_per_s": round(len(inputs) / ray_s, 1), "ray_overhead": round(ray_s / local_s, 3),
                    "rows_equal": equal, "actors": args.actors})


if __name__ == "__main__":
    main()
