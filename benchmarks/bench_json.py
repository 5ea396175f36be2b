"""Where a benchmark's figures go: its last stdout line, and ``docs/bench/NAME.json`` for the README.

``docs/bench/NAME.json`` holds ``{command, date, cpu, figures}``; ``make docs-figures`` renders the
README's benchmark figures from it (naming the CPU), so the next run of a benchmark refreshes them.
"""

from __future__ import annotations

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
    """The CPU's model name (Linux /proc/cpuinfo; platform's guess elsewhere) and core count."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        name = found.group(1).strip() if found else platform.processor()
    except OSError:
        name = platform.processor()
    return f"{name or 'unknown CPU'}, {os.cpu_count()} cores"


def emit(name: str, figures: dict[str, Any], keep: bool = True) -> None:
    """Print ``figures`` as the last JSON line; with ``keep``, also write them to docs/bench/NAME.json."""
    sys.stdout.write(json.dumps(figures) + "\n")
    if keep:
        DOCS_BENCH.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python", f"benchmarks/{name}.py", *sys.argv[1:]])
        kept = {"command": command, "date": date.today().isoformat(), "cpu": cpu_name(), "figures": figures}
        (DOCS_BENCH / f"{name}.json").write_text(json.dumps(kept, indent=1) + "\n")
