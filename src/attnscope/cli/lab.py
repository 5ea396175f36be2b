"""``attnscope toy ...`` and ``attnscope primer``: the translation lab's commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..arguments import MAX_SEED, MAX_SEEDS, add_output_folder, positive_int, seed
from ..capture.options import bounded_numbers
from ..errors import AttnscopeError
from .command import Command
from .model_options import add_compute_arguments

DEFAULT_SHOWCASE = ("i can eat apples", "he wants to read the letter today", "the children drink milk")


def seed_list(value: str) -> tuple[int, ...]:
    """``--seeds``: numbers like ``0-4`` or ``1,7``, each a seed (at most :data:`MAX_SEED`), at most
    :data:`MAX_SEEDS` of them."""
    return bounded_numbers(value, highest=MAX_SEED, most=MAX_SEEDS, what="seeds")


def _toy_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train (or retrain) the toy translator and cache it")
    train.add_argument("--seed", type=seed, default=0, help=f"0 to {MAX_SEED} (default: 0)")
    translate = actions.add_parser("translate", help="translate, showing every decoding step")
    translate.add_argument("sentence")
    translate.add_argument("--beams", type=positive_int, default=1, help="beam width (1 = greedy)")
    translate.add_argument("--top-k", type=positive_int, default=5, help="candidates shown per step")
    translate.add_argument("--html", type=Path, help="also write the step view as a self-contained HTML page")
    translate.add_argument("--model", "-m", default="toy-translator",
                           help="any encoder-decoder folder works too, e.g. a local MarianMT model")
    add_compute_arguments(translate)
    corrupt = actions.add_parser("corrupt", help="translate under a corruption or with parts switched off")
    corrupt.add_argument("sentence", nargs="+")
    corrupt.add_argument("--mode", default="all", help="an experiment name, or 'all' (default)")
    evaluate = actions.add_parser("evaluate", help="exact match on the held-out split, intact and corrupted")
    evaluate.add_argument("--json", action="store_true", help="print the figures as one JSON object (last line)")
    evaluate.add_argument("--seeds", type=seed_list, metavar="SEEDS",
                          help=f"evaluate a translator trained with each of these seeds (e.g. 0-4, at most "
                               f"{MAX_SEEDS}; each trained once and cached, about 20 s) and report the mean and range "
                               "over them: one training run is one draw, and floating point differs between CPUs")


def _run_toy(args: argparse.Namespace) -> int:
    return {"train": _train, "translate": _translate, "corrupt": _corrupt, "evaluate": _evaluate}[args.action](args)


def _train(args: argparse.Namespace) -> int:
    from ..lab.translator import TrainingSettings, cached_folder, train

    folder = cached_folder(args.seed)
    figures = train(folder, TrainingSettings(seed=args.seed))
    print(f"trained in {figures['train_seconds']} s (final loss {figures['final_loss']}); saved to {folder}")
    return 0


def _load_toy(name: str = "toy-translator", dtype: str = "float32", device: str = "cpu"):  # type: ignore[no-untyped-def]
    from ..capture.loading import load_model

    return load_model(name, dtype=dtype, device=device)


def _translate(args: argparse.Namespace) -> int:
    from ..capture.decode import decode_steps
    from ..present.steps import print_decoding, steps_view
    from .outputs import check_output_file, writing

    if args.html:
        check_output_file(args.html)  # before the model loads
    trace = decode_steps(_load_toy(args.model, args.dtype, args.device), args.sentence, beams=args.beams, top_k=args.top_k)
    print_decoding(trace)
    if args.html:
        with writing(args.html):
            print(f"step view: {steps_view(trace).save(args.html)}")
    return 0


def _corrupt(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..lab.experiments import EXPERIMENTS, translate_with

    modes = list(EXPERIMENTS) if args.mode == "all" else [args.mode]
    if any(mode not in EXPERIMENTS for mode in modes):
        raise AttnscopeError(f"unknown mode {args.mode!r}; choose 'all' or one of {', '.join(EXPERIMENTS)}")
    loaded = _load_toy()
    table = Table(title="translations under each experiment")
    table.add_column("experiment")
    for sentence in args.sentence:
        table.add_column(sentence)
    table.add_row("(intact)", *translate_with(loaded, args.sentence))
    for mode in modes:
        table.add_row(mode, *translate_with(loaded, args.sentence, mode))
    Console().print(table)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from ..lab.experiments import evaluate_experiments, evaluate_seeds

    if args.seeds is None:
        figures = evaluate_experiments(_load_toy())
        if not args.json:
            print(f"held-out exact match {figures['exact_match']:.3f} on {figures['test_pairs']} pairs")
            for mode, score in figures["corrupted"].items():
                print(f"  {mode:30s} {score:.3f}")
    else:
        figures = evaluate_seeds(args.seeds, progress=not args.json)
        if not args.json:
            _print_over_seeds(figures["over_seeds"], len(args.seeds))
    print(json.dumps(figures))
    return 0


def _print_over_seeds(over_seeds: dict[str, dict[str, float]], seeds: int) -> None:
    print(f"held-out exact match over {seeds} seeds: mean [min-max]")
    for name, figure in over_seeds.items():
        print(f"  {name:30s} {figure['mean']:.3f} [{figure['min']:.3f}-{figure['max']:.3f}]")


def _primer_arguments(parser: argparse.ArgumentParser) -> None:
    add_output_folder(parser, "primer", "the primer's figures")
    parser.add_argument("--format", action="append", choices=["png", "svg", "pdf"],
                        help="figure format, repeatable (default: png)")


def _run_primer(args: argparse.Namespace) -> int:
    from ..lab.figures import write_primer_figures
    from .outputs import output_folder

    with output_folder(args.out, overwrite=args.overwrite, command="primer"):
        for path in write_primer_figures(args.out, tuple(args.format or ["png"])):
            print(path)
    return 0


COMMANDS = (
    Command("toy", "the toy English->German translator: train, step through decoding, corrupt it", """examples:
  attnscope toy translate "i can eat apples"                 # every step: top-k logits and cross-attention
  attnscope toy translate "i can eat apples" --beams 3 --html steps.html
  attnscope toy corrupt "i can eat apples" "she wants to read books" --mode uniform
  attnscope toy evaluate --json                              # exact match, intact and under each experiment
  attnscope toy train --seed 1""", _toy_arguments, _run_toy),
    Command("primer", "write the attention primer's figures (position encoding, one query's walk-through)",
            """examples:
  attnscope primer -o primer/
  attnscope primer -o primer/ --format svg --format pdf""", _primer_arguments, _run_primer),
)
