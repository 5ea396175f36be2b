"""Planned capture: attention computed in query chunks, and what a plan keeps of each chunk.

:func:`chunked_attention` computes one attention layer ``chunk`` queries at a time, so the layer
never holds more than ``[batch, head, chunk, k_pos]`` scores. Each chunk of probabilities goes to
a :class:`RowCollector`, which keeps what the :class:`~attnscope.capture.plan.CapturePlan` asks
for: the selected rows, per-row statistics, a distance histogram, the top-k keys and a
block-averaged overview. Memory per layer is O(head x chunk x k_pos) while computing, plus what
is kept.

Statistics, per selected ``(head, q_pos)`` row ``p`` over keys ``k`` (``q`` is the query's
position):

* ``first``: ``p[0]``, the mass on the first token (the attention sink of decoders, [CLS] of
  encoders);
* ``special``: the mass on special tokens;
* ``self`` / ``prev`` / ``next``: ``p[q]``, ``p[q-1]``, ``p[q+1]`` (NaN where there is no such
  key; ``next`` is NaN for causal attention, as in :mod:`attnscope.analysis.stats`);
* ``entropy``: ``-sum p log p`` in nats; ``distance``: ``sum p |q - k|``; ``max_weight``: ``max p``.

Locality, per ``(sink, window)`` pair ``(k, w)`` of the plan and per head: the mean over each item's selected
rows of ``1 - sum p[j]`` over the keys ``k <= j <= q - w``, the share of the row that a cache of the first
``k`` keys and the ``w`` most recent ones (the query's own key included) keeps. A learned sink (gpt-oss) is
not a key: it is never evicted, so its mass counts as kept.

The distance histogram sums, per head, each selected row's mass at distances ``|q - k|`` in the
bins of :func:`distance_bin_edges` (0, 1, 2, 3-4, 5-8, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch

from ..records.format import ROW_STATISTICS, distance_bin_edges
from .plan import CapturePlan


@dataclass
class BatchFacts:
    """What planned capture needs to know about the batch, set by extraction before the forward.

    ``lengths``: ``[batch]`` real tokens per item; ``special``: bool ``[batch, pos]``;
    ``selected``: per item, the sorted query positions its plan keeps.
    """

    lengths: list[int]
    special: torch.Tensor
    selected: list[np.ndarray]

    @property
    def rows(self) -> np.ndarray:
        """The union of the items' selected positions: ``[n_rows]``, sorted."""
        return np.unique(np.concatenate(self.selected))

    def membership(self, device: torch.device | None = None) -> torch.Tensor:
        """float ``[batch, n_rows]``: 1 where a union row is one of that item's selected positions."""
        rows = self.rows
        return torch.tensor(np.stack([np.isin(rows, chosen) for chosen in self.selected]), dtype=torch.float32,
                            device=device)


@dataclass
class RowCapture:
    """What a planned capture kept of one attention site, for the whole batch (float32 tensors).

    Rows are the union ``rows`` of the items' selected positions; ``heads`` the kept heads.
    ``attention``/``norms``: ``[batch, head, row, k_pos]``; ``statistics[name]``: ``[batch, head, row]``;
    ``distance_histogram``: ``[batch, head, bin]`` (mass summed over each item's own rows);
    ``topk_indices`` (int32, -1 where the row has fewer keys) / ``topk_weights``: ``[batch, head, row, k]``;
    ``overview``: ``[batch, head, q_block, k_block]``; ``sentences``: ``[batch, head, q_sentence, k_sentence]``, each
    block's mean over its query and key tokens (the plan's sentence spans); ``sink_mass``: ``[batch, head, row]``, learned sinks' share
    of each row (gpt-oss; None without sinks); ``locality``: ``[batch, head, pair]``, the mean kept share of each
    item's selected rows per ``(sink, window)`` pair of the plan.
    """

    rows: np.ndarray
    heads: tuple[int, ...]
    n_heads: int
    n_kv_heads: int
    d_head: int
    scaling: float
    attention: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)
    distance_histogram: torch.Tensor | None = None
    topk_indices: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    overview: torch.Tensor | None = None
    sentences: torch.Tensor | None = None
    sink_mass: torch.Tensor | None = None
    locality: torch.Tensor | None = None

    def cpu(self) -> RowCapture:
        """The same capture with every tensor on the CPU (itself when they already are): one copy per
        field, made once per batch before records are cut out of it."""
        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.cpu()

        return replace(self, attention=moved(self.attention), norms=moved(self.norms),
                       statistics={name: value.cpu() for name, value in self.statistics.items()},
                       distance_histogram=moved(self.distance_histogram), topk_indices=moved(self.topk_indices),
                       topk_weights=moved(self.topk_weights), overview=moved(self.overview),
                       sentences=moved(self.sentences), sink_mass=moved(self.sink_mass),
                       locality=moved(self.locality))


