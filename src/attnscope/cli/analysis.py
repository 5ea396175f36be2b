"""``attnscope patterns``: a thin wrapper around the pattern classifier (the corpus commands ``heads`` and
``sinks`` are in :mod:`attnscope.cli.corpus`)."""

from __future__ import annotations

import argparse
import json

from ..analysis.evaluate import STABILITY_INPUTS
from ..analysis.patterns import PATTERNS, STABLE_MIN_INPUTS, STABLE_SHARE
from ..errors import AttnscopeError
from .command import Command
from .model_options import add_model_arguments, load_from_args


# ---- patterns -------------------------------------------------------------------------------
def _patterns_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="?", help="the text (first sentence)")
    parser.add_argument("--pair", "-p", help="second sentence")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--evaluate", action="store_true",
                        help="score the classifier on the synthetic and the labelled real maps (needs the default "
                        "model) instead of classifying TEXT")
    parser.add_argument("--stability", action="store_true",
                        help="how often each head of --model keeps its most common label over held-out Brown "
                        "sentences (none of them used to build the labels), and which label pairs flip")
    parser.add_argument("--inputs", type=int,
                        help=f"sentences for --stability (default {STABILITY_INPUTS})")
    add_model_arguments(parser)


def _run_patterns(args: argparse.Namespace) -> int:
    if args.inputs is not None and not args.stability:
        raise AttnscopeError("--inputs counts the sentences of --stability; add --stability or drop --inputs")
    if args.evaluate:
        return _run_evaluation(args)
    if args.stability:
        return _run_stability(args)
    if args.text is None:
        raise AttnscopeError("give a TEXT to classify, --evaluate or --stability")
    from ..analysis.patterns import classify_heads
    from ..capture.extract import extract
    from ..capture.tokens import split_item

    split_item((args.text, args.pair), 0)  # reject bad input before the model loads
    record = extract(load_from_args(args), args.text, args.pair)
    patterns = classify_heads(record)
    if args.json:
        print(patterns.to_frame().to_json(orient="records"))
        return 0
    info = record.model
    print(f"model {info.name}: {info.n_layers} layers x {info.n_heads} heads, {len(record.tokens)} tokens"
          f"{' (causal templates)' if info.causal else ''}\n")
    print(patterns.to_text())
    return 0


def _run_evaluation(args: argparse.Namespace) -> int:
    from ..analysis.evaluate import evaluate_classifier
    from ..capture.extract import extract_corpus
    from ..models.registry import DEFAULT_MODEL

    if args.model != DEFAULT_MODEL:
        raise AttnscopeError(f"the labelled real maps are of the default model; drop --model (got {args.model!r})")
    loaded = load_from_args(args)
    summary = evaluate_classifier(lambda items: extract_corpus(loaded, items, progress=False))
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"synthetic set: macro-F1 {summary['synthetic_macro_f1']:.3f} over {summary['n_synthetic']} maps "
          f"(bidirectional {summary['synthetic_macro_f1_by_kind']['bidirectional']:.3f}, "
          f"causal {summary['synthetic_macro_f1_by_kind']['causal']:.3f})")
    print(f"real set: macro-F1 {summary['real_macro_f1']:.3f} over {summary['n_real']} labelled maps of the default "
          f"model (first labelling pass: {summary['real_macro_f1_first_pass']:.3f}; held-out batch: "
          f"{summary['real_macro_f1_heldout']:.3f} over {summary['n_real_heldout']} maps)")
    agreement = summary.get("real_labeller_agreement")
    if agreement:
        print(f"two labellers on the same {agreement['n']} maps: {agreement['accuracy']:.0%} alike, kappa "
              f"{agreement['kappa']:.2f}, macro-F1 {agreement['macro_f1']:.3f} one against the other (what the "
              f"labels leave open); the classifier against the second: {summary['real_macro_f1_vs_second']:.3f}")
    print(f"the same as Kovaleva et al.'s five types: synthetic {summary['synthetic_kovaleva_macro_f1']:.3f}, "
          f"real {summary['real_kovaleva_macro_f1']:.3f}")
    stability = summary["stability"]
    print(f"stable heads ({stability['stable_rule']}, {stability['n_stability_deciding']} Brown sentences): "
          f"{stability['n_stable_heads']} of {stability['n_heads']}; on {stability['n_stability_heldout']} held-out "
          f"sentences they keep their label on {_share(stability['stable_heldout_share'])} of inputs (all heads' "
          f"most common label: {_share(stability['heldout_modal_share_all'])})\n")
    for name in ("synthetic", "real"):
        print(f"{name}: {'class':26s} precision recall    f1  support")
        for label, values in summary[f"{name}_per_class"].items():
            print(f"{'':{len(name) + 2}}{label:26s} {values['precision']:9.2f} {values['recall']:6.2f} "
                  f"{values['f1']:5.2f} {values['support']:8d}")
        print()
    return 0


def _run_stability(args: argparse.Namespace) -> int:
    from ..analysis.evaluate import label_stability, stability_heldout_texts
    from ..capture.extract import extract_corpus

    available = stability_heldout_texts(None)
    n_inputs = STABILITY_INPUTS if args.inputs is None else args.inputs
    if not STABLE_MIN_INPUTS <= n_inputs <= len(available):
        raise AttnscopeError(f"--inputs must be between {STABLE_MIN_INPUTS} and {len(available)} (the held-out Brown "
                             f"sentences), got {n_inputs}")
    texts = available[:n_inputs]
    loaded = load_from_args(args)
    summary = {"model": args.model, **label_stability(extract_corpus(loaded, [(t, None) for t in texts]))}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{args.model}: {summary['heads']} heads over {summary['inputs']} held-out Brown sentences "
          f"(stable: {summary['stable_rule']})")
    print(f"stable heads {_share(summary['stable_share'])}; mixed (two labels carry >= {STABLE_SHARE:.0%}) "
          f"{_share(summary['mixed_share'])}; stable at Kovaleva's five types {_share(summary['kovaleva_stable_share'])}")
    for flip in summary["flips"]:
        first, second = flip["pair"]
        mass = flip["column_mass"]
        print(f"  {first} <-> {second}: {flip['heads']} heads; strongest column's mass {mass[first]:.2f} when "
              f"{first}, {mass[second]:.2f} when {second}")
    return 0


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


_PATTERN_LIST = ", ".join(PATTERNS)

COMMANDS = (
    Command("patterns", "classify what every head does (Kovaleva's types, Vig's patterns)", f"""labels: {_PATTERN_LIST}
examples:
  attnscope patterns "I went to the store." --pair "At the store, I bought fresh strawberries."
  attnscope patterns "The cat sat on the mat." --model smollm2      # causal templates
  attnscope patterns "The cat sat." --json
  attnscope patterns --evaluate --json        # precision/recall/F1 on the synthetic and labelled real maps
  attnscope patterns --stability --model smollm2   # how often each head keeps its label on unseen sentences""",
            _patterns_arguments, _run_patterns),
)
