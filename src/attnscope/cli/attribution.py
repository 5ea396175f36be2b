"""Attribution commands: ``attnscope routes`` (information-flow routes of one prediction) and ``attnscope qk``
(why a head attends where it does: one score split into query x key component pairs)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ..arguments import finite_float, non_negative_int, positive_int, seed
from ..errors import AttnscopeError
from .command import Command
from .model_options import add_model_arguments, load_from_args

DEFAULT_TAU = 0.04  # attribution.routes.TAU, repeated so that --help imports no torch (a test holds them equal)
CHECK_FOLDER = "routes_check"
CHECK_FILES = "routes_check.json, .png and .svg"


def _position(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token position (an integer, -1 = last), got {value!r}") from None


def _routes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="?", help="the text whose prediction is traced (the model predicts the next "
                        "token at --position; not with --evaluate)")
    parser.add_argument("--position", "-p", type=_position, default=None,
                        help="the position whose prediction is traced, 0-indexed; negative counts from the end "
                        "(default: -1, the last token)")
    parser.add_argument("--tau", type=finite_float, default=DEFAULT_TAU,
                        help="keep an edge when its importance (its share of the sum it joins, by the paper's "
                        f"L1 proximity) exceeds this; 0 <= tau < 1 (default: {DEFAULT_TAU}, the paper's)")
    parser.add_argument("-o", "--out", type=Path, default=None,
                        help="the page to write: the figure and every kept edge (default: routes.html); with "
                        f"--evaluate, the folder for {CHECK_FILES} (default: ./{CHECK_FOLDER}; new or empty)")
    parser.add_argument("--png", action="store_true", help="also write the figure beside the page (OUT with .png)")
    parser.add_argument("--json", action="store_true", help="also write the graph as JSON beside the page "
                        "(OUT with .json: tokens, edges with importance and per-head split)")
    check = parser.add_argument_group(
        "is a route faithful? (--evaluate, no text needed)",
        "on the built-in tasks of patch --evaluate (Brown sentences' next words, indirect-object prompts), per "
        "prompt: each head's route score (its shares of the kept attention edges; the unpruned flow through it) "
        "against its effect alone mean-ablated, beside direct logit attribution (Spearman, top-20 overlap); each "
        "input token's route score against erasure, beside the last layer's attention, attention rollout and ALTI "
        f"(Spearman); means over prompts with bootstrap 95% intervals; writes {CHECK_FILES}")
    check.add_argument("--evaluate", action="store_true", help="run the check instead of tracing a text")
    check.add_argument("--tasks", default="brown,ioi", help="comma-separated tasks: brown, ioi (default: both)")
    check.add_argument("--prompts", type=positive_int, default=None,
                       help="prompts per task (default: 8, minutes for smollm2 on two cores; --quick: 4)")
    check.add_argument("--quick", action="store_true", help="4 prompts per task: a quick look")
    check.add_argument("--bootstrap", type=non_negative_int, default=1000,
                       help="bootstrap resamples for the 95%% intervals over prompts (default: 1000)")
    check.add_argument("--seed", type=seed, default=0, help="seed of the bootstrap (default: 0)")
    check.add_argument("--overwrite", action="store_true",
                       help="replace the files an earlier attnscope run wrote in the folder (listed in its "
                       "attnscope-manifest.json); other files are never removed")
    add_model_arguments(parser)


def _run_routes(args: argparse.Namespace) -> int:
    from ..attribution.routes import check_tau

    check_tau(args.tau)  # a bad threshold fails before the model loads
    if args.evaluate:
        return _check_routes(args)
    given = [f"--{name}" for name in ("quick", "overwrite") if getattr(args, name)]
    given += [f"--{name}" for name in ("prompts",) if getattr(args, name) is not None]
    if given:
        raise AttnscopeError(f"{', '.join(given)} go with --evaluate")
    if args.text is None or not args.text.strip():
        raise AttnscopeError("the text is empty")
    out = args.out or Path("routes.html")
    if out.suffix.lower() not in (".html", ".htm"):
        raise AttnscopeError(f"-o names the page to write: use a .html file name, not {out.name!r}")
    return _trace(args, out)


def _trace(args: argparse.Namespace, out: Path) -> int:
    from ..attribution.routes import routes
    from ..present.routes import save_routes_page
    from .outputs import output_files

    png, json_file = (out.with_suffix(suffix) if asked else None for suffix, asked in ((".png", args.png),
                                                                                     (".json", args.json)))
    with output_files(out, png, json_file):  # every path checked before the model loads
        graph = routes(load_from_args(args), args.text, position=-1 if args.position is None else args.position,
                       tau=args.tau)
        written = [save_routes_page(graph, out)]
        if png is not None:
            graph.plot(png)
            written.append(png)
        if json_file is not None:
            written.append(graph.save(json_file))
    print(repr(graph))
    attention = sorted((e for e in graph.edges if e.via == "attention"), key=lambda e: -e.importance)[:5]
    if attention:
        print("strongest attention edges (layer: source -> query, importance, top head; 0-indexed):")
    for edge in attention:
        top = max(range(len(edge.heads)), key=lambda h: edge.heads[h])
        print(f"  layer {edge.target.layer}: {edge.source.position} {graph.tokens[edge.source.position]!r} -> "
              f"{edge.target.position} {graph.tokens[edge.target.position]!r}, {edge.importance:.3f}, head {top}")
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


def _check_routes(args: argparse.Namespace) -> int:
    """``routes --evaluate``: the faithfulness check of routes, written to a folder like ``patch --evaluate``."""
    from ..experiments.attribution_check import check_tasks
    from .outputs import output_folder

    given = [f"--{name}" for name in ("png", "json") if getattr(args, name)]
    given += ["a text"] * (args.text is not None) + ["--position"] * (args.position is not None)
    if given:
        raise AttnscopeError(f"--evaluate runs built-in tasks at their last position; leave out {', '.join(given)}")
    tasks = check_tasks(args.tasks)
    with output_folder(args.out or Path(CHECK_FOLDER), overwrite=args.overwrite, command="routes") as folder:
        return _write_routes_check(args, tasks, folder)


def _write_routes_check(args: argparse.Namespace, tasks: list[str], folder: Path) -> int:
    from ..experiments.routes_check import DEFAULT_PROMPTS, QUICK_PROMPTS, check_routes
    from ..present.figures import plot_routes_check
    from .outputs import interval_text, write_check

    n_prompts = args.prompts or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS)
    check = check_routes(load_from_args(args), tasks=tasks, n_prompts=n_prompts, tau=args.tau,
                         n_resamples=args.bootstrap, seed=args.seed, progress=True)
    data = check.to_dict()
    written = write_check(folder, "routes_check", data, plot_routes_check(data))
    show = interval_text
    for task, result in data["tasks"].items():
        print(f"{task} ({result['n_prompts']} prompts; mean [95% CI]); heads vs each head alone mean-ablated:")
        for name, row in result["heads"].items():
            print(f"  {data['labels']['heads'][name]}: Spearman {show(row['spearman'])} (of sizes "
                  f"{show(row['spearman_magnitude'])}), top-20 overlap {show(row['top20_overlap'])}")
        print(f"  tokens vs erasure ({result['n_token_prompts']} prompts):")
        for name, row in result["tokens"].items():
            print(f"  {data['labels']['tokens'][name]}: Spearman {show(row['spearman'])} (of sizes "
                  f"{show(row['spearman_magnitude'])})")
    print(f"wrote {', '.join(written)} ({check.seconds:.0f} s)")
    return 0


def head_spec(text: str) -> tuple[int, int]:
    """``"L:H"`` (0-indexed) -> ``(layer, head)``."""
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"--head {text!r} is not LAYER:HEAD (0-indexed, e.g. 3:2)")
    return int(found.group(1)), int(found.group(2))


def _qk_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("text", help="the text (its tokens are the positions)")
    parser.add_argument("--head", type=head_spec, required=True, metavar="L:H",
                        help="the head, as LAYER:HEAD (0-indexed)")
    parser.add_argument("--query", type=int, default=-1, help="query position (0-indexed; negative from the end; "
                        "default: the last)")
    parser.add_argument("--key", type=int, required=True, help="key position (0-indexed; negative from the end)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="pairs to print (default: 10)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the whole result (both tables) as JSON")


def _run_qk(args: argparse.Namespace) -> int:
    from .outputs import output_files

    if args.top < 1:
        raise AttnscopeError("--top must be at least 1")
    if not args.text.strip():
        raise AttnscopeError("the text is empty")
    with output_files(args.json):  # checked before the model loads
        return _qk(args)


def _qk(args: argparse.Namespace) -> int:
    from ..attribution.qk import qk_attribution
    from .outputs import writing

    layer, head = args.head
    qk = qk_attribution(load_from_args(args), args.text, layer, head, args.query, args.key)
    tokens = qk.tokens
    print(f"{qk.model} L{layer}H{head} (0-indexed): query {qk.query} {tokens[qk.query]!r} -> key {qk.key} "
          f"{tokens[qk.key]!r}")
    print(f"score before the softmax {qk.score:.5f}; the {len(qk.query_components)} x {len(qk.key_components)} "
          f"table sums to {qk.total():.5f} (off by {abs(qk.total() - qk.score):.1e})")
    if qk.capped_score is not None:
        print(f"softcapped: the softmax sees {qk.capped_score:.5f}; no centred table (the cap is not linear)")
    _print_pairs(qk.top_pairs(args.top), "score terms (query component x key component)")
    total = qk.softmax_total()
    if total is not None and qk.row_term is not None:
        print(f"log attention {qk.log_attention:.5f} = centred table {total - qk.row_term:.5f} + row term "
              f"{qk.row_term:.5f} (off by {abs(total - qk.log_attention):.1e})")
        _print_pairs(qk.top_pairs(args.top, "centred"), "centred terms (what this key adds over the row's mean)")
    if args.json is not None:
        with writing(args.json):
            args.json.write_text(json.dumps(qk.to_dict()) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _print_pairs(pairs: list[tuple[str, str, float]], title: str) -> None:
    print(f"top {len(pairs)} {title}:")
    width = max(len(query) for query, _, _ in pairs)
    for query, key, value in pairs:
        print(f"  {value:+10.5f}  {query:<{width}} x {key}")


COMMANDS = (
    Command("routes", "information-flow routes (Ferrando & Voita 2024): which tokens, through which heads and layers, "
            "reached one prediction", """examples:
  attnscope routes --model smollm2 "The capital of France is"            # routes.html: the last token's route
  attnscope routes --model smollm2 "When Mary and John went to the store, John gave a drink to" --png --json
  attnscope routes --model gemma3 "The cat sat on the mat." --position 3 --tau 0.1 -o cat.html
  attnscope routes --model smollm2 --evaluate -o out/       # is a route faithful? (minutes: patches every head)
  attnscope routes --model smollm2 --evaluate --quick --tasks ioi -o out/   # 4 prompts
how it works: at each layer, each part of the attention block's output (each source token through each head, and
the residual) and of the feed-forward block's (its output, the residual) gets its share of the whole by L1
proximity, max(0, |y|_1 - |y - part|_1), normalised; from the chosen position down, only edges above --tau are
followed, so only the rows a route reaches are computed (one forward pass, then the walk).
writes OUT (the figure: tokens on x, layers on y, width = importance, colour = top head; and the edge table),
with --png OUT.png, with --json OUT.json; --evaluate writes OUT/routes_check.json, .png and .svg (docs/routes.md
says how each score is read off the route)""", _routes_arguments, _run_routes),
    Command("qk", "why a head attends: split one attention score into query x key component pairs", """examples:
  attnscope qk --model smollm2 "The cat sat on the mat. The cat" --head 17:4 --query -1 --key 2
  attnscope qk --model gemma3 "One two three one two" --head 5:0 --key 2 --top 5 --json qk.json

Components: "embedding", "L3H2 (head)" (an earlier head's output), "L5 MLP", "L3 attention bias", "bias" (the
query/key projections' biases). Layers, heads and positions are 0-indexed.""", _qk_arguments, _run_qk),
)