Allocate = Callable[[str, tuple[int, ...], torch.dtype, float], torch.Tensor]
"""``allocate(field, shape, dtype, fill)``: where a collector keeps a large field (attention rows,
norms, top-k); streaming capture hands out views of the record file being written."""


def new_tensor(field_name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float,
               device: torch.device | None = None) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype, device=device)


def put_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, first_key: int = 0) -> None:
    """``buffer[:, :, slots, first_key:first_key + k] = rows`` (``[batch, head, n, k]``), moved to the buffer's
    device and dtype: a streamed buffer is a float16 view of a file on the CPU, whatever device computes."""
    keys = slice(first_key, first_key + rows.shape[-1])
    buffer[:, :, slots.to(buffer.device), keys] = rows.to(buffer.device, buffer.dtype)


def row_entropy(probs: torch.Tensor, logits: torch.Tensor | None, largest: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` of each row ``[..., k]`` in nats; ``largest`` is each row's max of ``probs``.

    With the logits ``s`` that ``p`` is the softmax of, ``log p = s - lse`` and ``lse = max(s) -
    log(max(p))``, so the entropy is ``lse - sum p s``: one product with no logarithm over the row
    (einsum, not ``(p * s).sum()``: no temporary). Masked logits are the dtype's finite minimum,
    where ``p = 0``.
    """
    if logits is None:
        return torch.special.entr(probs).sum(-1)
    log_partition = logits.amax(-1) - largest.log()
    return log_partition - torch.einsum("...k,...k->...", probs, logits)


def prefix_sums_at(rows: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``S[..., i, j] = sum of rows[..., i, k] over keys k <= positions[i] + offsets[j]`` (0 below key 0).

    ``rows``: ``[batch, head, n, k]``; ``positions``: ``[n]`` sorted, within one chunk; ``offsets``:
    ``[m]`` sorted. Cheaper than a cumulative sum over every key (sequential on CPU): the keys up to
    each offset's common cut (the smallest position + offset) are summed in segments, read once in
    all, and only the window from there to each row's own limit, at most the chunk's width, is
    summed per row under a mask. Returns ``[batch, head, n, m]``.
    """
    n_keys = rows.shape[-1]
    first, last = int(positions[0]), int(positions[-1])
    cuts = [min(max(first + int(o), 0), n_keys) for o in offsets]  # keys < cut: the same for every row
    segments = [rows[..., a:b].sum(-1) for a, b in zip([0, *cuts[:-1]], cuts)]
    whole = torch.stack(segments, dim=-1).cumsum(-1)  # [b, h, n, m]: mass of keys < cut
    windows = []
    for cut, offset in zip(cuts, offsets):
        stop = min(max(last + int(offset) + 1, cut), n_keys)
        keys = torch.arange(cut, stop, device=rows.device)
        inside = (keys[None, :] <= (positions + offset)[:, None]).float()  # [n, window]
        windows.append(torch.einsum("bhnw,nw->bhn", rows[..., cut:stop], inside))
    return whole + torch.stack(windows, dim=-1)


class RowCollector:
    """Receives one site's probabilities chunk by chunk and keeps what the plan asks for.

    What it keeps lives on ``device``, the device the site computes on, except the large fields
    that ``allocate`` places (views of a file on the CPU when streaming)."""

    def __init__(self, plan: CapturePlan, facts: BatchFacts, *, n_heads: int, n_keys: int, causal: bool,
                 value_norms: torch.Tensor | None = None, allocate: Allocate | None = None,
                 device: torch.device | None = None) -> None:
        self.plan, self.facts, self.causal, self.n_keys, self.device = plan, facts, causal, n_keys, device
        self.chunk, self.wants_logits = plan.chunk, plan.statistics  # how the attention function feeds it
        plan.check_against(n_heads=n_heads)
        self.heads = plan.head_numbers(n_heads)
        self.head_index = torch.tensor(self.heads, device=device)
        self.rows = facts.rows
        self.row_lookup = {int(p): i for i, p in enumerate(self.rows)}
        self.special = facts.special.to(device)  # [batch, pos]
        self.lengths = torch.tensor(facts.lengths, device=device)  # [batch]
        allocate = allocate or partial(new_tensor, device=device)
        batch, n_rows, n_kept_heads = len(facts.lengths), len(self.rows), len(self.heads)
        shape = (batch, n_kept_heads, n_rows)
        self.value_norms = None if value_norms is None else value_norms[:, self.head_index]  # [batch, head, k_pos]
        wants_norms = plan.attention and value_norms is not None
        self.attention = allocate("attention", (*shape, n_keys), torch.float32, 0.0) if plan.attention else None
        self.norms = allocate("norms", (*shape, n_keys), torch.float32, 0.0) if wants_norms else None
        self.statistics = ({name: torch.full(shape, float("nan"), device=device) for name in ROW_STATISTICS}
                           if plan.statistics else {})
        self.bins = torch.from_numpy(distance_bin_edges(n_keys)).to(device)
        self.histogram = torch.zeros((batch, n_kept_heads, len(self.bins)), device=device) if plan.statistics else None
        self.membership = facts.membership(device)  # [batch, row]
        self.sink_mass: torch.Tensor | None = None  # [batch, head, row], from the first chunk with learned sinks
        if plan.top_k:
            slots = plan.top_k_slots(n_keys)
            self.topk_indices = allocate("topk_indices", (*shape, slots), torch.int32, -1)
            self.topk_weights = allocate("topk_weights", (*shape, slots), torch.float32, 0.0)
        if plan.overview:
            blocks = -(-n_keys // plan.overview)
            self.overview_sum = torch.zeros((batch, n_kept_heads, blocks, blocks), device=device)
            self.overview_rows = torch.zeros((batch, 1, blocks, 1), device=device)
        if plan.sentences:
            plan.check_sentences(n_keys)
            self.sentence_sum = SentenceSums(plan.sentences, n_keys, (batch, n_kept_heads), device)
        if plan.locality:
            self.locality_sum = LocalitySums(plan.locality, (batch, n_kept_heads), device)

    # ---- per chunk ---------------------------------------------------------------------------
    def add(self, start: int, probs: torch.Tensor, logits: torch.Tensor | None = None, *,
            sink_mass: torch.Tensor | None = None, first_key: int = 0) -> None:
        """Take the probabilities of queries ``start ..`` over keys ``first_key ..``: ``[batch, head, chunk, k]``
        float32, where keys ``first_key .. first_key + k - 1`` were computed (the others are known to be 0:
        a sliding window's, a causal row's future), the logits they are the softmax of, if at hand (they make
        the entropy cheaper), and with learned sinks the rows' sink mass ``[batch, head, chunk]``."""
        probs = self._kept_heads(probs)
        logits = None if logits is None else self._kept_heads(logits)
        if self.plan.overview:
            self._add_overview(start, probs, first_key)
        if self.plan.sentences:
            self.sentence_sum.add(start, probs, self._real(start, probs.shape[2]), first_key)
        positions = [p for p in range(start, start + probs.shape[2]) if p in self.row_lookup]
        if not positions:
            return
        slots = torch.tensor([self.row_lookup[p] for p in positions], device=probs.device)
        rows = self._rows(probs, start, positions)
        row_logits = None if logits is None else self._rows(logits, start, positions)
        k_seen = rows.shape[-1]  # keys first_key .. first_key + k_seen - 1
        if sink_mass is not None:
            self._add_sink_mass(slots, self._rows(self._kept_heads(sink_mass)[..., None], start, positions)[..., 0])
        if self.attention is not None:
            put_rows(self.attention, slots, rows, first_key)
        if self.norms is not None and self.value_norms is not None:
            put_rows(self.norms, slots, rows * self.value_norms[:, :, None, first_key:first_key + k_seen], first_key)
        if self.plan.statistics:
            self._add_statistics(slots, torch.tensor(positions, device=probs.device), rows, row_logits, first_key)
        if self.plan.top_k:
            self._add_top_k(slots, rows, first_key)
        if self.plan.locality:
            self.locality_sum.add(rows, torch.tensor(positions, device=probs.device), self.membership[:, slots],
                                  first_key)

    def _add_sink_mass(self, slots: torch.Tensor, sink_mass: torch.Tensor) -> None:
        """Keep the selected rows' sink mass ``[batch, head, n]`` (every row a sink capture holds)."""
        if self.sink_mass is None:
            self.sink_mass = torch.zeros((*sink_mass.shape[:2], len(self.rows)), device=sink_mass.device)
        self.sink_mass[:, :, slots] = sink_mass

    def _kept_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` restricted to the kept heads (no copy when every head is kept)."""
        if len(self.heads) == tensor.shape[1]:
            return tensor
        return tensor.index_select(1, self.head_index)

    @staticmethod
    def _rows(tensor: torch.Tensor, start: int, positions: list[int]) -> torch.Tensor:
        """The chunk's selected rows (a view when they are all of them)."""
        if len(positions) == tensor.shape[2]:
            return tensor
        return tensor.index_select(2, torch.tensor(positions, device=tensor.device) - start)

    def _add_statistics(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                        logits: torch.Tensor | None, first_key: int = 0) -> None:
        """Row statistics (see the module docstring) and the distance histogram of rows ``[b, h, n, k_seen]``
        over keys ``first_key ..`` (the keys before are 0)."""
        k_seen = rows.shape[-1]
        key_positions = torch.arange(first_key, first_key + k_seen, dtype=torch.float32, device=rows.device)
        special = self.special[:, first_key:first_key + k_seen].float()  # [batch, k_seen]
        stats = self.statistics
        stats["first"][:, :, slots] = rows[..., 0] if first_key == 0 else 0.0
        # products with one vector each: on CPU several times faster than one with a [k_seen, 2] matrix
        stats["special"][:, :, slots] = torch.einsum("bhnk,bk->bhn", rows, special)
        largest = rows.amax(-1)
        stats["max_weight"][:, :, slots] = largest
        stats["entropy"][:, :, slots] = row_entropy(rows, logits, largest)
        if self.causal:  # every key is at or before the query: sum p |q - k| = q - sum p k
            stats["distance"][:, :, slots] = positions.float() - torch.einsum("bhnk,k->bhn", rows, key_positions)
        else:
            distance = (positions[:, None] - key_positions[None, :]).abs()  # [n, k_seen]
            stats["distance"][:, :, slots] = torch.einsum("bhnk,nk->bhn", rows, distance)
        lengths = self.lengths[:, None, None]  # [batch, 1, 1]: each item's own keys
        for name, offset in {"self": 0, "prev": -1, **({} if self.causal else {"next": 1})}.items():
            target = positions + offset
            valid = (target >= 0) & (target < lengths)  # [batch, 1, n]
            column = target - first_key
            gathered = rows.gather(-1, column.clamp(0, k_seen - 1).expand(*rows.shape[:2], -1)[..., None])[..., 0]
            gathered = torch.where((column >= 0) & (column < k_seen), gathered, 0.0)  # keys never computed are 0
            stats[name][:, :, slots] = torch.where(valid, gathered, float("nan"))
        self._add_histogram(slots, positions, rows, first_key)

    def _add_histogram(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                       first_key: int = 0) -> None:
        """Mass per distance bin, as differences of prefix sums: keys ``q - high .. q - low`` and
        ``q + low .. q + high`` (the second range only where ``low > 0``, never for causal attention).
        ``rows`` hold keys ``first_key ..``: prefix sums over them, at positions counted from ``first_key``, are
        the prefix sums over every key (the keys before are 0)."""
        assert self.histogram is not None
        low, high = self.bins[:, 0].contiguous(), self.bins[:, 1].contiguous()
        # S(q + o) for: left ranges end at q - low and start after q - high - 1; right ranges likewise
        ends = [(-low, -high - 1)] if self.causal else [(-low, -high - 1), (high, low - 1)]
        offsets = torch.unique(torch.cat([torch.cat(pair) for pair in ends]))
        prefix = prefix_sums_at(rows, positions - first_key, offsets)  # [b, h, n, offset]

        def at(offset: torch.Tensor) -> torch.Tensor:
            return prefix[..., torch.searchsorted(offsets, offset)]

        per_row = at(-low) - at(-high - 1)  # [b, h, n, bin]
        if not self.causal:
            per_row = per_row + torch.where(low > 0, at(high) - at(low - 1), 0.0)
        weights = self.membership[:, slots]  # [batch, n]: rows that belong to each item
        self.histogram += torch.einsum("bhnc,bn->bhc", per_row, weights)

    def _add_top_k(self, slots: torch.Tensor, rows: torch.Tensor, first_key: int = 0) -> None:
        k = min(self.plan.top_k, rows.shape[-1])
        weights, indices = rows.topk(k, dim=-1)
        indices = torch.where(weights > 0, indices + first_key, -1)
        put_rows(self.topk_weights, slots, weights)
        put_rows(self.topk_indices, slots, indices)

    def _add_overview(self, start: int, probs: torch.Tensor, first_key: int = 0) -> None:
        """Block sums of every query row (the overview keeps all rows, not just the selected ones) of keys
        ``first_key ..``."""
        block = min(self.plan.overview, self.n_keys)  # a block wider than the input is the whole input
        first_block, before = divmod(first_key, block)
        batch, heads, n, k_seen = probs.shape
        padded = torch.nn.functional.pad(probs, (before, -(before + k_seen) % block))
        key_blocks = padded.view(batch, heads, n, -1, block).sum(-1)  # [b, h, n, blocks from first_block]
        positions = torch.arange(start, start + n, device=probs.device)
        real = (positions[None, :] < self.lengths[:, None]).float()  # [batch, n]: not padding
        query_block = positions // block
        weighted = key_blocks * real[:, None, :, None]
        self.overview_sum[:, :, :, first_block:first_block + key_blocks.shape[-1]].index_add_(2, query_block, weighted)
        self.overview_rows.index_add_(2, query_block, real[:, None, :, None])

    def _real(self, start: int, n: int) -> torch.Tensor:
        """float ``[batch, n]``: 1 where query ``start + i`` is one of the item's tokens, 0 on padding."""
        positions = torch.arange(start, start + n, device=self.lengths.device)
        return (positions[None, :] < self.lengths[:, None]).float()

    # ---- at the end of the layer ---------------------------------------------------------------
    def finish(self, *, n_heads: int, n_kv_heads: int, d_head: int, scaling: float) -> RowCapture:
        result = RowCapture(rows=self.rows, heads=self.heads, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                            scaling=scaling, attention=self.attention, norms=self.norms, statistics=self.statistics,
                            distance_histogram=self.histogram, sink_mass=self.sink_mass)
        if self.plan.top_k:
            result.topk_indices, result.topk_weights = self.topk_indices, self.topk_weights
        if self.plan.overview:
            result.overview = self.overview_sum / self.overview_rows.clamp(min=1)
        if self.plan.sentences:
            result.sentences = self.sentence_sum.means()
        if self.plan.locality:
            result.locality = self.locality_sum.sums / self.membership.sum(1)[:, None, None]
        return result


class LocalitySums:
    """Per ``(sink, window)`` pair, the kept share of selected rows (module docstring), summed per item as query
    chunks arrive: ``sums`` ``[batch, head, pair]``."""

    def __init__(self, pairs: tuple[tuple[int, int], ...], lead: tuple[int, int],
                 device: torch.device | None) -> None:
        self.sinks = torch.tensor([sink for sink, _ in pairs], device=device)  # [pair]
        self.windows = torch.tensor([window for _, window in pairs], device=device)  # [pair]
        self.offsets = torch.unique(-self.windows)  # sorted, as prefix_sums_at needs
        self.column = torch.searchsorted(self.offsets, -self.windows)  # [pair]: each pair's offset
        self.sums = torch.zeros((*lead, len(pairs)), device=device)

    def add(self, rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, first_key: int = 0) -> None:
        """Rows ``[batch, head, n, k]`` of keys ``first_key ..`` at query ``positions`` ``[n]``; ``weights``
        ``[batch, n]``: 1 where the row is one of that item's selected rows."""
        k_seen = rows.shape[-1]
        # mass on keys <= q - w (keys before first_key were never computed: they are 0)
        up_to_recent = prefix_sums_at(rows, positions - first_key, self.offsets)[..., self.column]  # [b, h, n, pair]
        before_sink = torch.stack([rows[..., : min(max(int(sink) - first_key, 0), k_seen)].sum(-1)
                                   for sink in self.sinks], dim=-1)  # [b, h, n, pair]: keys < k
        evicted = (positions[:, None] - self.windows[None, :]) >= self.sinks[None, :]  # [n, pair]: keys k .. q - w
        outside = torch.where(evicted, up_to_recent - before_sink, 0.0)
        self.sums += torch.einsum("bhnm,bn->bhm", 1.0 - outside, weights)


class SentenceSums:
    """Attention summed into sentence x sentence blocks as query chunks arrive, for the block means.

    Tokens outside every span go to one extra label, dropped at the end; memory ``[batch, head, S + 1, S + 1]``."""

    def __init__(self, spans: tuple[tuple[int, int], ...], n_keys: int, lead: tuple[int, int],
                 device: torch.device | None) -> None:
        n = len(spans)
        labels = np.full(n_keys, n, dtype=np.int64)  # n: in no sentence
        for index, (start, stop) in enumerate(spans):
            labels[start:stop] = index
        self.labels = torch.from_numpy(labels).to(device)
        self.sizes = torch.tensor([stop - start for start, stop in spans], dtype=torch.float32, device=device)
        self.sums = torch.zeros((*lead, n + 1, n + 1), device=device)

    def add(self, start: int, probs: torch.Tensor, real: torch.Tensor, first_key: int = 0) -> None:
        """Rows ``start ..`` of keys ``first_key ..`` (``[batch, head, n, k]``; padding rows weigh 0 by ``real``)."""
        batch, heads, n, k_seen = probs.shape
        key_labels = self.labels[first_key:first_key + k_seen]
        per_sentence = torch.zeros((batch, heads, n, self.sums.shape[-1]), device=probs.device)
        per_sentence.index_add_(-1, key_labels, probs)  # [b, h, n, sentence]: each row's sum per key sentence
        self.sums.index_add_(2, self.labels[start:start + n], per_sentence * real[:, None, :, None])

    def means(self) -> torch.Tensor:
        """``[batch, head, q_sentence, k_sentence]``: each block's sum over its query count times key count."""
        n = len(self.sizes)
        return self.sums[..., :n, :n] / (self.sizes[:, None] * self.sizes[None, :])
