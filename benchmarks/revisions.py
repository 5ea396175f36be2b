"""Two revisions of attnscope side by side: the same benchmarks, run alternately on each, in one run.

A refactoring promises "the same time or faster"; timing the old code on one day and the new on another
compares two machines' moods. This runs each benchmark on the revision before and on this checkout
alternately (``--rounds`` times, the order flipping every round so neither always goes first), on the
same machine in one process tree, and prints one JSON line (``emit``: it names the CPU): per benchmark, each revision's figures and
the ratio after/before of every time (keys ending in ``_s`` or ``_ms``) and throughput (``_per_s``,
``tok_s``) both revisions report.

Run from the repository root, alone on a quiet machine::

    .venv/bin/python benchmarks/revisions.py --before 7c7c8cf                 # the four house benchmarks
    .venv/bin/python benchmarks/revisions.py --before HEAD~3 --only extract --rounds 2
    .venv/bin/python benchmarks/revisions.py --smoke     # HEAD against this checkout, extract.py --smoke

The revision before is checked out with ``git worktree`` into a temporary folder (removed afterwards) and
run with its own ``src/`` first on ``PYTHONPATH`` and this checkout's Python; its benchmark scripts are
its own, so each revision is measured by the code it shipped with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_json import add_smoke_flag, cpu_name, emit

REPO = Path(__file__).resolve().parent.parent
# the benchmarks a change to capture, attribution or the architectures must not slow down (issue 38)
BENCHMARKS = {
    "extract": ["benchmarks/extract.py", "--quick"],
    "generate": ["benchmarks/generate.py", "--quick"],
    "attribution": ["benchmarks/attribution.py", "--no-patching"],
    "long": ["benchmarks/long.py", "--lengths", "512,1024,2048"],
}
SPEED_SUFFIXES = ("_per_s", "tok_s")
TIME_SUFFIXES = ("_s", "_ms")


def command_of(name: str, smoke: bool) -> list[str]:
    """The command line of benchmark ``name``: its house size, or its ``--smoke`` size."""
    return [BENCHMARKS[name][0], "--smoke"] if smoke else BENCHMARKS[name]


def run_benchmark(tree: Path, command: list[str]) -> dict:
    """The figures (last stdout line, one JSON object) of ``command`` run in ``tree`` with its own sources."""
    environment = {**os.environ, "PYTHONPATH": str(tree / "src")}
    finished = subprocess.run([sys.executable, *command], check=False, cwd=tree, env=environment, capture_output=True, text=True)
    if finished.returncode != 0:
        sys.exit(f"{' '.join(command)} failed in {tree}:\n{finished.stderr[-2000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ratio(before: object, after: object) -> float | list[float] | None:
    """after/before of one figure: a number, or a list of numbers (one per length or size) element by element."""
    if is_number(before) and is_number(after) and before:
        return round(after / before, 3)  # type: ignore[operator]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after) and all(
            is_number(b) and b and is_number(a) for b, a in zip(before, after)):
        return [round(a / b, 3) for b, a in zip(before, after)]
    return None


def ratios(before: dict, after: dict) -> dict[str, float | list[float]]:
    """after/before for every time and throughput figure both runs report (a time ratio < 1 or a throughput
    ratio > 1 means this checkout is faster)."""
    timed = [key for key in before if key in after and (key.endswith(SPEED_SUFFIXES) or key.endswith(TIME_SUFFIXES))]
    found = {key: ratio(before[key], after[key]) for key in timed}
    return {key: value for key, value in found.items() if value is not None}


def compare(before_tree: Path, names: list[str], rounds: int, smoke: bool) -> dict:
    """Per benchmark: each revision's figures per round and the after/before ratios of each round."""
    results: dict = {}
    for index, name in enumerate(names):
        runs: dict[str, list] = {"before": [], "after": []}
        for round_ in range(rounds):
            order = [("before", before_tree), ("after", REPO)]
            if (index + round_) % 2:
                order.reverse()
            for label, tree in order:
                print(f"{name}: round {round_ + 1}/{rounds}, {label}", file=sys.stderr, flush=True)
                runs[label].append(run_benchmark(tree, command_of(name, smoke)))
        results[name] = {**runs, "ratios": [ratios(b, a) for b, a in zip(runs["before"], runs["after"])]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the revision to compare with (any git revision; --smoke: HEAD)")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each benchmark on each revision")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.before is None and not args.smoke:
        sys.exit("--before: name the revision to compare with (e.g. --before HEAD~1)")
    names = args.only.split(",") if args.only else (["extract"] if args.smoke else list(BENCHMARKS))
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown or args.rounds < 1:
        sys.exit(f"--only: unknown benchmark {unknown} (choose from {', '.join(BENCHMARKS)})" if unknown
                 else "--rounds must be at least 1")
    revision = subprocess.run(["git", "rev-parse", "--short", args.before or "HEAD"], check=False, cwd=REPO, capture_output=True, text=True)
    if revision.returncode != 0:
        sys.exit(f"--before: {args.before!r} is not a revision of this repository")
    print(cpu_name(), file=sys.stderr)  # the first line names the CPU, as every benchmark's
    with tempfile.TemporaryDirectory(prefix="attnscope-before-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision.stdout.strip()], cwd=REPO,
                       check=True)
        try:
            results = compare(tree, names, args.rounds, args.smoke)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True, cwd=REPO, capture_output=True, text=True).stdout
    emit("revisions", {"before": revision.stdout.strip(), "after": head.strip(), **results})


if __name__ == "__main__":
    main()
