"""The commands that drive capture: ``report``, ``extract`` and ``generate`` (each a thin layer over
:func:`attnscope.extract`, :func:`attnscope.extract_corpus` / :func:`attnscope.extract_to_file` and
:func:`attnscope.generate`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..arguments import add_output_folder, index_list, positive_int, seed, temperature, top_p
from ..capture.options import PROMPT_ROWS, PROMPT_ROWS_HELP, number_list
from ..errors import AttnscopeError
from .command import Command
from .model_options import add_compute_arguments, add_model_arguments, load_from_args
from .plan_options import add_plan_arguments, plan_from_args

if TYPE_CHECKING:
    from ..experiments.generation import GenerationChanges
    from ..records.attention import AttentionRecord


# ---- report ---------------------------------------------------------------------------------
def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text (first sentence)")
    parser.add_argument("--pair", "-p", help="second sentence (encoders/decoders) or target text (encoder-decoders)")
    parser.add_argument("--layers", type=index_list, help="comma-separated 0-indexed layers to show (default: all)")
    add_model_arguments(parser)


def _run_report(args: argparse.Namespace) -> int:
    from ..capture.extract import extract
    from ..capture.tokens import split_item
    from ..experiments.interventions import check_layers_and_heads
    from ..report import top_attention

    split_item((args.text, args.pair), 0)  # reject bad input before the model loads
    loaded = load_from_args(args)
    check_layers_and_heads(loaded, args.layers)
    record = extract(loaded, args.text, args.pair)
    info = record.model
    print(f"model {info.name} ({info.model_type}): {info.n_layers} layers x {info.n_heads} heads "
          f"({info.n_kv_heads} key/value heads), {len(record.tokens)} tokens, layers and heads 0-indexed\n")
    print(top_attention(record).to_text(args.layers))
    return 0


# ---- extract --------------------------------------------------------------------------------
def _extract_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("text", nargs="?", help="one text to extract")
    source.add_argument("--file", "-f", type=Path,
                        help="a file of inputs: one text per line, or .jsonl with {\"text\": ..., \"pair\": ...}")
    source.add_argument("--document", "-d", type=Path, help="a text file read as ONE input (a long document)")
    parser.add_argument("--pair", "-p", help="second sentence / target text for the single TEXT")
    add_output_folder(parser, "records", "the record files and index.jsonl (which input each file holds)")
    parser.add_argument("--qkv", action="store_true", help="also record queries, keys and values per head")
    parser.add_argument("--norms", action="store_true", help="also record ||alpha f(x)|| (Kobayashi et al. 2020)")
    parser.add_argument("--float16", action="store_true", help="store arrays as float16 (half the size)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="inputs per forward pass (default: 16)")
    parser.add_argument("--max-tokens", "--max-length", dest="max_length", type=positive_int,
                        help="truncate inputs to this many tokens (default and upper bound: the model's limit)")
    parser.add_argument("--stream", action="store_true",
                        help="write each record layer by layer as it is computed (one input at a time; memory holds "
                        "one layer's chunk); open it lazily with attnscope.AttentionRecord.open")
    add_model_arguments(parser)
    add_plan_arguments(parser)


def _run_extract(args: argparse.Namespace) -> int:
    from ..capture.extract import extract_corpus
    from ..capture.tokens import split_item
    from ..inputs import InputLine, read_document, read_input_lines
    from .outputs import output_folder, record_name, save_records

    if args.file:
        inputs = read_input_lines(args.file)
    else:
        inputs = [InputLine(read_document(args.document), None, str(args.document)) if args.document
                  else InputLine(args.text, args.pair)]
    for index, entry in enumerate(inputs):
        split_item(entry.item, index)  # reject bad input before the model loads
    plan = plan_from_args(args)
    if args.stream and args.qkv:
        raise AttnscopeError("--stream keeps attention, norms and figures; capture --qkv without --stream")
    with output_folder(args.out, overwrite=args.overwrite, command="extract") as out:
        loaded = load_from_args(args)
        records: Iterable[AttentionRecord]
        if args.stream:
            from ..capture.extract import extract_to_file

            records = (extract_to_file(loaded, *entry.item, path=out / record_name(index), plan=plan, norms=args.norms,
                                       float16=args.float16, max_length=args.max_length)
                       for index, entry in enumerate(inputs))
        else:
            records = extract_corpus(loaded, [entry.item for entry in inputs], batch_size=args.batch_size, qkv=args.qkv,
                                     norms=args.norms, max_length=args.max_length, progress=len(inputs) > 1, plan=plan)
        written = save_records(records, inputs, out, float16=args.float16, saved=args.stream)
    print(f"wrote {written} record(s) and index.jsonl to {out}/ (load with attnscope.AttentionRecord.load, or "
          "AttentionRecord.open for a lazy read)")
    return 0


# ---- generate ---------------------------------------------------------------------------------


def _generate_arguments(parser: argparse.ArgumentParser) -> None:

    parser.set_defaults(one_stream=True)  # one thread on a small machine: see attnscope.cli.apply_threads
    parser.add_argument("prompt", nargs="?", help="the text the model continues (or --file)")
    parser.add_argument("--file", type=Path, help="read the prompt from this UTF-8 text file (a long document)")
    parser.add_argument("--model", "-m", default="smollm2", help="a decoder-only model (default: smollm2)")
    add_compute_arguments(parser)
    parser.add_argument("--max-new-tokens", "-n", type=positive_int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--candidates", type=positive_int, default=10, help="top next tokens kept per step (default: 10)")
    parser.add_argument("--attribute", action="store_true",
                        help="also keep each step's direct logit attribution: how much every head pushed the chosen "
                        "token's logit up or down, and what the strongest ten pushed through each source token (from "
                        "the generation's own forward passes; --save keeps it, --html shows it)")
    parser.add_argument("--lens", action="store_true",
                        help="also keep each step's logit lens: each layer's top 3 next tokens, its residual stream "
                        "read through the final norm and the LM head (implies --attribute; the LM head runs once per "
                        "layer and step: for a small model with a large vocabulary it costs more than the attribution, "
                        "see docs/generation.md)")
    parser.add_argument("--routes", action="store_true",
                        help="also keep each step's information-flow route (Ferrando & Voita 2024; attnscope routes): "
                        "the edges above the default tau, with each attention edge's per-head split, from the "
                        "generation's own forward passes (--save keeps them, --html draws the route of the step shown; "
                        "attnscope.attribution.step_routes reads one step's back)")
    parser.add_argument("--prompt-rows", choices=list(PROMPT_ROWS), default="auto",
                        help=PROMPT_ROWS_HELP + " (the table, --json and --html are the same; 'all' lets --save's "
                        "record become a full AttentionRecord: to_attention_record)")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--sample", action="store_true", help="sample instead of taking the most likely token")
    sampling.add_argument("--temperature", type=temperature, default=1.0, help="more than 0 (default: 1)")
    sampling.add_argument("--top-p", type=top_p, help="nucleus sampling: keep the tokens within this mass (0 to 1)")
    sampling.add_argument("--sample-top-k", type=positive_int, help="sample among the K most likely tokens")
    sampling.add_argument("--seed", type=seed, default=0)
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
    budget = parser.add_argument_group(
        "KV budget", "generate with a cache in which only the chosen KV heads keep every key (0-indexed layers/heads)")
    budget.add_argument("--kv-budget", metavar="SHARE|BYTES",
                        help="share of the global layers' KV heads kept full (0-1 or 25%%), or the bytes the cache "
                        "may hold for the whole text (e.g. 4MiB): the highest --kv-score heads are full, the others "
                        "stream (first --kv-sink keys + the --kv-window most recent)")
    budget.add_argument("--kv-scores", type=Path, metavar="FILE.parquet",
                        help="head scores to choose full heads from: the table attnscope head-functions --save writes")
    budget.add_argument("--kv-score", default="retrieval", metavar="NAME",
                        help="the score column (higher = keeps every key; default: retrieval, the needle-retrieval "
                        "score; a KV group takes its query heads' highest)")
    budget.add_argument("--kv-sink", type=int, default=4, help="first keys a streaming head keeps (default: 4)")
    budget.add_argument("--kv-window", type=int, default=64,
                        help="most recent keys a streaming head keeps, its own included (default: 64)")
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--save", type=Path, help="write the GenerationRecord (.safetensors) of the (changed) text")
    outputs.add_argument("--html", type=Path, help="write the step view of the (changed) text: one offline page to "
                         "step through the tokens (arrow keys or click), top next tokens, attention per layer and head")
    outputs.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")


def _layer_heads(value: str) -> tuple[int, tuple[int, ...] | None]:
    """``"3:4,7"`` -> ``(3, (4, 7))``; ``"3"`` -> ``(3, None)`` (every head)."""

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


def _step_recorders(attribute: bool, routes: bool = False, lens: bool = False) -> list:  # type: ignore[type-arg]
    """What ``generate`` keeps besides the rows: each step's attribution with ``--attribute`` (and its logit lens
    with ``--lens``, which implies it), its route with ``--routes``."""
    recorders: list = []  # type: ignore[type-arg]
    if attribute or lens:
        from ..attribution.steps import StepAttribution

        recorders.append(StepAttribution(lens=lens))
    if routes:
        from ..attribution.generation_routes import StepRoutes

        recorders.append(StepRoutes())
    return recorders


def _run_generate(args: argparse.Namespace) -> int:
    from .outputs import output_files

    prompt = _prompt_from_args(args)
    changes = _generation_changes(args)
    budget = _kv_budget_from_args(args, changes)
    with output_files(args.save, args.html):  # checked before the model loads
        return _generate(args, prompt, changes, budget)


def _kv_budget_from_args(args: argparse.Namespace, changes: GenerationChanges) -> dict:  # type: ignore[type-arg]
    """``generate``'s KV budget options, checked before the model loads (the scores file read, the budget's range
    and sizes); the model's own checks (scores of its shape, a window shorter than the text) follow before it runs."""
    from ..capture.kv_budget import check_sizes, kv_head_scores, parse_budget

    if args.kv_budget is None:
        if args.kv_scores is not None:
            raise AttnscopeError("--kv-scores chooses the full heads of a --kv-budget: give --kv-budget too")
        return {}
    budget = parse_budget(args.kv_budget)  # the value itself first: a fix to it should not wait on another option's
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        raise AttnscopeError(f"--kv-budget: a share of full KV heads is between 0 and 1, got {args.kv_budget}")
    check_sizes(args.kv_sink, args.kv_window)
    if args.kv_scores is None:
        raise AttnscopeError("--kv-budget needs --kv-scores FILE.parquet (attnscope head-functions --save) to choose "
                             "the full heads from")
    if not changes.empty:
        raise AttnscopeError("--kv-budget does not combine with interventions (--ablate, --corrupt, --skip-*)")
    return {"kv_budget": budget, "kv_scores": kv_head_scores(args.kv_scores, args.kv_score),
            "kv_sink": args.kv_sink, "kv_window": args.kv_window}


