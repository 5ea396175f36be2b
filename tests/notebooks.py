"""What the notebook tests share: a kernel environment that finds this checkout's attnscope."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kernel_environment() -> dict[str, str]:
    """This process's environment with PYTHONPATH made absolute: a kernel runs in another folder,
    where a relative ``PYTHONPATH=src`` would find nothing (or an installed attnscope instead)."""
    env = dict(os.environ)
    paths = [str(Path(entry).resolve()) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
