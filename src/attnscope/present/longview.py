"""Views of long inputs (thousands of tokens), drawn from a block-averaged overview and top-k rows.

At 8,192 tokens a head's full ``[q_pos, k_pos]`` matrix has 67 million weights; 30 layers x 9
heads of them would make a 36 GB page. The long view ships instead, per (layer, head):

* the **overview** ``[R, R]``: tokens grouped in consecutive blocks of ``block`` tokens
  (``R = ceil(T / block)``, the last block may be shorter); cell ``(i, j)`` is the mean over the
  queries of block ``i`` of their summed attention to the keys of block ``j``, so each row still
  sums to 1 over ``j`` (:func:`downsample_attention` is the reference). The page may group the
  capture's blocks further (:func:`coarsen_overview`) to stay within its size budget;
* the **top-k rows**: for each query its ``k`` strongest keys and their weights (the rest of the
  row, ``1 - sum(weights)``, is not drawn);
* the **thumbnails** of the model view: the overview grouped further to at most 48 x 48 cells.

The page (``static/long_view.js``) shows a zoomable heatmap (the overview when zoomed out, the
top-k weights of each query when a canvas pixel holds a token or less, token labels under 80
tokens), the model view of thumbnails, and the line-based head view of a window of <= 128 tokens
drawn from the top-k rows. Arrays are packed per (layer, head) so the page decodes only the head it
shows. Schema: ``longview.schema.json``.

>>> page = long_view(tokens, overview, 32, indices, weights, layers=[0], heads=[0, 1],
...                  causal=True, special_mask=special)            # doctest: +SKIP
>>> page.save("long.html")                                          # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..progress import say_slow_step
from ..records.attention import AttentionRecord
from .html import SCRIPTS, STYLES, AttentionView, static_text
from .payload import LongPayload, Overview, PackedArray, Thumbnails, TopK, pack_float16, pack_uint16

FORMAT = "attnscope.longview"
VERSION = 1

LONG_VIEWS = {
    "heatmap": "a zoomable heatmap of one head (or the mean of a layer's heads), token labels when zoomed in",
    "model": "a grid of layers x heads thumbnails of the overview; click one to open it in the heatmap",
    "window": "the line-based head view of a window of <= 128 tokens, from the top-k keys of each query",
}
"""Registry of the long view's panels: name -> what it shows."""

MAX_WINDOW = 128  # tokens in the window head view (its lines need every (query, key) pair of the window)
MAX_OVERVIEW = 256  # overview cells per side in the page, at most
THUMBNAIL = 48  # thumbnail cells per side, at most
MAX_INDEX = 65535  # key positions are shipped as uint16


def downsample_attention(matrix: np.ndarray, block: int) -> np.ndarray:
    """Block-averaged attention: ``[..., q, k]`` -> ``[..., ceil(q/block), ceil(k/block)]``.

    Cell ``(i, j)`` = mean over the queries of query block ``i`` of their summed weight on the keys
    of key block ``j`` (the last blocks may be shorter), so rows of a row-stochastic matrix still
    sum to 1.
    """
    return _regroup(np.asarray(matrix, dtype=np.float64), block, np.ones(matrix.shape[-2]))


