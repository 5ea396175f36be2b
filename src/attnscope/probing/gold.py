"""Where the gold treebanks are: ``$ATTNSCOPE_UD_DIR``, else ``../shared/data/ud/`` beside the checkout.

They are evaluation data (UD English EWT and GUM, see that folder's README), never part of the
repository or the package; tests, benchmarks and ``make docs-figures`` skip with a message where
the folder is absent, and users pass their own files to ``attnscope probe deps|coref --conllu``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "ATTNSCOPE_UD_DIR"
EWT_TEST = "ewt-en_ewt-ud-test.conllu"
GUM_TEST = "gum-en_gum-ud-test.conllu"
EWT_DEV = "ewt-en_ewt-ud-dev.conllu"  # where heads are chosen before they are scored on test
GUM_DEV = "gum-en_gum-ud-dev.conllu"


def ud_dir() -> Path:
    """``$ATTNSCOPE_UD_DIR``, or ``../shared/data/ud`` relative to the repository root of this checkout."""
    configured = os.environ.get(ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(__file__).resolve().parents[3].parent / "shared" / "data" / "ud"


def gold_file(name: str) -> Path | None:
    """The gold file ``name`` in :func:`ud_dir`, or None when it is not there."""
    path = ud_dir() / name
    return path if path.is_file() else None


def missing_message(name: str) -> str:
    return f"gold file {name} not found in {ud_dir()} (set {ENV} to the folder that holds it)"
