"""Gold-standard linguistics: dependency heads on UD EWT test and coreference heads on UD GUM test,
per built-in model, with run times.

Run from the repository root (``make bench-gold``)::

    .venv/bin/python benchmarks/gold.py                      # minilm, smollm2, gemma3 on the full test splits
    .venv/bin/python benchmarks/gold.py --models minilm      # one model
    .venv/bin/python benchmarks/gold.py --smoke              # seconds: minilm, a few sentences, one document

The gold files are read from ``../shared/data/ud/`` (or ``$ATTNSCOPE_UD_DIR``); where they are
absent the benchmark says so and exits 0 (its last line is ``{"skipped": reason}``). They are
evaluation data, never copied into the repository.

Per model, in one process, one torch thread (the machine is shared; say so with the figures):

* ``deps_test_sentences``: EWT test sentences scored (longer than the model's limit: skipped, in
  ``deps_too_long``); ``deps`` {relation: {head_acc, offset_acc, n, head, direction, ci}} for Clark
  et al.'s four relations (det; dobj = UD obj; pobj = UD obl/nmod with a case preposition; poss =
  UD nmod:poss), the best head over the directions a model defines, the best fixed offset on the
  same arcs, the number of those arcs and the head's 95% interval;
* ``coref_mentions``: GUM test mentions scored; ``coref`` {best_head_acc, ci, nearest_acc,
  headword_acc, rule_acc, best_head};
* ``deps_s``, ``coref_s``, ``load_s``: wall times (model load apart).

The last line is one JSON object ``{model: figures, ..., "threads", "total_s"}``; without
``--smoke`` it is also written to ``docs/bench/gold.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_record_flag, emit

from attnscope import load_model
from attnscope.probing.documents import first_documents
from attnscope.probing.gold import EWT_TEST, GUM_TEST, gold_file, missing_message
from attnscope.probing.run import probe_chains, probe_dependencies
from attnscope.probing.treebank import Treebank, read_conllu

MODELS = ("minilm", "smollm2", "gemma3")
RELATIONS = ("det", "dobj", "pobj", "poss")
SMOKE_SENTENCES = 24
SMOKE_DOCUMENT_SENTENCES = 12


def deps_figures(result) -> dict:  # type: ignore[no-untyped-def]
    """Clark et al.'s four relations from a DependencyResult's headline."""
    best = result.headline()["best_head_acc"]
    return {relation: {"head_acc": best[relation]["acc"], "offset_acc": best[relation]["baseline"],
                       "n": best[relation]["arcs"], "head": best[relation]["head"],
                       "direction": best[relation]["direction"], "ci": best[relation]["ci"]}
            for relation in RELATIONS if relation in best}


def measure(name: str, ewt: Treebank, gum: Treebank, progress: bool) -> dict:  # type: ignore[type-arg]
    started = time.perf_counter()
    loaded = load_model(name)
    figures: dict = {"load_s": round(time.perf_counter() - started, 1)}
    started = time.perf_counter()
    deps = probe_dependencies(loaded, ewt, progress=progress, min_arcs=1)
    figures["deps_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    coref = probe_chains(loaded, gum, progress=progress).headline()
    figures["coref_s"] = round(time.perf_counter() - started, 1)
    figures.update({"deps_test_sentences": deps.counts.sentences, "deps_too_long": deps.counts.too_long,
                    "deps": deps_figures(deps), "coref_mentions": coref["mentions"],
                    "coref": {key: coref[key] for key in ("best_head_acc", "ci", "nearest_acc", "headword_acc",
                                                          "rule_acc", "best_head")}})
    print(f"{name}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    return figures


def smoke_treebanks(ewt: Treebank, gum: Treebank) -> tuple[Treebank, Treebank]:
    """The first sentences of EWT, and the first sentences of GUM's first document."""
    document = first_documents(gum, 1)
    return ewt.head(SMOKE_SENTENCES), Treebank(document.sentences[:SMOKE_DOCUMENT_SENTENCES], gum.source, False,
                                               gum.annotation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model aliases")
    parser.add_argument("--smoke", action="store_true",
                        help=f"minilm on {SMOKE_SENTENCES} EWT sentences and {SMOKE_DOCUMENT_SENTENCES} GUM "
                        "sentences, in seconds; never recorded")
    add_record_flag(parser)
    args = parser.parse_args()
    paths = {name: gold_file(name) for name in (EWT_TEST, GUM_TEST)}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        reason = missing_message(missing[0])
        print(f"skipped: {reason}", file=sys.stderr)
        print(json.dumps({"skipped": reason}))
        return
    torch.set_num_threads(1)
    started = time.perf_counter()
    ewt, gum = read_conllu(paths[EWT_TEST]), read_conllu(paths[GUM_TEST])  # type: ignore[arg-type]
    models = ["minilm"] if args.smoke else [m.strip() for m in args.models.split(",") if m.strip()]
    if args.smoke:
        ewt, gum = smoke_treebanks(ewt, gum)
    figures: dict = {name: measure(name, ewt, gum, progress=not args.smoke) for name in models}
    figures.update({"threads": 1, "smoke": args.smoke, "total_s": round(time.perf_counter() - started, 1)})
    emit("gold", figures, keep=not args.smoke)


if __name__ == "__main__":
    main()