def top_k_rows(matrix: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` strongest keys: ``[..., q, k_pos]`` -> indices and weights ``[..., q, k]``, strongest
    first (ties: the earlier key first). For short records whose full attention is at hand; long inputs
    get these rows from the capture."""
    k = min(k, matrix.shape[-1])
    order = np.argsort(-matrix, axis=-1, kind="stable")[..., :k]
    return order, np.take_along_axis(matrix, order, axis=-1)


def coarsen_overview(overview: np.ndarray, block: int, tokens: int, factor: int) -> np.ndarray:
    """An overview of ``block``-token blocks ``[..., R, R]`` -> the overview of ``block * factor``-token
    blocks, exactly as :func:`downsample_attention` would give it from the full matrix (each query
    block is weighted by its number of queries: the last one may be shorter)."""
    rows = overview.shape[-2]
    queries_per_row = np.minimum(block, tokens - block * np.arange(rows))
    return _regroup(np.asarray(overview, dtype=np.float64), factor, queries_per_row.astype(np.float64))


def _regroup(cells: np.ndarray, factor: int, row_counts: np.ndarray) -> np.ndarray:
    """``cells [..., R, C]`` whose rows are means over ``row_counts[r]`` queries -> groups of ``factor``
    rows and columns: columns summed, rows averaged weighting each by its count."""
    summed = _sum_groups(_sum_groups(cells * row_counts[:, None], factor, axis=-1), factor, axis=-2)
    counts = _sum_groups(row_counts, factor, axis=-1)  # [ceil(R / factor)]
    return summed / counts[:, None]


def _sum_groups(values: np.ndarray, factor: int, axis: int) -> np.ndarray:
    """Sums of consecutive groups of ``factor`` entries along ``axis`` (the last group may be shorter)."""
    values = np.moveaxis(values, axis, -1)
    size = values.shape[-1]
    groups = math.ceil(size / factor)
    padded = np.zeros((*values.shape[:-1], groups * factor), dtype=values.dtype)
    padded[..., :size] = values
    return np.moveaxis(padded.reshape(*values.shape[:-1], groups, factor).sum(axis=-1), -1, axis)


# ---- the view --------------------------------------------------------------------------------------
def long_view(tokens: Sequence[str], overview: np.ndarray, block: int, topk_indices: np.ndarray,
              topk_weights: np.ndarray, *, layers: Sequence[int], heads: Sequence[int], causal: bool,
              special_mask: Sequence[bool] | np.ndarray, title: str | None = None,
              max_mb: float = 36.0) -> AttentionView:
    """The long-input view (heatmap, model view, window head view) as one offline HTML page.

    ``overview`` ``[layer, head, R, R]`` is block-averaged attention (``R = ceil(T / block)``, see
    :func:`downsample_attention`); ``topk_indices`` / ``topk_weights`` ``[layer, head, q_pos, k]``
    hold each query's strongest keys, sorted by weight, descending (weight 0 = no key). ``layers``
    and ``heads`` name the layers and heads the arrays hold (0-indexed). The page stays under about
    ``max_mb`` MB: the overview is grouped into coarser blocks and fewer top-k keys are shipped when
    needed (the page says so).
    """
    return AttentionView(build_long_payload(tokens, overview, block, topk_indices, topk_weights, layers=layers,
                                            heads=heads, causal=causal, special_mask=special_mask, title=title,
                                            max_mb=max_mb))


def long_view_of(record: AttentionRecord, *, title: str | None = None, max_mb: float = 36.0,
                 progress: bool = False) -> AttentionView:
    """The long view of a record captured with an overview and top-k keys for every query
    (``CapturePlan(attention=False, top_k=32, overview=block)``, as ``attnscope view --long`` does).
    ``progress``: say on stderr when the page starts building (tens of seconds for a whole document)."""
    kind = record.model.main_kind
    overview, indices, weights = (record.get(kind, name) for name in ("overview", "topk_indices", "topk_weights"))
    if overview is None or indices is None or weights is None:
        raise AttnscopeError(f"the long view needs an overview and top-k keys, but this record is {record.holdings()}; "
                             "capture it with attnscope view --long, or extract --overview BLOCK --top-k K")
    if len(record.query_positions) != len(record.tokens):
        raise AttnscopeError("the long view needs the top-k keys of every query; this record kept "
                             f"{len(record.query_positions)} of {len(record.tokens)} query rows")
    block = int((record.selection.plan if record.selection else {}).get("overview") or 0)
    if block < 1:
        raise AttnscopeError("this record does not say the overview's block size (capture it with a plan)")
    if progress:
        say_slow_step(f"building the long view of {len(record.tokens):,} tokens")
    return long_view(record.tokens, overview, block, indices, weights, layers=record.layers_held,
                     heads=record.heads_held, causal=record.model.causal, special_mask=record.special_mask,
                     title=title, max_mb=max_mb)


def build_long_payload(tokens: Sequence[str], overview: np.ndarray, block: int, topk_indices: np.ndarray,
                       topk_weights: np.ndarray, *, layers: Sequence[int], heads: Sequence[int], causal: bool,
                       special_mask: Sequence[bool] | np.ndarray, title: str | None = None,
                       max_mb: float = 36.0) -> LongPayload:
    """The JSON-ready payload of :func:`long_view` (schema: ``longview.schema.json``)."""
    tokens = list(tokens)
    special = np.asarray(special_mask, dtype=bool)
    # tensors or memory-mapped arrays from a record become numpy arrays (read once, here)
    overview, topk_indices, topk_weights = (np.asarray(a) for a in (overview, topk_indices, topk_weights))
    _check(tokens, overview, block, topk_indices, topk_weights, layers, heads, special)
    budget = max_mb * 1e6 * 3 / 4  # bytes before base64
    page_overview = _overview(overview, block, len(tokens), budget / 3)
    thumbnails = _thumbnails(overview, block, len(tokens))
    # the scripts and styles, the tokens and about as much again for their special flags
    page_frame = len(static_text(SCRIPTS)) + len(static_text(STYLES)) + len(json.dumps(tokens)) * 2
    used = _packed_bytes(page_overview) + _packed_bytes(thumbnails) + page_frame * 3 / 4
    top_k = _top_k(topk_indices, topk_weights, budget - used)
    return LongPayload(
        format=FORMAT,
        version=VERSION,
        title=title or f"attention over {len(tokens):,} tokens",
        views=list(LONG_VIEWS),
        notes=_notes(page_overview, top_k),
        tokens=tokens,
        special=[bool(s) for s in special],
        causal=bool(causal),
        layers=[int(layer) for layer in layers],
        heads=[int(head) for head in heads],
        overview=page_overview,
        thumbnails=thumbnails,
        top_k=top_k,
        window={"max_width": MAX_WINDOW, "width": min(64, len(tokens))},
    )


def _check(tokens: list[str], overview: np.ndarray, block: int, indices: np.ndarray, weights: np.ndarray,
           layers: Sequence[int], heads: Sequence[int], special: np.ndarray) -> None:
    """One clear error for arrays that do not fit together."""
    n = len(tokens)
    if n == 0 or block < 1:
        raise AttnscopeError("the long view needs at least one token and a block of at least 1 token")
    if n > MAX_INDEX + 1:
        raise AttnscopeError(f"the long view holds at most {MAX_INDEX + 1:,} tokens, got {n:,}")
    cells = math.ceil(n / block)
    expected = (len(layers), len(heads), cells, cells)
    if overview.shape != expected:
        raise AttnscopeError(f"overview has shape {list(overview.shape)}; for {n} tokens in blocks of {block}, "
                             f"{len(layers)} layers and {len(heads)} heads it must be {list(expected)}")
    if indices.shape != weights.shape or indices.ndim != 4 or indices.shape[:3] != (len(layers), len(heads), n):
        raise AttnscopeError(f"top-k indices {list(indices.shape)} and weights {list(weights.shape)} must both be "
                             f"[{len(layers)}, {len(heads)}, {n}, k]")
    if special.shape != (n,):
        raise AttnscopeError(f"special_mask has {special.size} entries for {n} tokens")


def _overview(overview: np.ndarray, block: int, tokens: int, budget: float) -> Overview:
    """The overview at the finest grouping of blocks that fits ``budget`` packed bytes and MAX_OVERVIEW cells."""
    cells = overview.shape[-1]
    factor = math.ceil(cells / MAX_OVERVIEW)
    while True:
        section = _pack_overview(overview, block, tokens, factor)
        size = _packed_bytes(section)
        if size <= budget or factor >= cells:
            return section
        # packed bytes grow about as the cells, (cells / factor) ** 2: jump close to the factor that fits
        factor = min(cells, max(factor + 1, math.floor(factor * math.sqrt(size / budget))))


def _pack_overview(overview: np.ndarray, block: int, tokens: int, factor: int) -> Overview:
    layers, heads = overview.shape[:2]
    page = coarsen_overview(overview, block, tokens, factor) if factor > 1 else overview
    mean = page.mean(axis=1)  # [layer, R, R]: the mean of the heads' block averages = block average of their mean
    return Overview(block=block * factor, source_block=block, size=page.shape[-1],
                    heads=[[pack_float16(page[layer, head], True) for head in range(heads)] for layer in range(layers)],
                    mean=[pack_float16(mean[layer], True) for layer in range(layers)])


def _thumbnails(overview: np.ndarray, block: int, tokens: int) -> Thumbnails:
    factor = math.ceil(overview.shape[-1] / THUMBNAIL)
    small = coarsen_overview(overview, block, tokens, factor) if factor > 1 else overview
    return Thumbnails(block=block * factor, size=small.shape[-1], data=pack_float16(small, True))


def _top_k(indices: np.ndarray, weights: np.ndarray, budget: float) -> TopK:
    """The top-k rows with as many keys per query as fit ``budget`` bytes (at least 1)."""
    source_k = indices.shape[-1]
    k = min(source_k, _keys_that_fit(indices, weights, budget))
    while True:
        packed = [[_pack_rows(indices[layer, head, :, :k], weights[layer, head, :, :k]) for head in
                   range(indices.shape[1])] for layer in range(indices.shape[0])]
        size = _packed_bytes(packed)
        if size <= budget or k == 1:
            break
        k -= 1
    return TopK(k=k, source_k=source_k, indices=[[i for i, _ in row] for row in packed],
                weights=[[w for _, w in row] for row in packed])


def _keys_that_fit(indices: np.ndarray, weights: np.ndarray, budget: float) -> int:
    """Keys per query whose packed size, estimated from up to 16 heads spread over the record, fits ``budget``."""
    layers, heads = indices.shape[:2]
    spread = np.linspace(0, layers * heads - 1, min(16, layers * heads)).round().astype(int)
    first_ranks = np.zeros(indices.shape[-1])  # [r]: packed bytes of ranks 0..r
    for flat in spread:
        layer, head = divmod(int(flat), heads)
        for slab in _rank_major(indices[layer, head], weights[layer, head]):
            first_ranks += _prefix_bytes(slab)
    first_ranks *= layers * heads / len(spread)
    return max(1, int(np.searchsorted(first_ranks, budget, side="right")))


def _prefix_bytes(slab: np.ndarray) -> np.ndarray:
    """Deflated bytes of the first 1, 2, ... rows of ``slab [k, q_pos]``, from one stream flushed after each row."""
    stream = zlib.compressobj(6)
    sizes, total = [], 0
    for row in slab:
        total += len(stream.compress(row.tobytes())) + len(stream.flush(zlib.Z_SYNC_FLUSH))
        sizes.append(total)
    return np.asarray(sizes, dtype=np.float64)


def _rank_major(indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[q_pos, k]`` -> ``[k, q_pos]`` uint16 index differences along q_pos and float16 weights.

    Differences make a diagonal (previous token, self) or a column (first token) a run of one value,
    which deflate shrinks to almost nothing. Entries with weight 0 (no key) are stored as position 0.
    """
    positions = np.where(weights > 0, indices, 0).astype(np.int64).T  # [k, q_pos]
    steps = np.diff(positions, axis=1, prepend=0) % (MAX_INDEX + 1)
    return steps.astype("<u2"), weights.T.astype("<f2")


def _pack_rows(indices: np.ndarray, weights: np.ndarray) -> tuple[PackedArray, PackedArray]:
    steps, rows = _rank_major(indices, weights)
    return pack_uint16(steps, True), pack_float16(rows, True)


def unpack_top_k(indices: PackedArray, weights: PackedArray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of the page's packing, for tests and tools: ``[q_pos, k]`` int64 indices, float32 weights."""
    from .payload import unpack

    positions = np.cumsum(unpack(indices).astype(np.int64), axis=1) % (MAX_INDEX + 1)
    return positions.T, unpack(weights).T


def _packed_bytes(section: Any) -> float:
    """Bytes ``section`` takes in the page, counted before base64 (the budget's unit)."""
    return len(json.dumps(section)) * 3 / 4


def _notes(overview: Overview, top_k: TopK) -> list[str]:
    notes = []
    if overview["block"] != overview["source_block"]:
        notes.append(f"overview in blocks of {overview['block']} tokens (captured in blocks of "
                     f"{overview['source_block']}, grouped to keep the page small)")
    if top_k["k"] < top_k["source_k"]:
        notes.append(f"zoomed-in weights and window lines show the top {top_k['k']} keys of each query "
                     f"(the record holds {top_k['source_k']}; fewer are shipped to keep the page small)")
    return notes


@cache
def long_view_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the long view's payload (``present/longview.schema.json``)."""
    text = resources.files("attnscope.present").joinpath("longview.schema.json").read_text(encoding="utf-8")
    return dict(json.loads(text))
