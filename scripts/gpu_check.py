"""Summarise a ``pytest -m gpu --junitxml`` run as ``docs/bench/gpu_tests.json`` (docs/gpu.md's GPU section is
rendered from it): how many of the GPU tests passed, failed and were skipped, the failures by name, and the
machine (GPU, torch, transformers). Run by ``scripts/gpu_check.sh run`` on the GPU machine.

    python3 scripts/gpu_check.py RESULTS.xml docs/bench/gpu_tests.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path


def outcomes(results: Path) -> dict[str, list[str]]:
    """Test names by outcome (passed, failed, skipped) from a JUnit XML file."""
    found: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(results).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        found[outcome].append(case.get("name", "?"))
    return found


def main(results: str, target: str) -> None:
    import torch
    import transformers

    found = outcomes(Path(results))
    machine = f"{torch.cuda.get_device_name(0)} (CUDA), torch {torch.__version__}, transformers {transformers.__version__}"
    figures = {**{outcome: len(names) for outcome, names in found.items()}, "failures": found["failed"],
               "machine": machine}
    kept = {"command": "sh scripts/gpu_check.sh run OUTDIR", "date": date.today().isoformat(), "cpu": machine,
            "figures": figures}
    Path(target).write_text(json.dumps(kept, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main(*sys.argv[1:3])
