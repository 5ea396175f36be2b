"""Where a benchmark's figures go: its last stdout line, and ``docs/bench/NAME.json`` for the README.

``docs/bench/NAME.json`` holds ``{command, date, cpu, figures}``; ``make docs-figures`` renders the
README's benchmark figures from it (naming the CPU), so the next run of a benchmark refreshes them.
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


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    """``--smoke``: the same code path at the smallest sizes (``make test`` runs every benchmark with it)."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def emit(name: str, figures: dict[str, Any], keep: bool = True, device: str = "cpu") -> None:
    """Print ``figures``, with the ``device`` they were measured on and its name, as the last JSON line;
    with ``keep``, also write them to docs/bench/NAME.json (never from a ``--smoke`` run)."""
    figures = {**figures, "device": device, "device_name": device_name(device)}
    sys.stdout.write(json.dumps(figures) + "\n")
    if keep and "--smoke" not in sys.argv[1:]:
        DOCS_BENCH.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python", f"benchmarks/{name}.py", *sys.argv[1:]])
        kept = {"command": command, "date": date.today().isoformat(), "cpu": cpu_name(), "figures": figures}
        (DOCS_BENCH / f"{name}.json").write_text(json.dumps(kept, indent=1) + "\n")
