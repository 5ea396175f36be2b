"""``attnscope toy ...`` and ``attnscope primer``: the translation lab's commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..arguments import add_output_folder, non_negative_int, positive_int, temperature, top_p
from ..capture.options import PROMPT_ROWS, PROMPT_ROWS_HELP, number_list
from ..cli import Command, add_compute_arguments
from ..errors import AttnscopeError

DEFAULT_SHOWCASE = ("i can eat apples", "he wants to read the letter today", "the children drink milk")


def _toy_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train (or retrain) the toy translator and cache it")
    train.add_argument("--seed", type=non_negative_int, default=0)
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
    evaluate.add_argument("--seeds", type=number_list, metavar="SEEDS",
                          help="evaluate a translator trained with each of these seeds (e.g. 0-4; each trained once "
                               "and cached, about 20 s) and report the mean and range over them: one training run is "
                               "one draw, and floating point differs between CPUs")


def _run_toy(args: argparse.Namespace) -> int:
    return {"train": _train, "translate": _translate, "corrupt": _corrupt, "evaluate": _evaluate}[args.action](args)


def _train(args: argparse.Namespace) -> int:
    from .translator import TrainingSettings, cached_folder, train

    folder = cached_folder(args.seed)
    figures = train(folder, TrainingSettings(seed=args.seed))
    print(f"trained in {figures['train_seconds']} s (final loss {figures['final_loss']}); saved to {folder}")
    return 0


def _load_toy(name: str = "toy-translator", dtype: str = "float32", device: str = "cpu"):  # type: ignore[no-untyped-def]
    from ..capture.loading import load_model

    return load_model(name, dtype=dtype, device=device)


def _translate(args: argparse.Namespace) -> int:
    from ..outputs import check_output_file, writing
    from .stepper import decode_steps

    if args.html:
        check_output_file(args.html)  # before the model loads
    trace = decode_steps(_load_toy(args.model, args.dtype, args.device), args.sentence, beams=args.beams, top_k=args.top_k)
    trace.print_rich()
    if args.html:
        with writing(args.html):
            print(f"step view: {trace.save_html(args.html)}")
    return 0


def _corrupt(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .experiments import EXPERIMENTS, translate_with

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
    from .experiments import evaluate_experiments, evaluate_seed, summarise_seeds

    if args.seeds is None:
        figures = evaluate_experiments(_load_toy())
        if not args.json:
            print(f"held-out exact match {figures['exact_match']:.3f} on {figures['test_pairs']} pairs")
            for mode, score in figures["corrupted"].items():
                print(f"  {mode:30s} {score:.3f}")
    else:
        per_seed = [evaluate_seed(seed, progress=not args.json) for seed in args.seeds]
        figures = {"seeds": args.seeds, "per_seed": per_seed, "over_seeds": summarise_seeds(per_seed)}
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
    from ..outputs import output_folder
    from .figures import write_primer_figures

    with output_folder(args.out, overwrite=args.overwrite, command="primer"):
        for path in write_primer_figures(args.out, tuple(args.format or ["png"])):
            print(path)
    return 0


# ---- generate ---------------------------------------------------------------------------------


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    from ..capture.options import number_list

    parser.set_defaults(one_stream=True)  # one thread on a small machine: see attnscope.cli.apply_threads
    parser.add_argument("prompt", nargs="?", help="the text the model continues (or --file)")
    parser.add_argument("--file", type=Path, help="read the prompt from this UTF-8 text file (a long document)")
    parser.add_argument("--model", "-m", default="smollm2", help="a decoder-only model (default: smollm2)")
    add_compute_arguments(parser)
    parser.add_argument("--max-new-tokens", "-n", type=positive_int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--candidates", type=positive_int, default=10, help="top next tokens kept per step (default: 10)")
    parser.add_argument("--prompt-rows", choices=list(PROMPT_ROWS), default="auto",
                        help=PROMPT_ROWS_HELP + " (the table, --json and --html are the same; 'all' lets --save's "
                        "record become a full AttentionRecord: to_attention_record)")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--sample", action="store_true", help="sample instead of taking the most likely token")
    sampling.add_argument("--temperature", type=temperature, default=1.0, help="more than 0 (default: 1)")
    sampling.add_argument("--top-p", type=top_p, help="nucleus sampling: keep the tokens within this mass (0 to 1)")
    sampling.add_argument("--sample-top-k", type=positive_int, help="sample among the K most likely tokens")
    sampling.add_argument("--seed", type=non_negative_int, default=0)
    changes = parser.add_argument_group(
        "interventions (0-indexed)", "with any of these, the text is generated intact and changed, side by side")
    changes.add_argument("--ablate", action="append", type=_layer_heads, metavar="LAYER[:HEADS]",
                         help="zero these heads' output at every step, e.g. 3:4,7 (layer 3, heads 4 and 7) or 3 "
                         "(every head of layer 3); repeatable")
    changes.add_argument("--corrupt", metavar="PATTERN", help="replace attention with a pattern: uniform, beginning, "
                         "end, previous (where --layers/--heads say; default everywhere)")
    changes.add_argument("--layers", type=number_list, help="layers --corrupt applies to, e.g. 0-5")
    changes.add_argument("--heads", type=number_list, help="heads --corrupt applies to, e.g. 0,2")
    changes.add_argument("--skip-attention", type=number_list, default=(), metavar="LAYERS",
                         help="layers whose attention sublayer adds nothing")
    changes.add_argument("--skip-ffn", type=number_list, default=(), metavar="LAYERS",
                         help="layers whose feed-forward sublayer adds nothing")
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--save", type=Path, help="write the GenerationRecord (.safetensors) of the (changed) text")
    outputs.add_argument("--html", type=Path, help="write the step view of the (changed) text: one offline page to "
                         "step through the tokens (arrow keys or click), top next tokens, attention per layer and head")
    outputs.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")


def _layer_heads(value: str) -> tuple[int, tuple[int, ...] | None]:
    """``"3:4,7"`` -> ``(3, (4, 7))``; ``"3"`` -> ``(3, None)`` (every head)."""
    from ..capture.options import number_list

    layer, colon, heads = value.partition(":")
    if not layer.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected LAYER or LAYER:HEADS like 3:4,7, got {value!r}")
    return int(layer), (number_list(heads) if colon else None)


def _generation_changes(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..experiments.generation import GenerationChanges

    if (args.layers or args.heads) and not args.corrupt:
        raise AttnscopeError("--layers and --heads say where --corrupt applies; give --corrupt PATTERN too")
    ablate: dict[int, tuple[int, ...] | None] = {}
    for layer, heads in args.ablate or []:  # repeated layers add up; a bare layer means every head
        earlier = ablate.get(layer, ())
        ablate[layer] = None if heads is None or earlier is None else (*earlier, *heads)
    return GenerationChanges(ablate=ablate, corrupt=args.corrupt, corrupt_layers=args.layers,
                             corrupt_heads=args.heads, skip_attention=args.skip_attention, skip_ffn=args.skip_ffn)


def _prompt_from_args(args: argparse.Namespace) -> str:
    """The prompt: the PROMPT argument or the whole ``--file``, exactly one of them."""
    from ..inputs import read_document

    if (args.prompt is None) == (args.file is None):
        raise AttnscopeError("give the prompt as an argument or --file FILE (one of them)")
    return read_document(args.file) if args.file is not None else args.prompt


def _run_generate(args: argparse.Namespace) -> int:
    from ..capture.loading import load_model
    from ..outputs import check_output_file, writing

    prompt = _prompt_from_args(args)
    changes = _generation_changes(args)
    for path in (args.save, args.html):
        if path:
            check_output_file(path)  # before the model loads
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    options = {"max_new_tokens": args.max_new_tokens, "chat": args.chat, "candidates": args.candidates,
               "do_sample": args.sample, "temperature": args.temperature, "top_p": args.top_p,
               "top_k": args.sample_top_k, "seed": args.seed, "progress": True,
               "prompt_rows": PROMPT_ROWS[args.prompt_rows]}
    if changes.empty:
        from ..capture.generate import generate

        record = generate(loaded, prompt, **options)
        result = _print_generation(record, args.json)
    else:
        from ..experiments.generation import compare_generations

        comparison = compare_generations(loaded, prompt, changes, **options)
        record = comparison.changed
        result = _print_comparison(comparison, args.json)
    if args.save:
        with writing(args.save):
            print(f"generation record: {record.save(args.save)}", file=sys.stderr if args.json else sys.stdout)
    if args.html:
        from ..present.steps import steps_view

        with writing(args.html):
            print(f"step view: {steps_view(record).save(args.html)}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    return 0


def _print_generation(record, as_json: bool) -> dict:  # type: ignore[no-untyped-def,type-arg]
    from .generation_table import step_rows, steps_table

    if not as_json:
        from rich.console import Console

        Console().print(steps_table(record))
        print(record.generated_text)
    return {"prompt": record.prompt, "generated": record.generated_text, "steps": step_rows(record)}


def _print_comparison(comparison, as_json: bool) -> dict:  # type: ignore[no-untyped-def,type-arg]
    result = comparison.to_json()
    if not as_json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{comparison.intact.prompt!r} continued", show_lines=True)
        table.add_column("intact")
        table.add_column(f"changed: {result['changes']}")
        table.add_row(result["intact"], result["changed"])
        Console().print(table)
        step = result["parted_at"]
        print("the two texts are the same" if step is None else
              f"they part at step {step} (0-indexed generated token): {result['intact_token']!r} intact, "
              f"{result['changed_token']!r} changed")
    return result


COMMANDS = (
    Command("generate", "generate with a decoder and keep what every new token attended to", """examples:
  attnscope generate "Write one sentence about the sea." --chat
  attnscope generate "The capital of France is" -n 16 --save gen.safetensors
  attnscope generate "Write one sentence about the sea." --chat --html steps.html   # step through it
  attnscope generate "Write one sentence about the sea." --chat --ablate 3:4,7 --corrupt uniform --layers 0-5
  attnscope generate "Once upon a time" --sample --temperature 0.8 --seed 1 --json
  attnscope generate --file report.txt -n 32 --prompt-rows last --html steps.html   # a long prompt
Per step: the chosen token, its probability, the runners-up and the earlier token attended to most
(averaged over layers and heads, the first token, the attention sink, left out). With interventions,
the intact and changed texts side by side and the first step where they part. In Python:
  attnscope.GenerationRecord.load("gen.safetensors").step_attention(0)   # [layer, head, keys]""",
            _generate_arguments, _run_generate),
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
