"""The proximity of every (key, head) part of an attention block's output, exactly, without forming every part.

A route's row ``i`` at one layer has a part ``z_jh = α^h_ij G(u_jh)`` per source key j and head h, where
``u_jh = v_j W_O^h`` (``d_model`` wide) and ``G`` is the identity or the row's frozen post-attention norm (linear).
Forming every part costs ``head x key x d_head x d_model`` per layer, which made a generation's routes cost about
15 GFLOP per step at 1,536 positions of SmolLM2. The proximity needs less:

On coordinate d, ``|y_d| − |y_d − z_d| = sign(y_d) z_d`` unless the part overshoots ``y`` there (``z_d`` has the
sign of ``y_d`` and ``|z_d| > |y_d|``, or ``y_d = 0``), which needs ``|z_d| > |y_d|``; with ``peak_jh = max_d |u_jhd|``,
no coordinate with ``|y_d| >= bound_jh = α peak_jh max|G|`` can be overshot. So with the coordinates sorted by
``|y_d|`` and a prefix P of the ``K`` smallest, a part whose bound is at most the ``(K+1)``-th smallest ``|y_d|``
("light") has proximity ``Σ_{d∉P} sign(y_d) z_d + Σ_{d∈P} (|y_d| − |y_d − z_d|)``: the first sum is
``α (G^T s) · u_jh`` with ``s`` the signs of ``y`` outside P, one ``d_head``-wide dot product per key since ``u`` is
linear in ``v``; the second is formed on the ``K`` coordinates only. The few other parts ("heavy": the keys a head
attends to strongly) are formed in full. ``K`` is chosen per block of rows to minimise the work. Nothing is
approximated: every proximity is the same number as forming the part, up to float rounding.

Layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture.recorders import per_head_out_proj
from ..models.adapters import AttentionSite
from .terms import FrozenNorm

PEAK_KEYS = 1024  # keys whose parts are formed at once when their peaks are found ([head, key, d_model])
HEAVY_COST = 4  # a heavy part's work per coordinate over a light part's (every head's output at its key is formed)
PEAK_MARGIN = 1.0 + 1e-5  # bounds raised by float32 rounding's worst case: a part is never called light wrongly


@dataclass(frozen=True)
class OutWeights:
    """One layer's ``W_O`` by head: ``per_head`` ``[head, d_head, d_model]`` (a view of the weight), ``joined``
    ``[kv_head, d_head, group x d_model]`` (:func:`join_heads`: a copy, made once per layer) and ``group``."""

    per_head: torch.Tensor
    joined: torch.Tensor
    group: int

    @classmethod
    def of(cls, per_head: torch.Tensor, n_kv_heads: int) -> OutWeights:
        return cls(per_head, join_heads(per_head, n_kv_heads), per_head.shape[0] // n_kv_heads)

    @classmethod
    def of_site(cls, site: AttentionSite, n_heads: int, n_kv_heads: int) -> OutWeights:
        """The output projection of ``site`` (refused in one line without one: routes need it)."""
        return cls.of(per_head_out_proj(site, n_heads, unavailable="routes"), n_kv_heads)


def join_heads(weight: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Each kv head's group of ``weight`` ``[head, d_head, m]`` side by side: ``[kv_head, d_head, group x m]``."""
    n_heads, d_head, m = weight.shape
    group = n_heads // n_kv_heads
    return weight.reshape(n_kv_heads, group, d_head, m).transpose(1, 2).reshape(n_kv_heads, d_head, group * m)


