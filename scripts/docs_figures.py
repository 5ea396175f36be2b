"""Regenerate every figure the README and the documentation pages quote (``make docs-figures``), so none can go stale.

Each *group* runs the attnscope command that produces its figures and keeps them in
``docs/figures.json``: per group the figures, the command, the date, the CPU and the wall time.
The generated regions of README.md and of the pages ``docs/*.md``, marked ``<!-- figures:NAME -->`` ...
``<!-- /figures:NAME -->``, are then rendered from the Jinja2 template ``docs/templates/NAME.md`` with those
figures and the benchmark figures in ``docs/bench/*.json`` (written by ``benchmarks/*.py`` when run with
``--record``). Never edit a generated region by hand: ``tests/test_docs_figures.py`` checks that each equals its
rendering, and re-runs the cheap producers (toy translator, view sizes, the Python example) to
check they still give the recorded figures. The expensive ones (corpus report, classifier
evaluation, ablation, probes) are re-run only here. Figures PNGs the pages show are copied into
``docs/img`` from the same runs.

    python scripts/docs_figures.py                 # every group, then render the README and the pages
    python scripts/docs_figures.py toy views       # only these groups (the others keep their figures)
    python scripts/docs_figures.py --render        # only render the README and the pages from the stored figures
    python scripts/docs_figures.py --list          # the groups and their commands

Run from the repository root with the project's virtualenv (``make docs-figures`` does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures.json"
TEMPLATES = ROOT / "docs" / "templates"
BENCH = ROOT / "docs" / "bench"
IMAGES = ROOT / "docs" / "img"
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_json: one cpu_name() for benchmarks and docs figures
from bench_json import cpu_name

REGION = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.DOTALL)

# the examples of the README and the pages: one pair, and the long input of the view-size figures (benchmarks/render.py's)
EXAMPLE_TEXT = "I went to the store."
EXAMPLE_PAIR = "At the store, I bought fresh strawberries."
LONG_INPUT_SENTENCES = 80
TOY_EXAMPLE = "i can eat apples"
GENERATE_PROMPT = "Write one sentence about the sea."
GENERATE_CHANGES = ("--ablate", "3:4,7")
GENERATE_TOKENS = "32"


# ---- running commands ------------------------------------------------------------------------------
def checkout_environment() -> dict[str, str]:
    """This process's environment with this checkout's sources first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def attnscope(*args: str, extra_env: dict[str, str] | None = None) -> str:
    """Run ``attnscope ARGS`` with this checkout's sources first (and ``extra_env``); its stdout (fails loudly)."""
    env = {**checkout_environment(), **(extra_env or {})}
    done = subprocess.run([sys.executable, "-m", "attnscope", *args], check=False, capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"attnscope {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def attnscope_measured(*args: str) -> tuple[float, float]:
    """Run ``attnscope ARGS`` like :func:`attnscope` (output discarded): its wall time in seconds and its peak
    resident set size in MB (the child's own ``ru_maxrss``, read by ``wait4``)."""
    env = checkout_environment()
    started = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen([sys.executable, "-m", "attnscope", *args], stdout=subprocess.DEVNULL, stderr=errors,
                                 env=env, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"attnscope {' '.join(args)} failed ({child.returncode}):\n"
                             f"{errors.read().decode(errors='replace')[-2000:]}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def last_json(stdout: str) -> Any:
    """The JSON object on the last non-empty line (what ``--json`` prints)."""
    return json.loads(stdout.strip().splitlines()[-1])


def copy_image(source: Path, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, IMAGES / name)


# ---- producers: each returns {figure: value}; `work` is a fresh temporary folder --------------------
def example_shape(work: Path) -> dict[str, Any]:
    """The README's Python example: the shape of a pair's attention on the default model."""
    import attnscope

    record = attnscope.extract(attnscope.load_model("minilm"), EXAMPLE_TEXT, EXAMPLE_PAIR, norms=True)
    return {"attention_shape": list(record.attention.shape), "tokens": len(record.tokens)}


def long_input() -> str:
    """Brown sentences that make more than the default model's 512 tokens (cut to 512 on extraction)."""
    from attnscope.data import brown_sentences

    return " ".join(brown_sentences(LONG_INPUT_SENTENCES))


def view_sizes(work: Path) -> dict[str, Any]:
    """Size of ``attnscope view``'s file at the model's limit of 512 tokens, by option."""
    variants = {"default": [], "head_no_norms": ["--kind", "head", "--no-norms"]}
    figures: dict[str, Any] = {}
    for name, options in variants.items():
        path = work / f"{name}.html"
        printed = attnscope("view", long_input(), "-o", str(path), *options)
        figures["tokens"] = int(re.search(r"(\d+) tokens", printed).group(1))  # type: ignore[union-attr]
        figures[f"{name}_mb"] = round(path.stat().st_size / 1e6, 1)
    head_view = (ROOT / "src/attnscope/present/static/head_view.js").read_text()
    figures["line_budget"] = int(re.search(r"LINE_BUDGET = (\d+)", head_view).group(1))  # type: ignore[union-attr]
    return figures


TOY_SEEDS = (0, 1, 2, 3, 4)
# what the toy table (docs/lab.md) says of each experiment, as predicates on one training run's figures: the producer
# records whether each holds for every seed, and the tests check a fresh run on any CPU
TOY_CLAIMS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "intact_translates": lambda run: run["exact_match"] >= 0.95,
    "cross_attention_corruptions_break_it": lambda run: max(
        run["corrupted"][name] for name in ("uniform", "beginning", "end", "no-cross-attention")) <= 0.1,
    "no_cross_attention_same_output_for_every_input": lambda run: run["no_cross_distinct_outputs"] == 1,
    "decoder_self_attention_only_never_stops": lambda run: len(
        run["example_outputs"]["decoder-self-attention-only"].split()) >= 16,
    "no_feed_forward_repeats_a_word": lambda run: any(
        a == b for a, b in zip(run["example_outputs"]["no-feed-forward"].split(),
                               run["example_outputs"]["no-feed-forward"].split()[1:])),
    "no_layer_norm_least_harmful_switch_off": lambda run: run["corrupted"]["no-layer-norm"] > max(
        run["corrupted"][name] for name in ("no-cross-attention", "decoder-self-attention-only", "no-feed-forward")),
    "shuffled_source_not_translated": lambda run: run["corrupted"]["shuffled-source"] <= 0.6,
}


def toy_seed_figures(seed: int) -> dict[str, Any]:
    """One training run of the toy translator (``seed``): ``attnscope toy evaluate --seeds SEED --json``'s figures,
    the example sentence under every experiment, and how many distinct outputs no cross-attention gives."""
    from attnscope.lab import corpus as toy_corpus
    from attnscope.lab.experiments import EXPERIMENTS, load_toy_seed, translate_with

    evaluated = last_json(attnscope("toy", "evaluate", "--seeds", str(seed), "--json"))["per_seed"][0]
    loaded = load_toy_seed(seed)
    without_cross = translate_with(loaded, [pair.english for pair in toy_corpus.make_corpus(seed).test],
                                   "no-cross-attention")
    return {**evaluated, "example_intact": translate_with(loaded, [TOY_EXAMPLE])[0],
            "example_outputs": {name: translate_with(loaded, [TOY_EXAMPLE], name)[0] for name in EXPERIMENTS},
            "no_cross_distinct_outputs": len(set(without_cross))}


def toy_band(figure: dict[str, float]) -> tuple[float, float]:
    """Where a fresh run's exact match must fall: the range over the recorded seeds, widened on each side by half
    its width and at least 0.05 (five seeds under-cover the spread of one more draw, and another CPU's float
    differences are one more source of it)."""
    margin = max(0.05, (figure["max"] - figure["min"]) / 2)
    return max(0.0, figure["min"] - margin), min(1.0, figure["max"] + margin)


def toy_outside_band(over_seeds: dict[str, dict[str, float]], run: dict[str, Any]) -> dict[str, float]:
    """The exact-match figures of ``run`` (one seed's) outside their recorded band: ``{"intact" | experiment: value}``."""
    values = {"intact": run["exact_match"], **run["corrupted"]}
    bands = {name: toy_band(over_seeds[name]) for name in values}
    return {name: value for name, value in values.items() if not bands[name][0] <= value <= bands[name][1]}


def toy_translator(work: Path) -> dict[str, Any]:
    """``attnscope toy evaluate --seeds 0-4 --json`` with the example sentence under every experiment: each figure as
    its mean and range over seeds (one training run is one draw), the lab page's claims checked on every seed."""
    from attnscope.lab import corpus as toy_corpus
    from attnscope.lab.experiments import BEGINNING_TOKENS, summarise_seeds
    from attnscope.lab.translator import TrainingSettings

    runs = [toy_seed_figures(seed) for seed in TOY_SEEDS]
    made = toy_corpus.make_corpus(0)
    settings = TrainingSettings()
    example_end_empty = sum(not run["example_outputs"]["end"].strip() for run in runs)
    return {"layers": settings.layers, "heads": settings.heads, "beginning_tokens": BEGINNING_TOKENS,
            "seeds": list(TOY_SEEDS), "test_pairs": runs[0]["test_pairs"], "over_seeds": summarise_seeds(runs),
            "claims": {name: all(claim(run) for run in runs) for name, claim in TOY_CLAIMS.items()},
            "example": TOY_EXAMPLE, "draw": runs[0], "example_end_empty_seeds": example_end_empty,
            "pairs": len(made.train) + len(made.test), "subjects": len(toy_corpus.SUBJECTS),
            "verbs": len(toy_corpus.VERBS), "train_seconds": toy_training_seconds()}


def toy_training_seconds() -> float:
    from attnscope.lab.translator import cached_folder

    return float(json.loads((cached_folder() / "training.json").read_text())["train_seconds"])


def pattern_evaluation(work: Path) -> dict[str, Any]:
    """``attnscope patterns --evaluate --json``: the classifier against the synthetic and labelled sets."""
    summary = last_json(attnscope("patterns", "--evaluate", "--json"))
    wanted = ("synthetic_macro_f1", "n_real", "real_macro_f1", "real_accuracy", "real_macro_f1_heldout",
              "n_real_heldout", "real_macro_f1_cv", "cv_folds", "real_kovaleva_macro_f1", "real_macro_f1_vs_second",
              "real_labeller_agreement", "real_macro_f1_agreed", "n_real_agreed", "stability",
              "synthetic_macro_f1_over_seeds", "real_macro_f1_cv_over_splits")
    return {key: summary[key] for key in wanted if key in summary}


STABILITY_MODELS = ("minilm", "smollm2", "gemma3", "qwen0.5b")


def label_stability(work: Path) -> dict[str, Any]:
    """``attnscope patterns --stability --model M --json``: how often each model's heads keep their label on
    held-out Brown sentences, and which label pairs flip."""
    return {model: last_json(attnscope("patterns", "--stability", "--model", model, "--json"))
            for model in STABILITY_MODELS}


SINK_MODEL_INPUTS = 200


def sink_report(work: Path) -> dict[str, Any]:
    """``attnscope sinks brown --model smollm2``: SmolLM2's sink figures and PNG, and how the classifier's ``sink``
    label agrees with the labelled SmolLM2 maps."""
    from attnscope import extract_corpus, load_model
    from attnscope.analysis.evaluate import SINK_MODEL, sink_agreement, sink_labels

    report = last_json(attnscope("sinks", "brown", "--model", SINK_MODEL, "--limit", str(SINK_MODEL_INPUTS), "-o",
                                 str(work), "--json"))
    copy_image(work / "sinks.png", "sinks_smollm2.png")
    summary, first = report["summary"], report["by_layer"]["first"]
    maps = sink_labels()
    records = list(extract_corpus(load_model(SINK_MODEL), [(m.text, None) for m in maps], batch_size=8, progress=False))
    quiet = [layer for layer, share in enumerate(first) if share < 0.25]  # layers that hardly use the sink
    return {"inputs": report["n_inputs"], "heads": summary["heads"], "layers": len(first),
            **{key: round(summary[key], 3) for key in ("mean_first", "mean_first_norm", "mean_other", "mean_other_norm",
                                                        "mean_other_rate")},
            "first_majority_heads": summary["first_majority_heads"],
            "first_majority_heads_norm": summary["first_majority_heads_norm"],
            "top_sink_tokens": [token for token, _ in summary["top_sink_tokens"][:4]],
            "quiet_layers": quiet, "busiest_layer": max(range(len(first)), key=first.__getitem__),
            "busiest_share": round(max(first), 3),
            "agreement": sink_agreement(records, maps)}


SINK_MODELS = ("smollm2", "gemma3", "qwen0.5b", "qwen1.5b")  # float32: bfloat16 is far slower on AVX2-only CPUs


def sink_models(work: Path) -> dict[str, Any]:
    """``attnscope sinks brown --model M`` for each of :data:`SINK_MODELS` on the same sentences: each model's
    summary and per-layer first-token share, and one figure of the curves side by side."""
    from attnscope.analysis.figures import sink_models_figure

    reports = {model: last_json(attnscope("sinks", "brown", "--model", model, "--limit", str(SINK_MODEL_INPUTS),
                                          "-o", str(work / model), "--json")) for model in SINK_MODELS}
    IMAGES.mkdir(parents=True, exist_ok=True)
    sink_models_figure({model: report["by_layer"] for model, report in reports.items()}, IMAGES / "sinks_models.png")
    figures = {}
    for model, report in reports.items():
        summary, first = report["summary"], report["by_layer"]["first"]
        figures[model] = {"inputs": report["n_inputs"], "layers": len(first), "heads": summary["heads"],
                          **{key: round(summary[key], 3) for key in ("mean_first", "mean_first_norm")},
                          "first_majority_heads": summary["first_majority_heads"],
                          "first_majority_heads_norm": summary["first_majority_heads_norm"],
                          "by_layer_first": [round(v, 3) for v in first],
                          "by_layer_first_norm": [round(v, 3) for v in report["by_layer"]["first_norm"]]}
    return figures


DOCUMENT = "sotu-1981-jimmy-carter"  # the longest shipped document: about 42,000 tokens
DOCUMENT_MODELS = {"smollm2": 8192, "gemma3": 32768, "qwen1.5b": 8192}  # tokens: each model's window, or 8,192
FAR = 512  # "far back": beyond Gemma 3's sliding window


def distance_off_the_sink(record: Any) -> Any:
    """``[layer, head]``: each head's mean distance over the keys after the first, weighted by the attention they
    get: the sum over rows of ``distance - first * q`` (the first token lies ``q`` back from query ``q``) over the
    sum of ``1 - first``. How far back a head reads when it does not rest on the sink."""
    import numpy as np

    first = np.asarray(record.statistics["first"], dtype=np.float64)  # [layer, head, row]
    distance = np.asarray(record.statistics["distance"], dtype=np.float64)
    positions = np.asarray(record.query_positions, dtype=np.float64)
    rest = np.nansum(1.0 - first, axis=-1)
    return np.nansum(distance - first * positions, axis=-1) / np.maximum(rest, 1e-12)


def whole_document(work: Path) -> dict[str, Any]:
    """``attnscope extract --document`` in statistics mode over the start of :data:`DOCUMENT` for each model of
    :data:`DOCUMENT_MODELS`: the first-token share, how far back the heads reach (mean distance per head, the
    share of attention farther than :data:`FAR` tokens back), and for sliding-window models the global layers
    apart."""
    import numpy as np

    from attnscope import AttentionRecord, partial_statistics

    figures = {}
    for model, tokens in DOCUMENT_MODELS.items():
        seconds, peak_mb = attnscope_measured("extract", "--model", model, "--document", DOCUMENT, "--stats",
                                              "--max-tokens", str(tokens), "--stream", "-o", str(work / model))
        record = AttentionRecord.open(next((work / model).glob("*.safetensors")))
        table = partial_statistics(record)
        far = [column for column in table.columns
               if column.startswith("dist_") and int(column[5:].partition("-")[0]) > FAR]
        table["far"] = table[far].sum(axis=1)
        table["off_sink"] = distance_off_the_sink(record).reshape(-1)  # the same [layer, head] order
        farthest = table.loc[table["distance"].idxmax()]
        readers = table[table["first"] < 0.5]  # heads that mostly read elsewhere than the sink
        farthest_off = readers.loc[readers["off_sink"].idxmax()]
        windows = np.array(record.model.windows or [0] * record.model.n_layers)
        global_layers = [layer for layer, window in enumerate(windows) if window == 0]
        figures[model] = {
            "tokens": len(record.tokens), "layers": record.model.n_layers, "heads": record.model.n_heads,
            "first": round(float(table["first"].mean()), 3),
            "first_majority_heads": int((table["first"] >= 0.5).sum()),
            "median_distance": round(float(table["distance"].median()), 1),
            "farthest": [int(farthest["layer"]), int(farthest["head"]), round(float(farthest["distance"]), 1),
                         round(float(farthest["first"]), 3)],
            "median_off_sink": round(float(table["off_sink"].median()), 1),
            "farthest_off_sink": [int(farthest_off["layer"]), int(farthest_off["head"]),
                                  round(float(farthest_off["off_sink"]), 1), round(float(farthest_off["first"]), 3)],
            "far_share": round(float(table["far"].mean()), 4),
            "sliding_layers": int((windows > 0).sum()), "window": int(windows.max()),
            "global_far_share": round(float(table[table["layer"].isin(global_layers)]["far"].mean()), 4),
            "seconds": round(seconds, 1), "peak_mb": round(peak_mb),
        }
    return figures


def corpus_report(work: Path) -> dict[str, Any]:
    """``attnscope heads brown``: the corpus report's figures, and its PNGs copied into docs/img."""
    import duckdb

    started = time.perf_counter()
    printed = attnscope("heads", "brown", "-o", str(work))
    seconds = time.perf_counter() - started
    clearest = dict(re.findall(r"^\s+(\w+)\s+clearest heads \(layer-head\): (\S+?)[,\n]", printed, re.MULTILINE))
    if "same_word" not in clearest:
        raise SystemExit(f"no clearest same_word head in the output of 'attnscope heads brown':\n{printed}")
    for name in ("analysis_patterns", "analysis_head_map", "analysis_token_types"):
        copy_image(work / f"{name}.png", f"{name}.png")
    copy_image(work / "example_same_word.png", "analysis_example_same_word.png")
    with duckdb.connect(str(work / "heads.duckdb"), read_only=True) as db:
        inputs, uniform = db.execute(  # [CLS] and one [SEP], or a second [SEP] with a pair
            "SELECT count(*), avg((CASE WHEN pair IS NULL THEN 2.0 ELSE 3.0 END) / n_tokens) FROM inputs").fetchall()[0]
        by_layer = db.execute("""SELECT avg(cls), avg(sep), avg(norm_cls), avg(norm_sep)
                                 FROM head_stats GROUP BY layer ORDER BY layer""").fetchall()
    columns = ("cls", "sep", "norm_cls", "norm_sep")
    per_layer = {name: [round(row[i], 3) for row in by_layer] for i, name in enumerate(columns)}
    middle = by_layer[1:-1]  # the layers between the first and the last
    return {"inputs": inputs, "seconds": round(seconds), "same_word_head": clearest["same_word"],
            # the share uniform attention would give the special tokens, mean over inputs
            "uniform_special_share": round(uniform, 3), "by_layer": per_layer,
            "middle_layers": [1, len(by_layer) - 2],
            **{f"middle_{name}": round(sum(row[i] for row in middle) / len(middle), 3)
               for i, name in enumerate(columns)}}


def ablation(work: Path) -> dict[str, Any]:
    """``attnscope ablate`` (every head of minilm, zeroed, cosine): the heatmap and its summary figures."""
    import pandas as pd

    printed = attnscope("ablate", "-o", str(work))
    copy_image(work / "ablation_heads.png", "ablation_heads.png")
    table = pd.read_csv(work / "ablation_heads.csv")
    examples = re.search(r"\((\d+) examples\)", printed)
    drop = table.assign(drop=-table["delta"]).groupby("layer")["drop"]
    last = int(table["layer"].max())
    per_layer = drop.mean()
    return {"examples": int(examples.group(1)) if examples else None,
            "cells": len(table), "last_layer": last,
            "last_layer_min_drop": round(float(drop.min()[last]), 2), "last_layer_max_drop": round(float(drop.max()[last]), 2),
            "last_over_layers_1_2": round(float(per_layer[last] / per_layer[[1, 2]].mean()))}


# "0-4": the edges group reports each probe's mean and range over five splits (``probe edges --seeds``). The
# recorded figures are of one split (seed 0); the group's command changes with this switch, so switch it when
# re-running the group (the tests check that the recorded command is the group's).
EDGES_SEEDS: str | None = "0-4"


def _edges_seeds() -> tuple[str, ...]:
    return ("--seeds", EDGES_SEEDS) if EDGES_SEEDS else ()


def probe(action: str, *options: str) -> Callable[[Path], dict[str, Any]]:
    """``attnscope probe ACTION --json [OPTIONS]``: its headline figures, wall time and PNGs."""
    images = {"deps": {"best_heads.png": "probing_deps_best_heads.png"}, "coref": {"coref_heads.png": "probing_coref_heads.png"},
              "edges": {"probes.png": "probing_edges.png"}}[action]

    def produce(work: Path) -> dict[str, Any]:
        started = time.perf_counter()
        headline = last_json(attnscope("probe", action, "-o", str(work), "--json", *options))
        for source, target in images.items():
            copy_image(work / source, target)
        return {**headline, "seconds": round(time.perf_counter() - started)}

    return produce


def generation(work: Path) -> dict[str, Any]:
    """``attnscope generate`` on SmolLM2 (chat, greedy): the first steps, and the same prompt under an
    intervention, side by side."""
    common = ("generate", GENERATE_PROMPT, "--chat", "-n", GENERATE_TOKENS, "--json")
    intact = last_json(attnscope(*common))
    compared = last_json(attnscope(*common, *GENERATE_CHANGES))
    return {"prompt": GENERATE_PROMPT, "new_tokens": int(GENERATE_TOKENS), "generated": intact["generated"],
            "first_steps": intact["steps"][:6], "changes_flags": " ".join(GENERATE_CHANGES), **compared}
def mixing_faithfulness(work: Path) -> dict[str, Any]:
    """``attnscope mixing --evaluate --json --plot``: the table, its figure, each model's ranking by rho
    with erasure, and whether the papers' ordering holds. Run with a fresh model cache (the GGUF
    conversion counted), so ``seconds`` is the time from a fresh install."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attnscope-cache-") as cache:
        table = last_json(attnscope("mixing", "--evaluate", "--json", "--plot", str(work / "mixing.png"),
                                    extra_env={"ATTNSCOPE_CACHE": cache}))
    copy_image(work / "mixing.png", "mixing_faithfulness.png")
    return {**mixing_summary(table), "seconds": round(time.perf_counter() - started)}


def mixing_summary(table: dict[str, Any]) -> dict[str, Any]:
    """The evaluation's table, with each model's ranking by rho with erasure and the papers' claims checked
    (value zeroing and ALTI above the rollout of raw attention; value zeroing first among the measures)."""
    from attnscope.analysis.mixing import METHODS

    ranking = {model: sorted(rows, key=lambda method: -rows[method]["spearman_erasure"]) for model, rows in table.items()}
    claims = {model: {"alti_above_attention": rows["alti"]["spearman_erasure"] > rows["attention"]["spearman_erasure"],
                      "value_zeroing_above_attention":
                          rows["value_zeroing"]["spearman_erasure"] > rows["attention"]["spearman_erasure"],
                      "value_zeroing_first": next(m for m in ranking[model] if m in METHODS) == "value_zeroing"}
              for model, rows in table.items()}
    from attnscope.experiments.faithfulness import DEFAULT_SENTENCES

    return {"table": table, "ranking": ranking, "claims": claims, "sentences": DEFAULT_SENTENCES}


ROUTES_PROMPT = "When Mary and John went to the store, John gave a drink to"


def route_example(work: Path) -> dict[str, Any]:
    """``attnscope routes`` on SmolLM2's indirect-object prompt: the picture (docs/img/routes_ioi.png), the graph's size
    and its five strongest attention edges."""
    page = work / "routes.html"
    attnscope("routes", "--model", "smollm2", ROUTES_PROMPT, "--png", "--json", "-o", str(page))
    copy_image(page.with_suffix(".png"), "routes_ioi.png")
    graph = json.loads(page.with_suffix(".json").read_text())
    tokens = graph["tokens"]
    attention = sorted((e for e in graph["edges"] if e["via"] == "attention"), key=lambda e: -e["importance"])[:5]
    return {"model": graph["model"], "tau": graph["tau"], "predicted": graph["predicted"], "tokens": len(tokens),
            "edges": len(graph["edges"]),
            "strongest": [{"layer": e["target"][0], "source": tokens[e["source"][1]], "source_position": e["source"][1],
                           "target": tokens[e["target"][1]], "target_position": e["target"][1],
                           "importance": round(e["importance"], 3),
                           "head": max(range(len(e["heads"])), key=lambda h: e["heads"][h])} for e in attention]}


# per built-in model: (first N EWT test sentences, first N GUM test documents); None = the whole split.
# The decoders run on a share so that `make docs-figures` stays within minutes on 2 shared cores
# (benchmarks/gold.py runs every model on the full splits); docs/probing.md says how many each one saw.
GOLD_MODELS: dict[str, tuple[int | None, int | None]] = {"minilm": (None, None), "smollm2": (300, 4),
                                                         "gemma3": (300, 4)}
GOLD_RELATIONS = ("det", "dobj", "pobj", "poss")
# True: each head is chosen on EWT/GUM dev (--select-on) and scored on test. The recorded figures of the group chose
# heads on test; the group's command changes with this switch, so switch it when re-running the group (the tests
# check that the recorded command is the group's). docs/bench/gold.json, when recorded, chooses on dev either way.
GOLD_SELECT_ON_DEV = False


class Skipped(Exception):
    """A producer cannot run here (its data is absent): the group keeps its last figures, nothing fails."""


def gold_files() -> dict[str, Path]:
    """EWT and GUM, test and dev, from ``../shared/data/ud`` (or $ATTNSCOPE_UD_DIR), or :class:`Skipped`."""
    sys.path.insert(0, str(ROOT / "src"))
    from attnscope.probing.gold import EWT_DEV, EWT_TEST, GUM_DEV, GUM_TEST, gold_file, missing_message

    names = {"ewt": EWT_TEST, "ewt_dev": EWT_DEV, "gum": GUM_TEST, "gum_dev": GUM_DEV}
    found = {key: gold_file(name) for key, name in names.items()}
    for key, path in found.items():
        if path is None:
            raise Skipped(missing_message(names[key]))
    return found  # type: ignore[return-value]


def gold(work: Path) -> dict[str, Any]:
    """Per built-in model: ``probe deps`` on UD EWT test (Clark et al.'s four relations) and ``probe
    coref`` on UD GUM test (gold chains), with their wall times; with :data:`GOLD_SELECT_ON_DEV`, each head
    chosen on the dev split (``--select-on``)."""
    files = gold_files()
    figures: dict[str, Any] = {}
    for model, (sentences, documents) in GOLD_MODELS.items():
        started = time.perf_counter()
        deps = last_json(attnscope("probe", "deps", "--conllu", str(files["ewt"]), *_select_on(files["ewt_dev"]),
                                   "--model", model, "-o", str(work / f"{model}-deps"), "--json",
                                   *_first("-n", sentences)))
        deps_seconds = time.perf_counter() - started
        coref = last_json(attnscope("probe", "coref", "--conllu", str(files["gum"]), *_select_on(files["gum_dev"]),
                                    "--model", model, "-o", str(work / f"{model}-coref"), "--json",
                                    *_first("--documents", documents)))
        figures[model] = {
            "sentences": deps["sentences"], "sentences_too_long": deps["sentences_too_long"], "causal": deps["causal"],
            "dev_sentences": deps.get("selection_sentences"),
            "deps": {relation: deps["by_direction"].get(relation, {}) for relation in GOLD_RELATIONS},
            "best": {relation: deps["best_head_acc"].get(relation) for relation in GOLD_RELATIONS},
            "coref": {key: coref[key] for key in ("documents", "mentions", "best_head", "best_head_acc", "ci",
                                                  "nearest_acc", "headword_acc", "rule_acc", "window_tokens",
                                                  "overlap_tokens", "left_out", "mean_candidates", "selected_on",
                                                  "oracle_head", "oracle_head_acc", "selection_mentions")
                      if key in coref},
            "deps_seconds": round(deps_seconds), "coref_seconds": round(time.perf_counter() - started - deps_seconds)}
        print(f"  {model}: {figures[model]['deps_seconds']} s + {figures[model]['coref_seconds']} s", flush=True)
    return {"models": figures, **{key: path.name for key, path in files.items()}}


def _first(flag: str, n: int | None) -> list[str]:
    return [] if n is None else [flag, str(n)]


def _select_on(dev: Path | str) -> list[str]:
    return ["--select-on", str(dev)] if GOLD_SELECT_ON_DEV else []


def _gold_command() -> str:
    share = "; ".join(f"{model}" + ("" if n is None else f" -n {n}") + ("" if d is None else f" / --documents {d}")
                      for model, (n, d) in GOLD_MODELS.items())
    ud = "../shared/data/ud"
    ewt_dev, gum_dev = ("".join(f"{arg} " for arg in _select_on(f"{ud}/{name}"))
                        for name in ("ewt-en_ewt-ud-dev.conllu", "gum-en_gum-ud-dev.conllu"))
    return (f"attnscope probe deps --conllu {ud}/ewt-en_ewt-ud-test.conllu {ewt_dev}--model M --json; "
            f"attnscope probe coref --conllu {ud}/gum-en_gum-ud-test.conllu {gum_dev}--model M --json (M: {share})")


def gold_tables(figures: dict[str, Any], bench: dict[str, Any]) -> dict[str, Any]:
    """What the gold tables show: ``docs/bench/gold.json`` (``benchmarks/gold.py --record``: every model on the
    full splits, heads chosen on dev) when it is there, else the ``gold`` group of ``docs/figures.json``; both in
    the group's shape (``{figures: {models, ewt, gum}, cpu, source, dev}``). ``dev``: every head was chosen on the
    dev split (older figures chose it on test, and the tables then say so)."""
    if "gold" in bench:
        recorded = bench["gold"]["figures"]
        models = {m.get("model", name): _gold_model_from_bench(m) for name, m in recorded.items()
                  if isinstance(m, dict) and "deps" in m}  # by the alias a reader types (qwen0.5b, not qwen)
        table = {"figures": {"models": models, "ewt": recorded["ewt"], "gum": recorded["gum"]},
                 "cpu": bench["gold"]["cpu"], "source": "bench"}
    else:
        table = {**figures["gold"], "source": "docs-figures"}
    rows = [b for m in table["figures"]["models"].values() for b in [*m["best"].values(), m["coref"]] if b]
    return {**table, "dev": all(row.get("selected_on") == "dev" for row in rows)}


def _gold_model_from_bench(m: dict[str, Any]) -> dict[str, Any]:
    """One model of ``benchmarks/gold.py``'s figures in the ``gold`` group's shape."""
    best = {relation: {"head": r["head"], "acc": r["head_acc"], "ci": r["ci"], "baseline": r["offset_acc"],
                       "arcs": r["n"], "direction": r["direction"], "selected_on": r["selected_on"],
                       "oracle_head": r["oracle_head"], "oracle_head_acc": r["oracle_head_acc"]}
            for relation, r in m["deps"].items()}
    return {"sentences": m["deps_test_sentences"], "sentences_too_long": m["deps_too_long"], "causal": m["causal"],
            "dev_sentences": m["deps_dev_sentences"], "best": {relation: best.get(relation) for relation in GOLD_RELATIONS},
            "coref": {**m["coref"], "mentions": m["coref_mentions"], "selection_mentions": m["coref_dev_mentions"]},
            "deps_seconds": round(m["deps_s"]), "coref_seconds": round(m["coref_s"]), "peak_mb": m["peak_rss_mb"]}


HEAD_LIST_TOP = 3  # heads per score on the page


def head_lists(work: Path) -> dict[str, Any]:
    """The shipped head-function lists (``scripts/head_lists.py`` measured them; this only reads their summaries,
    :func:`attnscope.data.head_list_summary`): per model, the sets' grid, the counted trials, each score's stability,
    the retrieval share above 0.1 and the top heads."""
    from attnscope.data import head_list, head_list_summary
    from attnscope.data import head_lists as shipped

    figures = {}
    for alias in shipped():
        found, table = head_list_summary(alias), head_list(alias)
        above = table[table["retrieval"] > found["retrieval"]["threshold"]]
        a = found["sets"]["a"]["settings"]
        windowed = sorted({w for w in found["windows"] if w})
        figures[alias] = {
            "model": found["model"], "layers": found["layers"], "heads": found["heads"], "kv_heads": found["kv_heads"],
            "windowed_layers": [layer for layer, w in enumerate(found["windows"]) if w], "window_sizes": windowed,
            "needle_lengths": a["needle_lengths"], "needle_depths": a["needle_depths"], "max_tokens": a["max_tokens"],
            "trials": found["trials"]["total"], "counted": found["trials"]["counted"],
            "counted_a": found["trials"]["counted_a"], "counted_b": found["trials"]["counted_b"],
            "retrieval_share": found["retrieval"]["share_above"], "retrieval_heads": len(above),
            "retrieval_heads_global": int((above["window"] == 0).sum()),
            "rho": {name: value["rho"] for name, value in found["stability"].items()},
            "top": {name: heads[:HEAD_LIST_TOP] for name, heads in found["top"].items()},
            "cpu": found["cpu"], "date": found["date"], "seconds": found["seconds"],
            "checks": {name: masking_check(check) for name, check in found.get("checks", {}).items()}}
    return figures


def masking_check(check: dict[str, Any]) -> dict[str, Any]:
    """One recorded masking check of a list (``scripts/head_checks.py``): its settings and, per k and set of heads
    (``top``, ``random``, ``bottom``, ``top - random``), the change with its interval."""
    rows: dict[str, dict[str, list[float]]] = {}
    for row in check["summary"]:
        rows.setdefault(str(row["k"]), {})[row["heads"]] = [row["change"], row["ci_low"], row["ci_high"]]
    return {"column": check["column"], "metric": check["metric"], "baseline": check["baseline"],
            "n_examples": check["n_examples"], "draws": check["random_draws"], "ks": check["ks"], "rows": rows,
            "date": check["date"], "cpu": check["cpu"], "seconds": check["seconds"]}


@dataclass(frozen=True)
class Group:
    command: str  # what a reader would type to get the same figures
    produce: Callable[[Path], dict[str, Any]]
    timings: tuple[str, ...] = ()  # figures that are wall times: machine-dependent, not compared by the tests


GROUPS: dict[str, Group] = {
    "example": Group(f'attnscope.extract(load_model("minilm"), "{EXAMPLE_TEXT}", "{EXAMPLE_PAIR}", norms=True)',
                     example_shape),
    "views": Group(f"attnscope view <first {LONG_INPUT_SENTENCES} Brown sentences, cut to 512 tokens> "
                   "[--kind head --no-norms]", view_sizes),
    "toy": Group(f'attnscope toy evaluate --seeds 0-{TOY_SEEDS[-1]} --json; attnscope toy corrupt "{TOY_EXAMPLE}" '
                 '(each seed)', toy_translator, ("train_seconds",)),
    "patterns": Group("attnscope patterns --evaluate --json", pattern_evaluation),
    "stability": Group(f"attnscope patterns --stability --model M --json (M: {', '.join(STABILITY_MODELS)})",
                       label_stability),
    "sinks": Group(f"attnscope sinks brown --model smollm2 --limit {SINK_MODEL_INPUTS} -o out/ --json; "
                   "sink_agreement on labels/smollm2_sinks.tsv", sink_report),
    "sinks_models": Group(f"attnscope sinks brown --model M --limit {SINK_MODEL_INPUTS} -o out/ --json "
                          f"(M: {', '.join(SINK_MODELS)})", sink_models),
    "document": Group(f"attnscope extract --model M --document {DOCUMENT} --stats --max-tokens N --stream -o out/ "
                      f"(M N: {'; '.join(f'{m} {n}' for m, n in DOCUMENT_MODELS.items())})", whole_document),
    "corpus": Group("attnscope heads brown -o report/", corpus_report, ("seconds",)),
    "ablation": Group("attnscope ablate -o out/", ablation),
    "generate": Group(f'attnscope generate "{GENERATE_PROMPT}" --chat -n {GENERATE_TOKENS} --json '
                      f'[{" ".join(GENERATE_CHANGES)}]', generation),
    "deps": Group("attnscope probe deps -o out/deps --json", probe("deps"), ("seconds",)),
    "coref": Group("attnscope probe coref -o out/coref --json", probe("coref"), ("seconds",)),
    "edges": Group(" ".join(("attnscope probe edges -o out/edges --json", *_edges_seeds())), probe("edges", *_edges_seeds()),
                   ("seconds",)),
    "mixing": Group("attnscope mixing --evaluate --json", mixing_faithfulness, ("seconds",)),
    "routes": Group(f'attnscope routes --model smollm2 "{ROUTES_PROMPT}" --png --json', route_example),
    "gold": Group(_gold_command(), gold),
    "head_lists": Group("python scripts/head_lists.py; python scripts/head_checks.py (each model's "
                        "data/head_lists/<alias>.json, read)", head_lists),
}


def run_group(name: str) -> dict[str, Any]:
    """Run one group's producer: ``{command, date, cpu, seconds, figures}``."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"docs-figures-{name}-") as work:
        figures = GROUPS[name].produce(Path(work))
    return {"command": GROUPS[name].command, "date": date.today().isoformat(), "cpu": cpu_name(),
            "seconds": round(time.perf_counter() - started, 1), "figures": figures}


def compared(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """A group's figures without its wall times (what must be reproduced exactly)."""
    return {key: value for key, value in figures.items() if key not in GROUPS[name].timings}


# ---- rendering ---------------------------------------------------------------------------------------
def load_figures() -> dict[str, Any]:
    return json.loads(FIGURES.read_text()) if FIGURES.exists() else {}


def load_bench() -> dict[str, Any]:
    """``docs/bench/NAME.json`` -> NAME: ``{figures, cpu, date, command}`` as the benchmarks wrote them."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(BENCH.glob("*.json"))}


def _first_words(text: str, n: int) -> str:
    """The first ``n`` words of ``text``, then " ..." if there were more."""
    words = text.split()
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


# why a model type was refused, by a phrase of its one-line refusal (benchmarks/architectures.py)
REFUSAL_KINDS = (
    ("has no attention module where attnscope looks", "no attention module where attnscope looks (an adapter row)"),
    ("never called attnscope's attention function", "attention computed inside the model's own forward (a bridge)"),
    ("learned attention sinks", "learned attention sinks (s_aux), not computed yet"),  # before attnscope computed them
    ("different numbers of keys", "layers over keys that are not tokens (compressed key/value entries)"),
    ("more than once per forward pass", "a layer that runs more than once per forward pass"),
    ("would both be", "two stacks of layers with the same layer numbers"),
    ("different numbers of heads", "layers with different numbers of heads"),
    ("did not find it among the model's attention modules", "attention from a module the adapter does not name"),
    ("records cannot hold", "attention over positions that are no input tokens (global tokens, pooled ones, prompts)"),
    ("blocks of keys their indexer selects", "a sparse-attention indexer's key blocks, handed over as indices"),
    ("block-sparse attention", "block-sparse attention over random blocks (full attention is captured)"),
)


def refusals_by_kind(refused: dict[str, str]) -> list[tuple[str, list[str]]]:
    """``{model type: refusal}`` -> ``[(kind of refusal, [model types])]``, largest kind first."""
    kinds: dict[str, list[str]] = {}
    for model_type, reason in sorted(refused.items()):
        kind = next((label for phrase, label in REFUSAL_KINDS if phrase in reason), reason.split(";")[0])
        kinds.setdefault(kind, []).append(model_type)
    return sorted(kinds.items(), key=lambda item: -len(item[1]))


def _environment() -> Any:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    environment = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, keep_trailing_newline=True,
                              autoescape=False,  # Markdown, not HTML
                              extensions=["jinja2.ext.do"])
    environment.filters["fmt"] = lambda value, spec: format(value, spec)
    environment.filters["pct"] = lambda share, digits=1: f"{100 * share:.{digits}f}%"
    # an interval of a mean accuracy, recorded as a t-interval before it was clipped to what an accuracy can be
    environment.filters["accuracy_bound"] = lambda bound: bound if math.isnan(bound) else min(1.0, max(0.0, bound))
    environment.filters["words"] = _first_words
    environment.filters["refusals_by_kind"] = refusals_by_kind
    environment.filters["token"] = lambda token: json.dumps(token, ensure_ascii=False)  # quoted, "\n" visible
    return environment


def render_region(name: str, figures: dict[str, Any], bench: dict[str, Any]) -> str:
    """The text of region ``name``: its template with every group's figures (``toy.figures.exact_match``...)."""
    text = _environment().get_template(f"{name}.md").render(**figures, bench=bench,
                                                            gold_tables=lambda: gold_tables(figures, bench))
    return text if text.endswith("\n") else text + "\n"


def pages() -> list[Path]:
    """The Markdown files that may hold generated regions: README.md and the site's pages ``docs/*.md``."""
    return [README, *sorted(DOCS.glob("*.md"))]


def render_page(text: str, figures: dict[str, Any], bench: dict[str, Any]) -> str:
    """``text`` (a page's Markdown) with every generated region replaced by its rendering."""
    return REGION.sub(lambda m: m.group(1) + render_region(m.group("name"), figures, bench) + m.group(4), text)


def region_names(text: str) -> list[str]:
    return [match.group("name") for match in REGION.finditer(text)]


def render_pages(figures: dict[str, Any], bench: dict[str, Any]) -> list[str]:
    """Render the regions of every page in place: the regions' names."""
    names = []
    for path in pages():
        text = path.read_text(encoding="utf-8")
        rendered = render_page(text, figures, bench)
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
        names += region_names(rendered)
    return names


# ---- command line -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", metavar="GROUP", help=f"groups to re-run (default: all): {', '.join(GROUPS)}")
    parser.add_argument("--render", action="store_true",
                        help="only render the README and the pages docs/*.md from docs/figures.json")
    parser.add_argument("--list", action="store_true", help="list the groups and their commands")
    args = parser.parse_args(argv)
    unknown = set(args.groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s) {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}")
    if args.list:
        for name, group in GROUPS.items():
            print(f"{name:10s} {group.command}")
        return 0
    figures, failed = load_figures(), []
    for name in [] if args.render else (args.groups or list(GROUPS)):
        print(f"{name}: {GROUPS[name].command}", flush=True)
        try:
            figures[name] = run_group(name)
        except Skipped as reason:
            print(f"  skipped, its figures are left as they were: {reason}", flush=True)
            continue
        except (Exception, SystemExit) as error:  # noqa: BLE001 - report it, keep the group's last figures, go on
            failed.append(name)
            print(f"  FAILED, its figures are left as they were: {error}", flush=True)
            continue
        print(f"  {figures[name]['seconds']} s", flush=True)
        FIGURES.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")  # keep what is done so far
    names = render_pages(figures, load_bench())
    print(f"rendered {', '.join(names)} into README.md and docs/*.md")
    if failed:
        print(f"failed: {', '.join(failed)} (the pages quote their previous figures)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
