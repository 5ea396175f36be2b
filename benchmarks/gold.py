"""Gold-standard linguistics: dependency heads on UD EWT and coreference heads on UD GUM, per built-in
model: each head chosen on the dev split and scored on the test split, with run times and peak memory.

Run from the repository root (``make bench-gold``)::

    .venv/bin/python benchmarks/gold.py                      # minilm, smollm2, gemma3, qwen on the full splits
    .venv/bin/python benchmarks/gold.py --models minilm      # one model
    .venv/bin/python benchmarks/gold.py --smoke              # seconds: minilm, a few sentences, one document

The gold files (EWT and GUM, dev and test) are read from ``../shared/data/ud/`` (or
``$ATTNSCOPE_UD_DIR``); where one is absent the benchmark says so and exits 0 (its last line is
``{"skipped": reason}``). They are evaluation data, never copied into the repository.

Each model runs in a process of its own (so its peak memory is its own), one torch thread (the
machine is shared; say so with the figures). Per model:

* ``deps_test_sentences``, ``deps_dev_sentences``: EWT sentences scored (longer than the model's
  limit: skipped, in ``deps_too_long``); ``deps`` {relation: {head, head_acc, ci, selected_on,
  dev_acc, oracle_head, oracle_head_acc, offset_acc, n, direction}} for Clark et al.'s four
  relations (det; dobj = UD obj; pobj = UD obl/nmod with a case preposition; poss = UD nmod:poss):
  the head chosen on EWT dev (``selected_on``: "dev"; its dev accuracy ``dev_acc``), its EWT test
  accuracy and 95% interval, the best head on test (the oracle: an upper bound), the best fixed
  offset on the same arcs and the number of those arcs;
* ``coref_mentions``, ``coref_dev_mentions``: GUM mentions scored; ``coref`` {best_head,
  best_head_acc, ci, selected_on, oracle_head, oracle_head_acc, nearest_acc, headword_acc,
  rule_acc, documents, mean_candidates, window_tokens}: the head chosen on GUM dev, scored on test;
* ``load_s``, ``deps_s``, ``coref_s``: wall times (model load apart); ``peak_rss_mb``: the
  process's peak resident memory (``ru_maxrss``).

The last line is one JSON object ``{model: figures, ..., "threads", "total_s"}``; with
``--record`` (a full run, never ``--smoke``) it is also written to ``docs/bench/gold.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_record_flag, emit

from attnscope.probing.gold import EWT_DEV, EWT_TEST, GUM_DEV, GUM_TEST, gold_file, missing_message

MODELS = ("minilm", "smollm2", "gemma3", "qwen")
ALIASES = {"qwen": "qwen0.5b"}  # the Qwen that the `qwen` extra installs
RELATIONS = ("det", "dobj", "pobj", "poss")
GOLD = {"ewt": EWT_TEST, "ewt_dev": EWT_DEV, "gum": GUM_TEST, "gum_dev": GUM_DEV}
SMOKE_SENTENCES = 24
SMOKE_DOCUMENT_SENTENCES = 12


def deps_figures(headline: dict) -> dict:  # type: ignore[type-arg]
    """Clark et al.'s four relations from a DependencyResult's headline: the dev-chosen head and the oracle."""
    best = headline["best_head_acc"]
    return {relation: {"head": row["head"], "head_acc": row["acc"], "ci": row["ci"], "selected_on": row["selected_on"],
                       "dev_acc": row["selection_acc"], "oracle_head": row["oracle_head"],
                       "oracle_head_acc": row["oracle_head_acc"], "offset_acc": row["baseline"], "n": row["arcs"],
                       "direction": row["direction"]}
            for relation, row in best.items() if relation in RELATIONS}


def coref_figures(headline: dict) -> dict:  # type: ignore[type-arg]
    keys = ("best_head", "best_head_acc", "ci", "selected_on", "oracle_head", "oracle_head_acc", "nearest_acc",
            "headword_acc", "rule_acc", "documents", "mean_candidates", "window_tokens")
    return {key: headline[key] for key in keys}


def treebanks(paths: dict[str, Path], smoke: bool) -> dict:  # type: ignore[type-arg]
    """The four gold treebanks; at smoke size, the first sentences of EWT and of GUM's first document."""
    from attnscope.probing.documents import first_documents
    from attnscope.probing.treebank import Treebank, read_conllu

    read = {name: read_conllu(path) for name, path in paths.items()}
    if smoke:
        for name, treebank in read.items():
            if name.startswith("gum"):
                document = first_documents(treebank, 1)
                read[name] = Treebank(document.sentences[:SMOKE_DOCUMENT_SENTENCES], treebank.source, False,
                                      treebank.annotation)
            else:
                read[name] = treebank.head(SMOKE_SENTENCES)
    return read


