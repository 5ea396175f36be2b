"""A generation step by step in the terminal: chosen token, runners-up, and what it looked at most."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..generation import GenerationRecord

RUNNERS_UP = 3


def most_attended(record: GenerationRecord, step: int) -> tuple[int, float] | None:
    """The earlier position the choice at ``step`` attended to most, averaged over layers and heads,
    and its weight; the first token (the attention sink of causal models) is left out."""
    mean = record.step_attention(step).mean(axis=(0, 1))  # [keys]
    if mean.shape[0] < 2:
        return None
    position = int(np.argmax(mean[1:])) + 1
    return position, float(mean[position])


def step_rows(record: GenerationRecord) -> list[dict[str, Any]]:
    """One JSON-ready dict per generated token (steps 0-indexed)."""
    rows = []
    for step in range(record.n_steps):
        chosen = record.chosen(step)
        focus = most_attended(record, step)
        rows.append({"step": step, "token": chosen.token, "probability": round(chosen.probability, 4),
                     "candidates": [[c.token, round(c.probability, 4)] for c in record.candidates(step)],
                     "most_attended": None if focus is None else {"position": focus[0],
                                                                   "token": record.tokens[focus[0]],
                                                                   "weight": round(focus[1], 4)}})
    return rows


def steps_table(record: GenerationRecord) -> Any:
    """A rich table of :func:`step_rows`."""
    from rich.table import Table

    table = Table(title=f"{record.model.name}: {record.n_steps} generated tokens"
                  + (f" ({record.changes})" if record.changes else ""))
    for column in ("step", "token", "p", "runners-up", "attended most (mean, sink left out)"):
        table.add_column(column)
    for row in step_rows(record):
        others = [f"{token!r} {p:.2f}" for token, p in row["candidates"] if token != row["token"]][:RUNNERS_UP]
        focus = row["most_attended"]
        table.add_row(str(row["step"]), repr(row["token"]), f"{row['probability']:.2f}", ", ".join(others),
                      "" if focus is None else f"{focus['token']!r} @{focus['position']} ({focus['weight']:.2f})")
    return table
