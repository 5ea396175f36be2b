"""Check the published head lists by masking (issue 48): for each model, switch off the heads its shipped list ranks
first by a score, and as many random heads, and measure what breaks (one command).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/head_checks.py                         # the four models
    OMP_NUM_THREADS=2 .venv/bin/python scripts/head_checks.py --models smollm2         # one model
    OMP_NUM_THREADS=2 .venv/bin/python scripts/head_checks.py --scores induction       # one check, the rest kept
    .venv/bin/python scripts/head_checks.py --redraw                                   # the picture, from the files
    .venv/bin/python scripts/head_checks.py --quick --models smollm2                   # tiny, ./head-checks-quick/

Three checks (:func:`attnscope.experiments.head_masking.check_score`), each masking the top k heads of a pooled
column of ``<alias>.csv`` (scripts/head_lists.py), k random heads (:data:`DRAWS` seeded draws) and, for streaming,
the k least streaming heads, for each k of :data:`KS`:

* ``induction`` (column ``induction``): loss on the repeated half of repeated random tokens, heads zero-ablated;
* ``streaming`` (column ``locality_k4_w64``): loss on long documents past the first 68 tokens, heads restricted to the
  first 4 keys and the 64 most recent;
* ``retrieval`` (column ``retrieval``): needle accuracy (the share of trials whose greedy answer holds the needle's
  answer), heads zero-ablated.

The checks' evidence is held out from the lists' where attnscope ships enough of it: another random seed, other
documents, another haystack at other depths and another length. The needles are the lists' (only eight ship).

Each check's summary (changes, masked minus intact, with paired bootstrap 95% intervals over the examples; the
heads of every set) goes into ``<out>/<alias>.json`` under ``checks``; ``<img>/head_checks.png`` draws every model's.
A full ``scripts/head_lists.py`` run rewrites the summary without ``checks`` (the lists changed: check again);
``tests/test_head_lists.py`` holds each recorded top set to the shipped list's ranking.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # cpu_name

from bench_json import cpu_name

import attnscope
from attnscope.errors import AttnscopeError
from attnscope.experiments.head_masking import check_score
from attnscope.progress import say_slow_step

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("smollm2", "gemma3", "qwen0.5b", "qwen1.5b")
OUT = ROOT / "src" / "attnscope" / "data" / "head_lists"
IMG = ROOT / "docs" / "img"
QUICK_OUT = Path("head-checks-quick")
PICTURE = "head_checks.png"
KS = (5, 20)
DRAWS = 5
RESAMPLES = 1000
SINK, WINDOW = 4, 64
# held out from the lists' evidence (scripts/head_lists.py SETS: seeds 0 and 1, documents sotu-1912 and moby-dick-032
# for locality, needles hidden in sotu-1946 and moby-dick-054 at 1,024 tokens, depths 0.1/0.5/0.9)
HELD_OUT_DOCUMENTS = ("moby-dick-001", "moby-dick-042", "sotu-1907-theodore-roosevelt", "sotu-1981-jimmy-carter")
CHECKED: dict[str, dict[str, Any]] = {
    "induction": {"column": "induction", "metric": {"length": 50, "n": 32, "seed": 2}, "masking": {}},
    "streaming": {"column": f"locality_k{SINK}_w{WINDOW}",
                  "metric": {"names": HELD_OUT_DOCUMENTS, "length": 512, "n": 8},
                  "masking": {"sink": SINK, "window": WINDOW}},
    "retrieval": {"column": "retrieval",
                  "metric": {"lengths": (512,), "depths": (0.25, 0.75),
                             "needles": ("passkey-1", "passkey-3", "sentence-2", "sentence-4"),
                             "document_name": "sotu-1905-theodore-roosevelt"},
                  "masking": {}},
}
QUICK: dict[str, dict[str, Any]] = {  # a tiny run that checks the command, not the heads
    "induction": {"length": 16, "n": 4, "seed": 2},
    "streaming": {"names": HELD_OUT_DOCUMENTS[:1], "length": 128, "n": 2},
    "retrieval": {"lengths": (128,), "depths": (0.5,), "needles": ("passkey-1", "passkey-3"),
                  "document_name": "sotu-1905-theodore-roosevelt"},
}


def score_grid(alias: str, column: str, out: Path) -> np.ndarray:
    """The pooled column ``column`` of ``<out>/<alias>.csv`` as ``[layer, head]``."""
    import pandas as pd

    frame = pd.read_csv(out / f"{alias}.csv").sort_values(["layer", "head"])
    shape = (int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1)
    return frame[column].to_numpy(dtype=float).reshape(shape)


def settings_of(name: str, quick: bool) -> dict[str, Any]:
    spec = CHECKED[name]
    return {**spec, "metric": QUICK[name] if quick else spec["metric"]}


def run_check(loaded: Any, alias: str, name: str, out: Path, quick: bool) -> dict[str, Any]:
    """One check of one model: its settings, :meth:`MaskingCheck.to_dict` (NaN written as null) and its wall time."""
    spec = settings_of(name, quick)
    say_slow_step(f"head checks: {alias}, {name} (top and random {', '.join(map(str, KS))} by {spec['column']})")
    started = time.perf_counter()
    check = check_score(loaded, name, score_grid(alias, spec["column"], out), ks=KS, draws=DRAWS,
                        metric_options=spec["metric"], masking_options=spec["masking"], n_resamples=RESAMPLES,
                        progress=True)
    return {"column": spec["column"], "metric_options": spec["metric"], "masking_options": spec["masking"],
            **without_nan(check.to_dict()), "seconds": round(time.perf_counter() - started, 1)}


def without_nan(value: Any) -> Any:
    """``value`` with every float NaN replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: without_nan(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [without_nan(item) for item in value]
    return value


def check_model(alias: str, names: list[str], out: Path, quick: bool) -> dict[str, Any]:
    """Run the checks ``names`` on ``alias`` and write them into ``<out>/<alias>.json`` (other checks kept)."""
    path = out / f"{alias}.json"
    info = json.loads(path.read_text(encoding="utf-8"))
    say_slow_step(f"head checks: loading {alias}")
    loaded = attnscope.load_model(alias)
    checks = info.get("checks", {})
    for name in names:
        checks[name] = {**run_check(loaded, alias, name, out, quick), "date": date.today().isoformat(),
                        "cpu": cpu_name(), "attnscope": attnscope.__version__,
                        "command": f"python scripts/head_checks.py --models {alias} --scores {name}"}
        info["checks"] = checks
        path.write_text(json.dumps(info, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")  # each check kept
        print(f"  wrote {name} into {path}", file=sys.stderr)
    return checks


def headline(alias: str, checks: dict[str, Any]) -> dict[str, Any]:
    """Per check: the baseline and, per k, the change with the top heads and with random heads (mean of draws)."""
    rows = {name: {f"{row['heads']} {row['k']}": round(row["change"], 4) for row in found["summary"]
                   if row["heads"] in ("top", "random", "bottom")} for name, found in checks.items()}
    return {"alias": alias, "baseline": {name: round(found["baseline"], 4) for name, found in checks.items()},
            "change": rows}


# ---- the picture --------------------------------------------------------------------------------------------
def recorded_checks(out: Path, models: list[str]) -> dict[str, dict[str, Any]]:
    """``{alias: checks}`` of the models whose summaries in ``out`` hold checks."""
    found = {}
    for alias in models:
        path = out / f"{alias}.json"
        if path.is_file():
            checks = json.loads(path.read_text(encoding="utf-8")).get("checks")
            if checks:
                found[alias] = checks
    return found


def draw(out: Path, img: Path, models: list[str]) -> Path:
    from attnscope.present.figures import plot_masking_checks, save_figure

    checks = recorded_checks(out, models)
    if not checks:
        raise AttnscopeError(f"no summary in {out} holds checks: run the checks first")
    img.mkdir(parents=True, exist_ok=True)
    return save_figure(plot_masking_checks(checks), img / PICTURE)


# ---- premises and main --------------------------------------------------------------------------------------
def check_premises(models: list[str], names: list[str], out: Path, img: Path) -> None:
    """What needs no model, before the first loads: known aliases and checks, each model's list in ``out``, folders
    that can be written."""
    from attnscope.models.registry import ALIASES

    for name in names:
        if name not in CHECKED:
            raise AttnscopeError(f"unknown check {name!r}; choose from {', '.join(CHECKED)}")
    for alias in models:
        if alias not in ALIASES:
            raise AttnscopeError(f"unknown model alias {alias!r}; choose from {', '.join(ALIASES)}")
        for path in (out / f"{alias}.csv", out / f"{alias}.json"):
            if not path.is_file():
                raise AttnscopeError(f"the checks mask the heads of {path}, which does not exist (scripts/head_lists.py "
                                     "writes it)")
    if img.exists() and not img.is_dir():
        raise AttnscopeError(f"{img} exists and is not a folder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"aliases (default: {' '.join(MODELS)})")
    parser.add_argument("--scores", nargs="+", default=list(CHECKED), metavar="CHECK",
                        help=f"the checks to run (default: {' '.join(CHECKED)}); the others recorded are kept")
    parser.add_argument("--quick", action="store_true", help=f"tiny metrics on lists copied to {QUICK_OUT}/ (checks "
                        "the command runs; the heads are not checked)")
    parser.add_argument("--redraw", action="store_true", help="only draw the picture from the recorded checks")
    parser.add_argument("--out", type=Path, help=f"the lists' folder (default: {OUT.relative_to(ROOT)})")
    parser.add_argument("--img", type=Path, help=f"where the picture goes (default: {IMG.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick else OUT)
    img = args.img or (QUICK_OUT if args.quick else IMG)
    try:
        copied = args.quick and not args.out
        check_premises(args.models, args.scores, OUT if copied else out, img)
        if copied:
            copy_lists(args.models, out)
        if not args.redraw:
            for alias in args.models:
                print(json.dumps(headline(alias, check_model(alias, args.scores, out, args.quick))), flush=True)
                gc.collect()  # the model goes before the next loads
        print(f"  wrote {draw(out, img, list(MODELS) if out == OUT else args.models)}", file=sys.stderr)
    except AttnscopeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def copy_lists(models: list[str], folder: Path) -> None:
    """The shipped lists of ``models`` (:func:`check_premises` found them) copied into ``folder`` (a quick run writes
    there, never into the package)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for alias in models:
        for name in (f"{alias}.csv", f"{alias}.json"):
            shutil.copyfile(OUT / name, folder / name)


if __name__ == "__main__":
    raise SystemExit(main())