def measure(name: str, paths: dict[str, Path], smoke: bool) -> dict:  # type: ignore[type-arg]
    """One model's figures (run in its own process: ``--one``)."""
    import torch

    from attnscope import load_model
    from attnscope.probing.run import probe_chains, probe_dependencies

    torch.set_num_threads(1)
    data = treebanks(paths, smoke)
    started = time.perf_counter()
    loaded = load_model(ALIASES.get(name, name))
    figures: dict = {"model": loaded.name, "causal": loaded.causal, "load_s": round(time.perf_counter() - started, 1)}
    started = time.perf_counter()
    deps = probe_dependencies(loaded, data["ewt"], progress=not smoke, min_arcs=1, select_on=data["ewt_dev"])
    figures["deps_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    coref = probe_chains(loaded, data["gum"], progress=not smoke, select_on=data["gum_dev"]).headline()
    figures["coref_s"] = round(time.perf_counter() - started, 1)
    assert deps.selection is not None
    figures.update({"deps_test_sentences": deps.counts.sentences, "deps_too_long": deps.counts.too_long,
                    "deps_dev_sentences": deps.selection.sentences, "deps": deps_figures(deps.headline()),
                    "coref_mentions": coref["mentions"], "coref_dev_mentions": coref["selection_mentions"],
                    "coref": coref_figures(coref),
                    "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})
    return figures


def in_own_process(name: str, smoke: bool) -> dict:  # type: ignore[type-arg]
    """``measure(name)`` in a child process (its peak memory is then the model's alone); its progress goes to stderr."""
    command = [sys.executable, __file__, "--one", name, *(["--smoke"] if smoke else [])]
    done = subprocess.run(command, check=False, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gold.py: {name} failed ({done.returncode}); its error is above")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{name}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated model aliases (default: {','.join(MODELS)}; qwen = {ALIASES['qwen']})")
    parser.add_argument("--smoke", action="store_true",
                        help=f"minilm on {SMOKE_SENTENCES} EWT sentences and {SMOKE_DOCUMENT_SENTENCES} GUM "
                        "sentences (dev and test each), in seconds; never recorded")
    parser.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)  # the child process of one model
    add_record_flag(parser)
    args = parser.parse_args()
    paths = {key: gold_file(name) for key, name in GOLD.items()}
    missing = [GOLD[key] for key, path in paths.items() if path is None]
    if missing:
        reason = missing_message(missing[0])
        print(f"skipped: {reason}", file=sys.stderr)
        print(json.dumps({"skipped": reason}))
        return
    if args.one:
        print(json.dumps(measure(args.one, paths, args.smoke)))  # type: ignore[arg-type]
        return
    started = time.perf_counter()
    models = ["minilm"] if args.smoke else [m.strip() for m in args.models.split(",") if m.strip()]
    if args.record and not args.smoke and sorted(models) != sorted(MODELS):  # the tables render every model from it
        sys.exit(f"gold: --record: not recorded, the record holds every model ({','.join(MODELS)}); got {','.join(models)}")
    figures: dict = {name: in_own_process(name, args.smoke) for name in models}
    figures.update({"threads": 1, "smoke": args.smoke, "selected_on": "dev", "total_s": round(time.perf_counter() - started, 1),
                    **{key: path.name for key, path in paths.items()}})  # type: ignore[union-attr]
    emit("gold", figures, keep=not args.smoke)


if __name__ == "__main__":
    main()
