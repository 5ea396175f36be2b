"""A generation step by step in the terminal: chosen token, runners-up, and what it looked at most."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..analysis.sinks import sink_positions
from ..records.attribution import ATTRIBUTION_HEADS
from ..records.generation import GenerationRecord

RUNNERS_UP = 3


def step_sinks(record: GenerationRecord) -> np.ndarray:
    """Bool ``[layer, head, key]``: each head's attention sinks as the rows that chose the tokens show them:
    position 0 and every key the sink report calls a sink (:func:`attnscope.analysis.sinks.sink_positions`:
    at least 5x the uniform share, averaged over the steps' queries that come two or more positions later)."""
    n_keys = record.prompt_length + record.n_steps - 1  # the last step's row: the prompt and the text before it
    queries = record.prompt_length - 1 + np.arange(record.n_steps)  # the position whose row chose each step
    visible = np.arange(n_keys)[None, :] <= queries[:, None]  # [step, key]
    steps = [record.step_attention(step) for step in range(record.n_steps)]  # views, [layer, head, keys so far]
    sinks = np.zeros((record.model.n_layers, record.model.n_heads, n_keys), dtype=bool)
    for layer in range(record.model.n_layers):  # one layer's rows at a time: a long prompt's would be large
        rows = np.zeros((record.model.n_heads, record.n_steps, n_keys), dtype=np.float32)  # [head, step, key]
        for step, row in enumerate(steps):
            rows[:, step, : row.shape[-1]] = row[layer]
        sinks[layer] = sink_positions(rows, visible, query_positions=queries)
    sinks[..., 0] = True
    return sinks


def most_attended(record: GenerationRecord, step: int, sinks: np.ndarray | None = None) -> tuple[int, float] | None:
    """The earlier position the choice at ``step`` attended to most and its weight, averaged over layers and
    heads with each head's sinks (``sinks``, default :func:`step_sinks`) counted as 0: a sink draws a large
    share at every step and says nothing about this one."""
    sinks = step_sinks(record) if sinks is None else sinks
    row = record.step_attention(step)  # [layer, head, keys]
    mean = np.where(sinks[..., : row.shape[-1]], 0.0, row).mean(axis=(0, 1))  # [keys]
    if not mean.any():
        return None
    position = int(np.argmax(mean))
    return position, float(mean[position])


def step_rows(record: GenerationRecord) -> list[dict[str, Any]]:
    """One JSON-ready dict per generated token (steps 0-indexed)."""
    rows, sinks = [], step_sinks(record)
    for step in range(record.n_steps):
        chosen = record.chosen(step)
        focus = most_attended(record, step, sinks)
        rows.append({"step": step, "token": chosen.token, "probability": round(chosen.probability, 4),
                     "candidates": [[c.token, round(c.probability, 4)] for c in record.candidates(step)],
                     "most_attended": None if focus is None else {"position": focus[0],
                                                                   "token": record.tokens[focus[0]],
                                                                   "weight": round(focus[1], 4)}})
        if ATTRIBUTION_HEADS in record.arrays:  # generated with --attribute (StepAttribution): signed DLA terms
            rows[-1]["top_heads"] = [[layer, head, round(term, 4)] for layer, head, term in record.top_heads(step, 3)]
    return rows


def steps_table(record: GenerationRecord) -> Any:
    """A rich table of :func:`step_rows`."""
    from rich.table import Table

    table = Table(title=f"{record.model.name}: {record.n_steps} generated tokens"
                  + (f" ({record.changes})" if record.changes else ""))
    attributed = ATTRIBUTION_HEADS in record.arrays
    for column in ("step", "token", "p", "runners-up", "attended most (mean over heads, each head's sinks left out)"):
        table.add_column(column)
    if attributed:
        table.add_column("heads pushing it most (layer:head logit term)")
    for row in step_rows(record):
        others = [f"{token!r} {p:.2f}" for token, p in row["candidates"] if token != row["token"]][:RUNNERS_UP]
        focus = row["most_attended"]
        cells = [str(row["step"]), repr(row["token"]), f"{row['probability']:.2f}", ", ".join(others),
                 "" if focus is None else f"{focus['token']!r} @{focus['position']} ({focus['weight']:.2f})"]
        if attributed:
            cells.append(", ".join(f"{layer}:{head} {term:+.2f}" for layer, head, term in row["top_heads"]))
        table.add_row(*cells)
    return table
