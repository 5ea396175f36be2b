"""Where a benchmark's figures go: its last stdout line, ``benchmarks/runs/NAME.json`` (this run's, never
committed), and, only when asked with ``--record``, ``docs/bench/NAME.json`` for the pages (README.md, docs/*.md).

Both files hold ``{command, date, cpu, figures}``. ``docs/bench/`` is the record the pages are rendered
from (``make docs-figures``, naming the CPU) and ``tests/test_docs_figures.py`` checks against: a plain
run leaves it alone, so benchmarking and then testing never turns the tests red. To refresh the record,
re-run the benchmark at its full size with ``--record`` (or ``make bench-NAME RECORD=1``), then
``make docs-figures``.
Every benchmark's figures name the device they were measured on and its model (``device``,
``device_name``), so figures from a CPU and a GPU are never compared by mistake.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from datetime import date
from pathlib import Path
from typing import Any

DOCS_BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"
RUNS = Path(__file__).resolve().parent / "runs"  # a run's own figures (git ignores it)
RECORD_HELP = ("also write the figures to docs/bench/NAME.json, the record the pages are rendered from (only a "
               "full-size run: --quick, --smoke and other sizes are never recorded); without it they go to "
               "benchmarks/runs/NAME.json")


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; platform's guess elsewhere), the vector instructions torch uses
    on it, and its core count: machines named "AMD EPYC" here came with AVX-512 and with AVX2 only, and bfloat16
    and GEMM figures differ several times between them."""
    import torch

    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        name = found.group(1).strip() if found else platform.processor()
    except OSError:
        name = platform.processor()
    return f"{name or 'unknown CPU'} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores"


def device_name(device: str = "cpu") -> str:
    """The model of ``device`` (as ``load_model`` takes it): the CPU's name, the GPU's, or each of them for ``auto``."""
    import torch

    kind = device.partition(":")[0]
    if kind == "cuda":
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA)"
    if kind == "mps":
        return f"Apple GPU (MPS) on {platform.machine()}"
    if kind == "auto" and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{', '.join(gpus)} (CUDA), then {cpu_name()}"
    return cpu_name()


SMOKE_HELP = ("smallest sizes, seconds: only checks that the benchmark still runs end to end (make test runs every "
              "benchmark so); its figures mean nothing and are never kept")


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    """``--record``: a full-size run's figures also become the pages' record in docs/bench/."""
    parser.add_argument("--record", action="store_true", help=RECORD_HELP)


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    """``--smoke``: the same code path at the smallest sizes (``make test`` runs every benchmark with it);
    ``--record`` beside it (:func:`add_record_flag`)."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    add_record_flag(parser)


def sized_run(args: argparse.Namespace) -> tuple[str, float]:
    """A run sized by ``--smoke``/``--quick`` (else ``full``) with ``--threads`` torch threads: its size and the load
    average before it, after printing the run's header (attnscope's version, the CPU, the threads)."""
    import torch

    import attnscope

    which = "smoke" if args.smoke else "quick" if args.quick else "full"
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    print(f"attnscope {attnscope.__version__}, {cpu_name()}, {args.threads} thread(s), load average "
          f"{load_before:.2f}; size {which}", flush=True)
    return which, load_before


def emit(name: str, figures: dict[str, Any], keep: bool = True, device: str = "cpu") -> None:
    """Print ``figures``, with the ``device`` they were measured on and its name, as the last JSON line.
    ``keep`` says the run is full size: its figures go to benchmarks/runs/NAME.json, and with ``--record``
    to docs/bench/NAME.json too (a ``--smoke`` run writes neither)."""
    figures = {**figures, "device": device, "device_name": device_name(device)}
    sys.stdout.write(json.dumps(figures) + "\n")
    arguments = sys.argv[1:]
    if not keep or "--smoke" in arguments:
        if "--record" in arguments:  # asked to record, and nothing was: say so rather than succeed silently
            sys.exit(f"{name}: --record: not recorded, only a full-size run (no --smoke, --quick or other sizes) is")
        return
    script = Path(sys.argv[0]).name  # the file that ran (extract.py keeps a GPU's figures as extract_cuda)
    command = " ".join(["python", f"benchmarks/{script}", *(a for a in arguments if a != "--record")])
    kept = json.dumps({"command": command, "date": date.today().isoformat(), "cpu": cpu_name(), "figures": figures},
                      indent=1) + "\n"
    for folder in [RUNS, *([DOCS_BENCH] if "--record" in arguments else [])]:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(kept)
