"""``attnscope probe deps|coref|edges``: parse arguments, run one probe, write its files, print the figures."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..arguments import add_output_folder, finite_float, positive_int, seed
from ..errors import AttnscopeError
from .command import Command
from .lab import seed_list
from .model_options import add_model_arguments, load_from_args


def _common(parser: argparse.ArgumentParser, action: str) -> None:
    add_model_arguments(parser)
    add_output_folder(parser, f"probe_{action}", "tables, charts and index.html")
    parser.add_argument("--batch-size", type=positive_int,
                        help="inputs per forward pass (default: 16 sentences; coref --conllu: 2 windows)")
    parser.add_argument("--json", action="store_true", help="print the headline figures as one JSON object (last line)")


def _trees(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--conllu", type=Path, help="a CoNLL-U treebank (e.g. Universal Dependencies), taken as gold")
    source.add_argument("--text", type=Path,
                        help="raw text, one sentence per line, parsed by spaCy (silver; needs attnscope[probing])")
    parser.add_argument("-n", "--sentences", type=positive_int,
                        help="use the first N sentences (default: all; the shipped sample has 1,000)")


def _select_on(parser: argparse.ArgumentParser, data: str) -> None:
    parser.add_argument("--select-on", type=Path, metavar="DEV_FILE",
                        help=f"CoNLL-U {data} (e.g. the dev split) on which each best head is chosen; it is then "
                        "scored on the other data, with the best head there beside it as an upper bound (oracle). "
                        "Without it the head is chosen on the data it is scored on, which the output says")


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    deps = actions.add_parser("deps", help="best head per dependency relation vs the fixed-offset baseline",
                              description="Per relation, head and direction (dependent->head, head->dependent): "
                              "how often the most-attended word is the arc's other end (Clark et al. 2019), on "
                              "word-level attention (sum over the attended word's pieces, mean over the attending "
                              "word's), against the best fixed offset on the same arcs, with a 95% interval. UD "
                              "files: multiword tokens give their words, empty nodes are skipped; each arc is "
                              "counted under its relation (nmod:poss), its base with subtypes (nmod:*) and Clark "
                              "et al.'s name where one maps (obj=dobj, nmod:poss=poss, obl/nmod with a case "
                              "preposition=pobj from the nominal to the preposition). Decoders: a direction "
                              "counts only the arcs where it points backwards. Sentences longer than the model's "
                              "limit are skipped and counted.")
    _trees(deps)
    deps.add_argument("--min-arcs", type=positive_int, default=50,
                      help="relations with fewer arcs stay out of the chart and JSON (default: 50)")
    _select_on(deps, "with gold dependencies")
    _common(deps, "deps")
    coref = actions.add_parser("coref", help="coreference heads: gold chains in whole documents, or Winograd schemas",
                               description="With --conllu (gold chains in MISC Entity=, e.g. UD English GUM): for "
                               "each mention with an earlier mention of its chain in the model's window, does a "
                               "head's most-attended earlier mention belong to the chain? Baselines: nearest "
                               "mention, same head word, rule-based sieves (Clark et al. 2019). Documents are read "
                               "in windows of --window tokens overlapping by half; each mention is scored once, "
                               "with at least the overlap as left context. Without --conllu: how often a pronoun "
                               "attends more to its antecedent than to the other candidate (273 Winograd items "
                               "from BIG-bench winowhy).", formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="examples:\n  attnscope probe coref --conllu en_gum-ud-test.conllu -o out/gum\n"
                               "  attnscope probe coref --conllu en_gum-ud-test.conllu --model smollm2 --documents 3\n"
                               "  attnscope probe coref --items my_items.jsonl -o out/wino")
    source = coref.add_mutually_exclusive_group()
    source.add_argument("--conllu", type=Path, help="CoNLL-U with gold coreference (CorefUD MISC Entity=, e.g. GUM)")
    source.add_argument("--items", type=Path,
                        help='your own Winograd-style items, .jsonl lines {"sentence", "pronoun", "antecedent", "wrong"}')
    coref.add_argument("--window", type=positive_int, default=512,
                       help="tokens per window with --conllu (default: 512, at most the model's limit)")
    coref.add_argument("--documents", type=positive_int, help="with --conllu: only the first N documents")
    _select_on(coref, "with gold coreference, with --conllu")
    coref.add_argument("--singletons", action="store_true",
                       help="with --conllu: singleton mentions are candidates too (default: only mentions of chains, "
                       "as CoNLL-2012)")
    _common(coref, "coref")
    edges = actions.add_parser("edges", help="attention-only probes: edge, relation, parser (UAS) with baselines",
                               description="Logistic regressions on all heads' attention between two words "
                               "(Coenen et al. 2019; Clark et al. 2019's attention-only parser).")
    _trees(edges)
    edges.add_argument("--no-reinit", action="store_true",
                       help="skip the re-initialised-weights baseline (saves a second pass over the corpus)")
    edges.add_argument("--test-share", type=finite_float, default=0.2, help="share of sentences held out (default: 0.2)")
    edges.add_argument("--seed", type=seed, default=0,
                       help="seed of the split, pair sampling and re-init (default: 0)")
    edges.add_argument("--seeds", type=seed_list, metavar="SEEDS",
                       help="one split and pair sample per seed (e.g. 0-4), each figure reported as its mean and range "
                       "over them; the model runs once, the re-initialised one with the first seed (default: --seed)")
    _common(edges, "edges")


def _run_probe(args: argparse.Namespace) -> int:
    from .outputs import output_folder

    run = {"deps": _deps, "coref": _coref, "edges": _edges}[args.action]
    with output_folder(args.out, overwrite=args.overwrite, command=f"probe {args.action}"):
        headline = run(args)
    if args.json:
        print(json.dumps(headline))
    return 0


def _treebank(args: argparse.Namespace) -> Any:
    from ..probing.treebank import load_treebank

    return load_treebank(args.conllu, args.text, args.sentences)


def _deps(args: argparse.Namespace) -> dict[str, Any]:
    from ..probing.run import probe_dependencies

    treebank = _treebank(args)  # bad files fail before the model loads
    dev = _select_on_treebank(args)
    result = probe_dependencies(load_from_args(args), treebank, batch_size=args.batch_size or 16,
                                min_arcs=args.min_arcs, progress=not args.json, select_on=dev)
    page = result.save(args.out)
    headline = result.headline()
    print(f"heads: {result.annotation}\n{headline['sentences']} sentences, {headline['arcs']} arcs "
          f"({headline['arcs_left_out']} left out: a word had no word piece; {headline['sentences_too_long']} "
          f"sentences left out: longer than the model's limit); layer-head names are 0-indexed"
          + ("; decoder: only arcs pointing backwards in a direction are scored in it" if headline["causal"] else ""))
    print(f"selection: {result.selection_note()}")
    columns = ["relation", "arcs", "best_head", "direction", "accuracy", "ci_low", "ci_high"]
    if dev is not None:
        columns += ["selected_on", "selection_accuracy", "oracle_head", "oracle_accuracy"]
    print(result.best_heads().to_string(index=False, float_format=lambda v: f"{v:.3f}",
                                        columns=[*columns, "baseline_offset", "baseline_accuracy"]))
    print(f"summary: {page}")
    return headline


def _chains(args: argparse.Namespace) -> dict[str, Any]:
    from ..probing.documents import first_documents, require_entities
    from ..probing.run import probe_chains
    from ..probing.treebank import read_conllu

    treebank = require_entities(first_documents(read_conllu(args.conllu), args.documents))  # before the model loads
    dev = _select_on_treebank(args, require_entities)
    result = probe_chains(load_from_args(args), treebank, window=args.window, singletons=args.singletons,
                          batch_size=args.batch_size or 2, progress=not args.json, select_on=dev)
    page = result.save(args.out)
    h = result.headline()
    left_out = ", ".join(f"{n} {reason}" for reason, n in h["left_out"].items()) or "none"
    print(f"{h['documents']} documents, {h['windows']} windows of {h['window_tokens']} tokens (overlap "
          f"{h['overlap_tokens']}); {h['mentions']} mentions scored (left out: {left_out}); "
          f"layer-head names are 0-indexed\n"
          f"selection: {h['selection']}\n"
          f"head {h['best_head']}: {h['best_head_acc']:.3f} (95% interval {h['ci'][0]:.3f}-{h['ci'][1]:.3f})"
          + ("" if dev is None else f"; oracle {h['oracle_head']}: {h['oracle_head_acc']:.3f} (upper bound)") + "; "
          f"nearest mention {h['nearest_acc']:.3f}; same head word {h['headword_acc']:.3f}; "
          f"rule-based {h['rule_acc']:.3f}\nsummary: {page}")
    return h


def _coref(args: argparse.Namespace) -> dict[str, Any]:
    from ..probing.run import probe_coref

    if args.conllu:
        return _chains(args)
    if args.select_on:
        raise AttnscopeError("--select-on needs --conllu: Winograd items have no dev split to choose a head on")
    items = _read_items(args.items) if args.items else None
    result = probe_coref(load_from_args(args), items, batch_size=args.batch_size or 16)
    page = result.save(args.out)
    headline = result.headline()
    print(f"{headline['items']} items scored, left out: {headline['items_left_out'] or 'none'}"
          f" (+{headline['items_unaligned']} without word pieces); layer-head names are 0-indexed\n"
          f"best head {headline['best_head']} (chosen on the items it is scored on): "
          f"{headline['best_head_acc']:.3f} (permutation p = "
          f"{headline['best_head_p_value']:.3g}, max over heads); nearest mention "
          f"{headline['nearest_mention_acc']:.3f}; same head word {headline['same_head_word_acc']:.3f}\n"
          f"summary: {page}")
    return headline


def _edges(args: argparse.Namespace) -> dict[str, Any]:
    from ..probing.run import probe_edges

    if not 0 < args.test_share < 1:
        raise AttnscopeError("--test-share must be between 0 and 1")
    treebank = _treebank(args)
    result = probe_edges(load_from_args(args), treebank, batch_size=args.batch_size or 16, reinit=not args.no_reinit,
                         test_share=args.test_share, seed=args.seed, seeds=args.seeds)
    page = result.save(args.out)
    print(f"heads: {result.annotation}")
    if len(result.seeds) > 1:
        print(f"seeds {', '.join(map(str, result.seeds))}: one split each; test_accuracy is the mean, min and max the "
              "range over them")
    print(result.to_frame().to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"summary: {page}")
    return result.headline()


def _select_on_treebank(args: argparse.Namespace, check: Callable[[Any], Any] | None = None) -> Any:
    """The ``--select-on`` treebank (passed through ``check``), read before the model loads, or None; a bad file is
    one clear line that names the option."""
    from ..probing.treebank import load_treebank

    if args.select_on is None:
        return None
    try:
        treebank = load_treebank(args.select_on)
        return treebank if check is None else check(treebank)
    except AttnscopeError as error:
        raise AttnscopeError(f"--select-on: {error}") from None


def _read_items(path: Path) -> list[Any]:
    from ..files import parse_json, read_text
    from ..probing.coref import CorefItem

    lines = read_text(path).splitlines()
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line)
            items.append(CorefItem(str(row["sentence"]), str(row["pronoun"]), str(row["antecedent"]),
                                   None if row.get("wrong") is None else str(row["wrong"]), int(row.get("id", number))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise AttnscopeError(f'{path} line {number}: expected {{"sentence", "pronoun", "antecedent", "wrong"}}') \
                from None
    if not items:
        raise AttnscopeError(f"{path} holds no items")
    return items


COMMANDS = (
    Command("probe", "linguistic probing of heads: dependency relations, coreference, attention-only probes",
            """actions:
  deps    best head per dependency relation (both directions) vs the best fixed-offset baseline
  coref   coreference heads: gold chains of whole documents (--conllu, e.g. GUM) or 273 Winograd schemas
  edges   logistic-regression probes on all heads' attention: edge, relation, parser UAS

examples:
  attnscope probe deps -o out/deps                      # shipped sample: 1,000 Brown sentences, spaCy (silver)
  attnscope probe deps --conllu en_ewt-ud-test.conllu --select-on en_ewt-ud-dev.conllu -o out/ewt --json
  attnscope probe deps --text my_sentences.txt --model smollm2 -o out/smol
  attnscope probe coref -o out/coref --json
  attnscope probe coref --conllu en_gum-ud-test.conllu --select-on en_gum-ud-dev.conllu --model smollm2 -o out/gum
  attnscope probe edges -o out/edges -n 300 --no-reinit
  attnscope probe edges -o out/edges --seeds 0-4         # mean and range over 5 splits
Each writes CSV tables, one .duckdb database, PNG charts and index.html. Layers and heads are 0-indexed.""",
            _probe_arguments, _run_probe),
)