def grouped_outputs(values: torch.Tensor, joined: torch.Tensor, group: int) -> torch.Tensor:
    """``values`` ``[kv_head, key, d_head]`` times each head's weight, ``joined`` by :func:`join_heads` (head h
    reads kv head h // group): ``[head, key, m]``. One product per kv head: a broadcast product would copy every
    value once per head of its group."""
    n_kv, n_keys, _ = values.shape
    grouped = torch.bmm(values, joined).view(n_kv, n_keys, group, joined.shape[-1] // group)
    return grouped.movedim(2, 1).reshape(n_kv * group, n_keys, -1)


def _grouped(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_outputs` for a small ``weight`` ``[head, d_head, m]`` joined on the spot. Not
    ``capture.attention.grouped_matmul``: that one groups its left operand by head, which here would be the values
    transposed, copied at every call (about a millisecond per route row at 1,500 keys)."""
    return grouped_outputs(values, join_heads(weight, values.shape[0]), weight.shape[0] // values.shape[0])


def value_peaks(values: torch.Tensor, weights: OutWeights) -> torch.Tensor:
    """``max_d |v_j W_O^h|_d``, ``[head, key]``, from ``values`` ``[kv_head, key, d_head]``, ``PEAK_KEYS`` keys at a
    time."""
    pieces = [grouped_outputs(values[:, start : start + PEAK_KEYS].float(), weights.joined, weights.group)
              .abs_().amax(-1) for start in range(0, values.shape[1], PEAK_KEYS)]
    return torch.cat(pieces, dim=1) if pieces else torch.empty((weights.per_head.shape[0], 0), device=values.device)


def proximity(parts: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``max(0, ||y||_1 − ||y − z||_1)`` of parts ``z`` ``[..., d]`` of ``y`` ``[..., d]`` (broadcast): ``[...]``.

    Summed per coordinate as ``|y| − |y − z| = z (2y − z) / (|y| + |y − z|)``: the difference of two large sums
    (a residual stream with massive activations has an L1 norm in the thousands) would lose the small parts to
    float32 rounding; this form keeps each term's rounding relative to the term itself."""
    denominator = (whole - parts).abs_().add_(whole.abs()).clamp_min_(torch.finfo(parts.dtype).tiny)
    return (2 * whole - parts).mul_(parts).div_(denominator).sum(-1).clamp_min_(0.0)


def part_proximities(probs: torch.Tensor, values: torch.Tensor, weights: OutWeights, peaks: torch.Tensor,
                     whole: torch.Tensor, frozen: list[FrozenNorm], budget: int) -> torch.Tensor:
    """``max(0, ||y||_1 − ||y − z_jh||_1)`` of every part ``z_jh = probs[h, r, j] G_r(v_j W_O^h)``, ``[row, key,
    head]`` float32, for rows with weights ``probs`` ``[head, row, key]`` and sums ``whole`` ``[row, d_model]``;
    ``values`` ``[kv_head, key, d_head]``, ``peaks`` ``[head, key]`` (:func:`value_peaks`), ``frozen``: each row's
    frozen norm ``G_r`` or none; ``budget``: elements of the largest block formed at once."""
    gains, centred = _gains(frozen, whole)
    bound = probs * peaks[:, None, :] * (gains.abs().amax(-1) * (2.0 if centred else 1.0) * PEAK_MARGIN)[None, :, None]
    magnitude = whole.abs()
    order = magnitude.argsort(-1)  # [row, d_model]: coordinates by |y|, smallest first
    floors = torch.cat([magnitude.gather(-1, order), torch.full_like(magnitude[:, :1], float("inf"))], -1)
    prefix = _prefix_length(bound, floors)
    heavy = bound > floors[None, :, prefix, None]  # [head, row, key]: may overshoot beyond the prefix
    weight = weights.per_head
    signs = whole.sign().scatter_(-1, order[:, :prefix], 0.0)  # [row, d_model]: sign(y) outside the prefix
    near = _linear(probs, values, weight, signs, gains, centred)
    if prefix:
        near += _prefix(probs, values, weight, whole, gains, centred, order[:, :prefix], budget)
    result = near.clamp_min_(0.0)
    if bool(heavy.any()):
        result[heavy] = _formed(probs, values, weights, whole, gains, centred, heavy, budget)
    return result.permute(1, 2, 0)


def _gains(frozen: list[FrozenNorm], whole: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Each row's gain ``[row, d_model]`` (float32; ones without a norm) and whether the norm centres its input."""
    if not frozen:
        return torch.ones_like(whole), False
    return torch.stack([f.gain.float() for f in frozen]), frozen[0].centred


def _prefix_length(bound: torch.Tensor, floors: torch.Tensor) -> int:
    """The prefix length ``K`` (0, a power of two, or every coordinate) that minimises the work: ``K`` coordinates
    per part, plus ``HEAVY_COST`` per heavy part (``bound`` above ``floors[row, K]``, the ``K``-th smallest
    ``|y_d|``; ``floors`` ``[row, d_model + 1]`` ends in infinity)."""
    d_model = floors.shape[-1] - 1
    lengths = torch.tensor([0] + [1 << p for p in range(d_model.bit_length()) if 1 << p < d_model] + [d_model],
                           device=floors.device)
    n_rows = bound.shape[1]
    # per row, how many of its candidate floors each part's bound exceeds: the part is heavy below that many
    exceeded = torch.searchsorted(floors[:, lengths].contiguous(), bound.transpose(0, 1).reshape(n_rows, -1))
    light = torch.bincount(exceeded.flatten(), minlength=len(lengths) + 1).cumsum(0)[:-1]  # [length]
    cost = bound.numel() * lengths + (bound.numel() - light) * d_model * HEAVY_COST
    return int(lengths[int(cost.argmin())])


def _directions(signs: torch.Tensor, gains: torch.Tensor, centred: bool) -> torch.Tensor:
    """``G^T s`` per row ``[row, d_model]`` for ``signs`` ``s`` ``[row, d_model]``: ``w · u = s · G(u)`` for every
    ``u``."""
    direction = signs * gains
    return direction - direction.mean(-1, keepdim=True) if centred else direction


def _linear(probs: torch.Tensor, values: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor,
            gains: torch.Tensor, centred: bool) -> torch.Tensor:
    """``s · z_jh`` of every part ``[head, row, key]`` for each row's ``signs`` ``s`` ``[row, d_model]``, as
    ``α v_j · (W_O^h w)``: a sum of terms each the size of one coordinate of the part, not the difference of two
    norms of ``y``, so float32 keeps it to rounding."""
    pulled = torch.matmul(weight, _directions(signs, gains, centred).T)  # [head, d_head, row]
    return probs * _grouped(values, pulled).transpose(1, 2)


def _prefix(probs: torch.Tensor, values: torch.Tensor, weight: torch.Tensor, whole: torch.Tensor,
            gains: torch.Tensor, centred: bool, columns: torch.Tensor, budget: int) -> torch.Tensor:
    """``Σ_d (|y_d| − |y_d − z_d|)`` of every part over each row's prefix ``columns`` ``[row, K]``: ``[head, row,
    key]``, in blocks of rows of at most ``budget`` elements. Heads stay grouped by kv head (``[kv_head, key, group,
    row, K]``, as the grouped product leaves them): reordering them would copy every block once more."""
    n_heads, n_rows, n_keys = probs.shape
    n_kv, prefix = values.shape[0], columns.shape[1]
    group = n_heads // n_kv
    shift = None  # [kv_head, key, group]: mean(u) over every coordinate, which a centring norm subtracts
    if centred:
        shift = _grouped(values, weight.mean(-1, keepdim=True)).view(n_kv, group, n_keys).transpose(1, 2)
    by_key = probs.view(n_kv, group, n_rows, n_keys).permute(0, 3, 1, 2)  # [kv_head, key, group, row]: a view
    total = torch.empty((n_kv, n_keys, group, n_rows), device=probs.device)
    step = max(1, budget // max(1, n_heads * n_keys * prefix))
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        cols = columns[rows]  # [row, K]
        scale = gains[rows].gather(-1, cols)  # [row, K]: the norm's gain on each prefix coordinate
        picked = join_heads(weight[:, :, cols.flatten()] * scale.flatten(), n_kv)  # [kv_head, d_head, group x row x K]
        parts = torch.bmm(values, picked).view(n_kv, n_keys, group, cols.shape[0], prefix)  # G(u) on the prefix
        if shift is not None:
            parts -= shift[..., None, None] * scale
        wanted = whole[rows].gather(-1, cols)  # [row, K]: y on the prefix
        parts.mul_(by_key[..., rows, None]).sub_(wanted)  # z − y
        total[..., rows] = wanted.abs().sum(-1) - parts.abs_().sum(-1)
    return total.permute(0, 2, 3, 1).reshape(n_heads, n_rows, n_keys)


def _formed(probs: torch.Tensor, values: torch.Tensor, weights: OutWeights, whole: torch.Tensor,
            gains: torch.Tensor, centred: bool, heavy: torch.Tensor, budget: int) -> torch.Tensor:
    """The proximity of each heavy part, formed in full (``d_model`` wide), in ``heavy.nonzero()`` order
    ``[n_heavy]``: every head's output at the keys involved, ``budget // (head x d_model)`` keys at once."""
    found = heavy.nonzero()  # [n, 3]: head, row, key, head-major
    keys, which = torch.unique(found[:, 2], return_inverse=True)
    out = torch.empty(found.shape[0], device=probs.device)
    step = max(1, budget // (heavy.shape[0] * weights.per_head.shape[-1]))
    for start in range(0, keys.shape[0], step):
        outputs = grouped_outputs(values[:, keys[start : start + step]], weights.joined, weights.group)
        if centred:
            outputs = outputs - outputs.mean(-1, keepdim=True)
        picked = ((which >= start) & (which < start + step)).nonzero()[:, 0]
        h, r, j = found[picked].unbind(-1)
        z = probs[h, r, j][:, None] * gains[r] * outputs[h, which[picked] - start]
        out[picked] = proximity(z, whole[r])
    return out