def _generate(args: argparse.Namespace, prompt: str, changes: GenerationChanges,
              budget: dict) -> int:  # type: ignore[type-arg]
    from ..capture.loading import load_model
    from .outputs import writing

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    options = {"max_new_tokens": args.max_new_tokens, "chat": args.chat, "candidates": args.candidates,
               "do_sample": args.sample, "temperature": args.temperature, "top_p": args.top_p,
               "top_k": args.sample_top_k, "seed": args.seed, "progress": True,
               "prompt_rows": PROMPT_ROWS[args.prompt_rows], "recorders": _step_recorders(args.attribute, args.routes, args.lens)}
    if changes.empty:
        from ..capture.generate import generate

        record = generate(loaded, prompt, **options, **budget)
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
    from ..analysis.step_table import step_rows, steps_table

    if not as_json:
        from rich.console import Console

        Console().print(steps_table(record))
        print(record.generated_text)
        if "kv_budget" in record.settings:
            print(record.method)
    budget = {"kv_budget": record.settings["kv_budget"]} if "kv_budget" in record.settings else {}
    return {"prompt": record.prompt, "generated": record.generated_text, "steps": step_rows(record), **budget}


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
    Command("report", "print what each token attends to most, per layer and head", """examples:
  attnscope report "I went to the store." --pair "At the store, I bought fresh strawberries."
  attnscope report "The cat sat." --model smollm2 --layers 0,5""", _report_arguments, _run_report),
    Command("extract", "capture attention into record files (.safetensors)", """examples:
  attnscope extract "I went to the store." --pair "At the store, I bought fresh strawberries."
  attnscope extract --file sentences.txt --out records/ --norms --dtype bfloat16
  attnscope extract --file sentences.txt --out records/ --device cuda --dtype float16
  attnscope extract --file pairs.jsonl --qkv     # lines like {"text": "...", "pair": "..."}
  attnscope extract --model smollm2 --document long.txt --stats --top-k 32 --stream --float16 -o long/
  attnscope extract "The cat sat." --model smollm2 --layers 0-3 --queries last
records/index.jsonl says which input (text, pair, file and line) each record file holds; the folder must be
new or empty (--overwrite replaces an earlier run's files). Then in Python:
  attnscope.AttentionRecord.load("records/record_000000.safetensors")
(or AttentionRecord.open(...) to map a large record lazily; rec.holdings() says what it holds)""",
            _extract_arguments, _run_extract),
    Command("generate", "generate with a decoder and keep what every new token attended to", """examples:
  attnscope generate "Write one sentence about the sea." --chat
  attnscope generate "The capital of France is" -n 16 --save gen.safetensors
  attnscope generate "Write one sentence about the sea." --chat --html steps.html   # step through it
  attnscope generate "Write one sentence about the sea." --chat --ablate 3:4,7 --corrupt uniform --layers 0-5
  attnscope generate "Once upon a time" --sample --temperature 0.8 --seed 1 --json
  attnscope generate --file report.txt -n 32 --prompt-rows last --html steps.html   # a long prompt
  attnscope generate --file report.txt -n 32 --kv-budget 0.25 --kv-scores scores.parquet --kv-window 128
Per step: the chosen token, its probability, the runners-up and the earlier token attended to most
(averaged over layers and heads, the first token, the attention sink, left out). With interventions,
the intact and changed texts side by side and the first step where they part. In Python:
  attnscope.GenerationRecord.load("gen.safetensors").step_attention(0)   # [layer, head, keys]""",
            _generate_arguments, _run_generate),
)
