"""Partial records from a planned capture: the batch's facts before the forward, records after.

A planned capture (:mod:`attnscope.capture.plan`) keeps :class:`~attnscope.capture.rows.RowCapture`
objects per layer for the whole batch; :func:`planned_records` cuts them into one partial
:class:`~attnscope.records.AttentionRecord` per item, in the record's own layout
(``[layer, head, row, ...]`` over the held layers and heads).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..models.adapters import AttentionSite
from ..records.attention import AttentionRecord, ModelInfo, Selection, record_metadata
from ..records.format import LOCALITY, ROW_STATISTICS, SENTENCE_ATTENTION, RecordWriter, distance_bin_edges
from .plan import CapturePlan
from .rows import Allocate, BatchFacts, RowCapture
from .tokens import Encoded, side_arrays


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
    facts = batch_facts(batch, plan)
    layers = [layer.cpu() for layer in layers]  # one copy per field of the batch, wherever it was computed
    selection = Selection(plan.layer_numbers(info.n_layers), layers[0].heads, plan.describe())
    records = []
    for row, encoded in enumerate(batch):
        arrays = side_arrays("input", encoded.source)
        arrays["input.query_positions"] = facts.selected[row]
        arrays.update(item_arrays(info.main_kind, layers, row, facts, plan, info.learned_sinks))
        records.append(AttentionRecord(model=info, tokens=encoded.source.tokens, arrays=arrays, text=encoded.text,
                                       selection=selection))
    return records


def item_arrays(kind: str, layers: list[RowCapture], row: int, facts: BatchFacts,
                plan: CapturePlan, learned_sinks: bool = False) -> dict[str, np.ndarray]:
    """Item ``row``'s arrays, layers stacked: its own rows of the union, its own keys and blocks (and their sink
    mass, for a model with ``learned_sinks``)."""
    length = facts.lengths[row]
    positions = np.searchsorted(layers[0].rows, facts.selected[row])
    # every row is the item's: a view, not a copy of each layer
    own_rows = slice(None) if len(positions) == len(layers[0].rows) else positions
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
    if plan.top_k:  # the batch's slots, cut to the item's own keys
        slots = plan.top_k_slots(length)
        arrays[f"{kind}.topk_indices"] = stacked(lambda c: c.topk_indices, lambda a: a[:, own_rows, :slots])
        arrays[f"{kind}.topk_weights"] = stacked(lambda c: c.topk_weights, lambda a: a[:, own_rows, :slots])
    if plan.overview:
        blocks = -(-length // plan.overview)
        arrays[f"{kind}.overview"] = stacked(lambda c: c.overview, lambda a: a[:, :blocks, :blocks])
    if plan.sentences:
        arrays[f"{kind}.{SENTENCE_ATTENTION}"] = stacked(lambda c: c.sentences, lambda a: a)
    if plan.locality:
        arrays[f"{kind}.{LOCALITY}"] = stacked(lambda c: c.locality, lambda a: a)
    if learned_sinks:  # a layer without learned sinks (some of MiMo's) gives them no mass
        arrays[f"{kind}.sink_mass"] = np.stack([np.zeros((len(layer.heads), len(layer.rows)), np.float32)
                                                if layer.sink_mass is None else layer.sink_mass[row].numpy()
                                                for layer in layers])[:, :, own_rows]
    return arrays


class StreamingSink:
    """Streams a planned capture of ONE input into one record file, layer by layer.

    Attention rows, norms and top-k keys are written straight into the memory-mapped file by the
    collector (:meth:`allocate`), so a layer's rows never sit in memory as a whole; statistics, the
    histogram and the overview (small) are written when the layer finishes (:meth:`finish`).
    """

    def __init__(self, path: Path, encoded: Encoded, plan: CapturePlan, *, kind: str, n_layers: int,
                 norms: bool, float16: bool, learned_sinks: bool = False) -> None:
        self.path, self.encoded, self.plan, self.kind, self.norms = path, encoded, plan, kind, norms
        self.learned_sinks = learned_sinks  # the model has learned sinks: the file holds their mass per row
        self.layers = plan.layer_numbers(n_layers)
        self.float_dtype = "float16" if float16 else "float32"
        self.writer: RecordWriter | None = None
        self.on_layer: Callable[[int], object] = lambda n: None  # hears of every layer written

    def layout(self, n_kept_heads: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every array of the record file: name -> (dtype, shape)."""
        length = len(self.encoded.source.input_ids)
        rows = len(self.plan.queries.positions(length))
        lead, kind, plan = (len(self.layers), n_kept_heads), self.kind, self.plan
        layout: dict[str, tuple[str, tuple[int, ...]]] = {}
        if plan.attention:
            layout[f"{kind}.attention"] = (self.float_dtype, (*lead, rows, length))
            if self.norms:
                layout[f"{kind}.norms"] = (self.float_dtype, (*lead, rows, length))
        if plan.statistics:
            layout.update({f"{kind}.stat_{name}": ("float32", (*lead, rows)) for name in ROW_STATISTICS})
            layout[f"{kind}.distance_histogram"] = ("float32", (*lead, len(distance_bin_edges(length))))
        if plan.top_k:
            index_dtype = "int16" if length < 2**15 else "int32"  # -1 marks an empty slot
            layout[f"{kind}.topk_indices"] = (index_dtype, (*lead, rows, plan.top_k_slots(length)))
            layout[f"{kind}.topk_weights"] = (self.float_dtype, (*lead, rows, plan.top_k_slots(length)))
        if plan.overview:
            blocks = -(-length // plan.overview)
            layout[f"{kind}.overview"] = ("float32", (*lead, blocks, blocks))
        if plan.sentences:
            layout[f"{kind}.{SENTENCE_ATTENTION}"] = ("float32", (*lead, len(plan.sentences), len(plan.sentences)))
        if plan.locality:
            layout[f"{kind}.{LOCALITY}"] = ("float32", (*lead, len(plan.locality)))
        if self.learned_sinks:
            layout[f"{kind}.sink_mass"] = ("float32", (*lead, rows))
        for name, values in self.input_arrays().items():
            layout[name] = (values.dtype.name, values.shape)
        return layout

    def input_arrays(self) -> dict[str, np.ndarray]:
        arrays = side_arrays("input", self.encoded.source)
        arrays["input.query_positions"] = self.plan.queries.positions(len(self.encoded.source.input_ids))
        return arrays

    def _writer(self, n_kept_heads: int) -> RecordWriter:
        if self.writer is None:
            bulk = {"tokens": self.encoded.source.tokens, "text": self.encoded.text}
            self.writer = RecordWriter(self.path, self.layout(n_kept_heads), {"complete": False}, final_meta_hint=bulk)
            for name, values in self.input_arrays().items():
                self.writer.write(name, values)
        return self.writer

    def allocate(self, site: AttentionSite) -> Allocate:
        index = self.layers.index(site.layer)

        def allocate(field_name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> torch.Tensor:
            slab = self._writer(shape[1]).maps[f"{self.kind}.{field_name}"][index]
            if fill != 0:  # the file starts as zeros
                slab.fill(fill)
            # [1, head, row, ...], the file's own memory on the CPU whatever the model's device: rows are
            # copied into it (numpy views, so no tensor of the model's computation is made off its device)
            return torch.from_numpy(slab[None])

        return allocate

    def finish(self, site: AttentionSite, captured: RowCapture) -> RowCapture:
        """Write the layer's small arrays and flush it; keep only what model facts need."""
        writer = self._writer(len(captured.heads))
        index = self.layers.index(site.layer)
        for name, values in captured.statistics.items():
            writer.write_layer(f"{self.kind}.stat_{name}", index, values[0].cpu().numpy())
        if captured.distance_histogram is not None:
            writer.write_layer(f"{self.kind}.distance_histogram", index, captured.distance_histogram[0].cpu().numpy())
        if captured.overview is not None:
            writer.write_layer(f"{self.kind}.overview", index, captured.overview[0].cpu().numpy())
        if captured.sentences is not None:
            writer.write_layer(f"{self.kind}.{SENTENCE_ATTENTION}", index, captured.sentences[0].cpu().numpy())
        if captured.locality is not None:
            writer.write_layer(f"{self.kind}.{LOCALITY}", index, captured.locality[0].cpu().numpy())
        if captured.sink_mass is not None:  # a layer without learned sinks keeps the file's zeros
            writer.write_layer(f"{self.kind}.sink_mass", index, captured.sink_mass[0].cpu().numpy())
        for array in writer.maps.values():
            array.flush()
        self.on_layer(1)
        return RowCapture(rows=captured.rows, heads=captured.heads, n_heads=captured.n_heads,
                          n_kv_heads=captured.n_kv_heads, d_head=captured.d_head, scaling=captured.scaling)

    def close(self, info: ModelInfo) -> Path:
        assert self.writer is not None, "no layer was captured"
        heads = tuple(self.plan.head_numbers(info.n_heads))
        meta = record_metadata(info, self.encoded.source.tokens, text=self.encoded.text,
                               selection=Selection(self.layers, heads, self.plan.describe()))
        return self.writer.close(meta)
