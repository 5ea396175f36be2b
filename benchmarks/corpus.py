"""Corpus analysis, local engine vs Ray engine, and the Ray driver's memory at two corpus sizes, in one run.

Run from the repository root (``make bench-corpus``; needs ``pip install -e '.[ray]'``)::

    .venv/bin/python benchmarks/corpus.py            # 2,000 sentences both engines, then 20,000 on Ray
    .venv/bin/python benchmarks/corpus.py --quick    # 300 and 3,000 (does not touch docs/bench)
    .venv/bin/python benchmarks/corpus.py --smoke    # 16 and 160, seconds (does not touch docs/bench)

Every variant runs ``attnscope heads`` on a text file of Brown sentences with the default model,
float32, batches of 32 (the shipped sample, repeated for the large corpus unless ``--corpus`` names a
bigger file, e.g. the full derived Brown corpus of ``scripts/derive_brown_corpus.py``):

(a) local  the local engine, in this process (``--sentences`` N);
(b) ray    the Ray engine on a local Ray with one CPU per core and ``--actors`` actors, its driver a
           separate process, on N and on 10 x N sentences. The driver's peak RSS
           (``getrusage(RUSAGE_SELF)``: the driver process only, not Ray's processes) is
           ``driver_peak_mb_small`` and ``_large``; ``driver_growth`` is their ratio (at most 1.2: the
           driver holds per-head aggregates, not rows).

Both engines run the same batches (the Ray engine's actors get the local engine's sort windows whole) and
sum exactly, so ``rows_equal`` and ``report_equal`` ask for equality bit for bit, with no tolerance.
Timing is wall clock of the engine's call (model loads and actor start included); starting Ray itself
(``ray.init``, a cluster's one-time cost) is printed but not counted. ``rows_equal``: same (input,
layer, head) keys, every statistic, label and classifier figure the same (``rows_max_gap`` and ``_column``: the
statistics' largest gap and where; ``rows_max_gap_derived`` and ``_column``: the classifier's, its evidence
and confidence); ``report_equal``: the report's per-head figures, labels, stable heads and findings the same. The projection to 1M and 100M
sentences uses the large run's actor-seconds per sentence and Parquet bytes per sentence. The CPU is
printed first; the last line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import pandas as pd
from bench_json import add_record_flag, cpu_name, emit

BATCH_SIZE = 32
PROJECTED = (1_000_000, 100_000_000)
NODE_ACTORS = 16  # one-thread actors per node in the projection (a 16-core node)
NODE_HOURS = 24  # the projection's nodes finish in this many hours


def write_corpus(path: Path, n: int, source: Path | None) -> Path:
    """``n`` sentences, one per line: from ``source`` (a text file), else the shipped sample, repeated."""
    from attnscope.data import brown_sentences

    pool = source.read_text(encoding="utf-8").splitlines() if source else brown_sentences()
    pool = [line for line in pool if line.strip()]
    path.write_text("\n".join(pool[i % len(pool)] for i in range(n)) + "\n", encoding="utf-8")
    return path


def run_driver(corpus: Path, out: Path, actors: int) -> dict[str, float]:
    """The Ray engine's driver in a process of its own (``--driver``): its seconds and peak RSS."""
    done = subprocess.run([sys.executable, __file__, "--driver", str(corpus), str(out), "--actors", str(actors)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the Ray driver failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def driver(corpus: str, out: str, actors: int) -> None:
    """(b) in this process: start Ray, run the engine, print seconds and this process' peak RSS (MB)."""
    import os

    import ray

    from attnscope.corpus.engines import analyze_heads

    start = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    report = analyze_heads([corpus], out, engine="ray", num_actors=actors, batch_size=BATCH_SIZE, progress=False)
    seconds = time.perf_counter() - start
    ray.shutdown()
    report.summary.to_parquet(Path(out) / "summary.parquet")
    (Path(out) / "findings.json").write_text(json.dumps(findings(report)))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    print(json.dumps({"seconds": seconds, "init_s": init_s, "peak_mb": peak_mb}))


def findings(report) -> list:  # type: ignore[no-untyped-def]
    return [[f.pattern, [[h["layer"], h["head"], h["example_input"]] for h in f.heads]] for f in report.findings]


def head_stats(path: Path) -> pd.DataFrame:
    from attnscope.analysis.store import HeadStore

    with HeadStore(path) as store:
        return store.query("SELECT * FROM head_stats ORDER BY input_id, layer, head")


def frames_equal(a: pd.DataFrame, b: pd.DataFrame) -> tuple[bool, dict[str, tuple[float, str]]]:
    """Same columns, length and values, bit for bit (NaN where NaN). Also ``{"statistics" | "derived": (largest
    gap, its column)}``, relative for values above 1 (distances), absolute below; "derived": the classifier's
    evidence and confidence."""
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return False, {}
    floats = [c for c in a.columns if a[c].dtype.kind == "f"]
    x, y = a[floats].to_numpy(float), b[floats].to_numpy(float)
    gap = np.nan_to_num(np.abs(x - y) / np.maximum(1.0, np.abs(y)))
    by_column = dict(zip(floats, gap.max(axis=0) if len(gap) else np.zeros(len(floats))))
    largest = {}
    for kind in ("statistics", "derived"):
        columns = [c for c in floats if (c.startswith("ev_") or c == "confidence") == (kind == "derived")]
        column = max(columns, key=by_column.get, default="")
        largest[kind] = (float(by_column.get(column, 0.0)), column)
    others = [c for c in a.columns if c not in floats]
    same = np.array_equal(x, y, equal_nan=True) and (a[others].to_numpy() == b[others].to_numpy()).all()
    return bool(same), largest


def folder_mb(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*.parquet")) / 1e6


def projection(seconds: float, actors: int, sentences: int, parquet_mb: float, driver_mb: float) -> list[dict]:
    """Actor-seconds, nodes for NODE_HOURS, the driver's memory and the Parquet size at PROJECTED sizes."""
    per_sentence = seconds * actors / sentences
    rows = []
    for n in PROJECTED:
        actor_s = per_sentence * n
        rows.append({"sentences": n, "actor_hours": round(actor_s / 3600, 1),
                     "nodes": int(np.ceil(actor_s / (NODE_ACTORS * NODE_HOURS * 3600))),
                     "driver_mb": round(driver_mb), "parquet_gb": round(parquet_mb * n / sentences / 1000, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--corpus", type=Path, help="a text file of sentences for the large run (default: the "
                        "shipped sample, repeated)")
    parser.add_argument("--quick", action="store_true", help="300 and 3,000 sentences; never recorded")
    parser.add_argument("--smoke", action="store_true", help="16 and 160 sentences, seconds; never recorded")
    parser.add_argument("--driver", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)
    add_record_flag(parser)
    args = parser.parse_args()
    if args.driver:
        return driver(*args.driver, args.actors)
    from attnscope.corpus.engines import analyze_heads

    n = 16 if args.smoke else 300 if args.quick else args.sentences
    print(f"CPU: {cpu_name()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as work:
        folder = Path(work)
        small = write_corpus(folder / "small.txt", n, None)
        large = write_corpus(folder / "large.txt", 10 * n, args.corpus)
        start = time.perf_counter()
        local = analyze_heads([str(small)], folder / "local", batch_size=BATCH_SIZE, progress=False)
        local_s = time.perf_counter() - start
        print(f"local, {n} sentences: {local_s:.1f} s", flush=True)
        runs = {}
        for name, corpus in (("small", small), ("large", large)):
            runs[name] = run_driver(corpus, folder / name, args.actors)
            print(f"ray, {n if name == 'small' else 10 * n} sentences: "
                  f"{runs[name]['seconds']:.1f} s (ray.init {runs[name]['init_s']:.1f} s, not counted), driver peak "
                  f"{runs[name]['peak_mb']:.0f} MB", flush=True)
        rows_equal, gaps = frames_equal(head_stats(folder / "small" / "heads.duckdb"), head_stats(local.database))
        summary_equal, _ = frames_equal(pd.read_parquet(folder / "small" / "summary.parquet"), local.summary)
        report_equal = summary_equal and json.loads((folder / "small" / "findings.json").read_text()) == findings(local)
        for kind, (gap, column) in gaps.items():
            print(f"largest difference of the {kind} between the engines: {gap:.2g} ({column})", flush=True)
        parquet_mb = folder_mb(folder / "large" / "parquet")
    peak_small, peak_large = runs["small"]["peak_mb"], runs["large"]["peak_mb"]
    figures = {"sentences": n, "sentences_large": 10 * n, "actors": args.actors,
               "local_per_s": round(n / local_s, 1), "ray_per_s": round(n / runs["small"]["seconds"], 1),
               "ray_per_s_large": round(10 * n / runs["large"]["seconds"], 1),
               "ray_overhead": round(runs["small"]["seconds"] / local_s, 3),
               "rows_equal": rows_equal, "rows_max_gap": float(f"{gaps['statistics'][0]:.2g}"),
               "rows_max_gap_column": gaps["statistics"][1], "rows_max_gap_derived": float(f"{gaps['derived'][0]:.2g}"),
               "rows_max_gap_derived_column": gaps["derived"][1], "report_equal": report_equal,
               "driver_peak_mb_small": round(peak_small), "driver_peak_mb_large": round(peak_large),
               "driver_growth": round(peak_large / peak_small, 3), "parquet_mb_large": round(parquet_mb, 1),
               "node_actors": NODE_ACTORS, "node_hours": NODE_HOURS,
               "projection": projection(runs["large"]["seconds"], args.actors, 10 * n, parquet_mb, peak_large)}
    emit("corpus", figures, keep=not (args.quick or args.smoke))


if __name__ == "__main__":
    main()
