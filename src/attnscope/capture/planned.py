"""Partial records from a planned capture: the batch's facts before the forward, records after.

A planned capture (:mod:`attnscope.capture.plan`) keeps :class:`~attnscope.capture.rows.RowCapture`
objects per layer for the whole batch; :func:`planned_records` cuts them into one partial
:class:`~attnscope.record.AttentionRecord` per item, in the record's own layout
(``[layer, head, row, ...]`` over the held layers and heads).
"""

from __future__ import annotations

import numpy as np
import torch

from ..record import AttentionRecord, ModelInfo, Selection
from .plan import CapturePlan
from .rows import ROW_STATISTICS, BatchFacts, RowCapture, distance_bin_edges
from .tokens import Encoded


def batch_facts(batch: list[Encoded], plan: CapturePlan) -> BatchFacts:
    """Lengths, special-token masks ``[batch, pos]`` and each item's selected query positions."""
    lengths = [len(e.source.input_ids) for e in batch]
    special = torch.zeros((len(batch), max(lengths)), dtype=torch.bool)
    for row, encoded in enumerate(batch):
        special[row, : lengths[row]] = torch.tensor(encoded.source.special_mask, dtype=torch.bool)
    return BatchFacts(lengths, special, [plan.queries.positions(n) for n in lengths])


def planned_records(info: ModelInfo, batch: list[Encoded], layers: list[RowCapture],
                    plan: CapturePlan) -> list[AttentionRecord]:
    """One partial record per item of ``batch`` from the layers' batched captures."""
    from .extract import _side_arrays

    facts = batch_facts(batch, plan)
    selection = Selection(plan.layer_numbers(info.n_layers), layers[0].heads, plan.describe())
    records = []
    for row, encoded in enumerate(batch):
        arrays = _side_arrays("input", encoded.source)
        arrays["input.query_positions"] = facts.selected[row]
        arrays.update(item_arrays(info.main_kind, layers, row, facts, plan))
        records.append(AttentionRecord(model=info, tokens=encoded.source.tokens, arrays=arrays, text=encoded.text,
                                       selection=selection))
    return records


def item_arrays(kind: str, layers: list[RowCapture], row: int, facts: BatchFacts,
                plan: CapturePlan) -> dict[str, np.ndarray]:
    """Item ``row``'s arrays, layers stacked: its own rows of the union, its own keys and blocks."""
    length = facts.lengths[row]
    own_rows = np.searchsorted(layers[0].rows, facts.selected[row])
    arrays: dict[str, np.ndarray] = {}

    def stacked(get, cut) -> np.ndarray:  # type: ignore[no-untyped-def]
        return np.stack([cut(get(layer)[row].numpy()) for layer in layers])

    for name in ("attention", "norms"):
        if getattr(layers[0], name) is not None:
            arrays[f"{kind}.{name}"] = stacked(lambda c, n=name: getattr(c, n), lambda a: a[:, own_rows, :length])
    if plan.statistics:
        for name in ROW_STATISTICS:
            arrays[f"{kind}.stat_{name}"] = stacked(lambda c, n=name: c.statistics[n], lambda a: a[:, own_rows])
        bins = len(distance_bin_edges(length))
        arrays[f"{kind}.distance_histogram"] = stacked(lambda c: c.distance_histogram, lambda a: a[:, :bins])
    if plan.top_k:
        arrays[f"{kind}.topk_indices"] = stacked(lambda c: c.topk_indices, lambda a: a[:, own_rows])
        arrays[f"{kind}.topk_weights"] = stacked(lambda c: c.topk_weights, lambda a: a[:, own_rows])
    if plan.overview:
        blocks = -(-length // plan.overview)
        arrays[f"{kind}.overview"] = stacked(lambda c: c.overview, lambda a: a[:, :blocks, :blocks])
    return arrays
