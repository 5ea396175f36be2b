"""The proximity of every (key, head) part of an attention block's output, exactly, without forming every part.

A route's row ``i`` at one layer has a part ``z_jh = α^h_ij G(u_jh)`` per source key j and head h, where
``u_jh = v_j W_O^h`` (``d_model`` wide) and ``G`` is the identity or the row's frozen post-attention norm (linear).
Forming every part costs ``head x key x d_head x d_model`` per layer, which made a generation's routes cost about
15 GFLOP per step at 1,536 positions of SmolLM2. The proximity needs less:

On coordinate d, ``|y_d| − |y_d − z_d| = sign(y_d) z_d`` unless the part overshoots ``y`` there (``z_d`` has the
sign of ``y_d`` and ``|z_d| > |y_d|``, or ``y_d = 0``), which needs ``|z_d| > |y_d|``; with ``peak_jh = max_d |u_jhd|``,
no coordinate with ``|y_d| >= bound_jh = α peak_jh max|G|`` can be overshot. So every part's proximity starts from
``Σ_d sign(y_d) z_d = α (G^T s) · u_jh`` (``s`` the signs of ``y``), one ``d_head``-wide dot product per key since
``u`` is linear in ``v``. With the coordinates sorted by ``|y_d|`` and a prefix P of the ``K`` smallest, a part whose
bound is at most the ``(K+1)``-th smallest ``|y_d|`` ("light") can overshoot only inside P, where its loss
``Σ_{d∈P} (|y_d| − |y_d − z_d| − sign(y_d) z_d)`` is formed on the ``K`` coordinates, and only at keys where some
part's bound exceeds the smallest ``|y_d|`` (most keys of a long text have none). The few other parts ("heavy": the
keys a head attends to strongly) are formed in full. ``K`` is chosen per layer (for its block of rows) to minimise the
work; rows of several layers go through one batch (:func:`layers_part_proximities`). Nothing is approximated: every
proximity is the same number as forming the part, up to float rounding.

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
    frozen norm ``G_r`` or none; ``budget``: elements of the largest block formed at once. One layer's
    :func:`layers_part_proximities`."""
    gains, centred = frozen_gains(frozen, whole)
    return layers_part_proximities(probs[None], values[None], weights.joined[None], peaks[None], whole[None],
                                   gains[None], centred, budget)[0]


def layers_part_proximities(probs: torch.Tensor, values: torch.Tensor, joined: torch.Tensor, peaks: torch.Tensor,
                            whole: torch.Tensor, gains: torch.Tensor, centred: bool, budget: int) -> torch.Tensor:
    """:func:`part_proximities` of rows of several layers at once, ``[layer, row, key, head]``: ``probs`` ``[layer,
    head, row, key]``, ``values`` ``[layer, kv_head, key, d_head]``, ``joined`` ``[layer, kv_head, d_head, group x
    d_model]`` (:func:`join_heads` of each layer's ``W_O``), ``peaks`` ``[layer, head, key]``, ``whole`` and the
    frozen norms' ``gains`` ``[layer, row, d_model]`` (ones without a norm); ``centred``: the norms centre their
    input. Inside, a head is (kv head, head of its group) and parts are laid out ``[layer, kv_head, key, group,
    row]``, as the grouped products leave them."""
    n_layers, n_heads, n_rows, n_keys = probs.shape
    n_kv = values.shape[1]
    by_key = probs.view(n_layers, n_kv, n_heads // n_kv, n_rows, n_keys).permute(0, 1, 4, 2, 3)  # a view
    scale = gains.abs().amax(-1) * (2.0 if centred else 1.0) * PEAK_MARGIN  # [layer, row]
    bound = by_key * peaks.view(n_layers, n_kv, -1, n_keys).transpose(2, 3)[..., None] * scale[:, None, None, None]
    magnitude = whole.abs()
    order = magnitude.argsort(-1)  # [layer, row, d_model]: coordinates by |y|, smallest first
    floors = torch.cat([magnitude.gather(-1, order), torch.full_like(magnitude[..., :1], float("inf"))], -1)
    # the keys where some part may overshoot y somewhere (its bound above the smallest |y_d| of its row): elsewhere
    # every part's proximity is its linear term alone
    reaching = (bound > floors[..., :1].view(n_layers, 1, 1, 1, n_rows)).any(-1).any(-1).any(1)  # [layer, key]
    prefixes = _prefix_lengths(bound, floors, reaching.sum(1) * (n_heads * n_rows))  # per layer
    chosen = torch.tensor(prefixes, device=floors.device)
    heavy = bound > floors.gather(-1, chosen.view(-1, 1, 1).expand(-1, n_rows, 1)).view(n_layers, 1, 1, 1, n_rows)
    near = _linear(by_key, values, joined, _directions(whole.sign(), gains, centred))  # Σ_d sign(y_d) z_d
    if max(prefixes):
        _prefix(near, by_key, values, joined, whole, gains, centred, order, prefixes, reaching, budget)
    result = near.clamp_min_(0.0)
    if bool(heavy.any()):
        _formed(result, by_key, values, joined, whole, gains, centred, heavy, budget)
    return result.permute(0, 4, 2, 1, 3).reshape(n_layers, n_rows, n_keys, n_heads)


def frozen_gains(frozen: list[FrozenNorm], whole: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Each row's gain ``[row, d_model]`` (float32; ones without a norm) and whether the norm centres its input."""
    if not frozen:
        return torch.ones_like(whole), False
    return torch.stack([f.gain.float() for f in frozen]), frozen[0].centred


def _prefix_lengths(bound: torch.Tensor, floors: torch.Tensor, prefix_parts: torch.Tensor) -> list[int]:
    """Each layer's prefix length ``K`` (0, a power of two, or every coordinate) that minimises its work: ``K``
    coordinates per part of ``prefix_parts`` ``[layer]`` (those a prefix is computed for), plus ``HEAVY_COST`` per
    heavy part (``bound`` ``[layer, kv_head, key, group, row]`` above ``floors[layer, row, K]``, the ``K``-th smallest
    ``|y_d|``; ``floors`` ``[layer, row, d_model + 1]`` ends in infinity). Per layer, so that a row's numbers do not
    depend on the layers computed beside it."""
    d_model = floors.shape[-1] - 1
    lengths = torch.tensor([0] + [1 << p for p in range(d_model.bit_length()) if 1 << p < d_model] + [d_model],
                           device=floors.device)
    n_layers, n_rows = floors.shape[:2]
    # per row, how many of its candidate floors each part's bound exceeds: the part is heavy below that many
    exceeded = torch.searchsorted(floors[..., lengths].contiguous(), bound.movedim(-1, 1).reshape(n_layers, n_rows, -1))
    offsets = torch.arange(n_layers, device=floors.device).view(-1, 1, 1) * (len(lengths) + 1)
    counts = torch.bincount((exceeded + offsets).flatten(), minlength=n_layers * (len(lengths) + 1))
    light = counts.view(n_layers, -1).cumsum(1)[:, :-1]  # [layer, length]
    parts = bound[0].numel()
    cost = prefix_parts[:, None] * lengths + (parts - light) * d_model * HEAVY_COST
    return lengths[cost.argmin(1)].tolist()


def _directions(signs: torch.Tensor, gains: torch.Tensor, centred: bool) -> torch.Tensor:
    """``G^T s`` per row ``[..., row, d_model]`` for ``signs`` ``s``: ``w · u = s · G(u)`` for every ``u``."""
    direction = signs * gains
    return direction - direction.mean(-1, keepdim=True) if centred else direction


def _linear(by_key: torch.Tensor, values: torch.Tensor, joined: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``w · z_jh`` of every part ``[layer, kv_head, key, group, row]`` for each row's ``directions`` ``w``
    ``[layer, row, d_model]``, as ``α v_j · (W_O^h w)``: a sum of terms each the size of one coordinate of the part,
    not the difference of two norms of ``y``, so float32 keeps it to rounding."""
    n_layers, n_kv, _, group, n_rows = by_key.shape
    d_head = values.shape[-1]
    # [layer, kv_head x d_head x group, d_model] @ [layer, d_model, row]: W_O^h w laid out as join_heads leaves it
    pulled = torch.bmm(joined.view(n_layers, -1, directions.shape[-1]), directions.transpose(1, 2))
    outputs = torch.matmul(values, pulled.view(n_layers, n_kv, d_head, group * n_rows))  # [layer, kv, key, group x row]
    return outputs.view(by_key.shape).mul_(by_key)


def _blocks(n_layers: int, n_rows: int, per_row: int, budget: int) -> list[tuple[slice, slice]]:
    """Blocks of (layers, rows) of at most ``budget`` elements, ``per_row`` elements per row of one layer: every row
    of several layers at once where one layer's rows fit, else one layer's rows a few at a time."""
    if n_rows * per_row <= budget:
        step = max(1, budget // max(1, n_rows * per_row))
        return [(slice(b, b + step), slice(0, n_rows)) for b in range(0, n_layers, step)]
    step = max(1, budget // max(1, per_row))
    return [(slice(b, b + 1), slice(r, r + step)) for b in range(n_layers) for r in range(0, n_rows, step)]


def _prefix(near: torch.Tensor, by_key: torch.Tensor, values: torch.Tensor, joined: torch.Tensor, whole: torch.Tensor,
            gains: torch.Tensor, centred: bool, order: torch.Tensor, lengths: list[int], reaching: torch.Tensor,
            budget: int) -> None:
    """Add to ``near`` ``[layer, kv_head, key, group, row]`` (each part's ``Σ_d sign(y_d) z_d``) what the part's
    overshoots take away on each layer's prefix, the first ``lengths[layer]`` coordinates of ``order`` ``[layer, row,
    d_model]``: ``Σ_d (|y_d| − |y_d − z_d| − sign(y_d) z_d) = −Σ_d (|e_d| + sign(y_d) e_d)`` with ``e = z − y``, 0
    where the part does not overshoot. Only at the keys ``reaching`` ``[layer, key]`` marks (at the others no part
    overshoots anywhere), for runs of consecutive layers (:func:`_runs`; slices: views, no copies) in blocks of at most
    ``budget`` elements ``[layer, kv_head, key, group, row, K]``. A coordinate past a layer's prefix, or a key it does
    not need, adds exactly 0 (its weight and ``y`` are zeroed, or no part there overshoots), so a run can pad them."""
    n_layers, n_kv, _, group, n_rows = by_key.shape
    d_head = values.shape[-1]
    by_head = joined.view(n_layers, n_kv, d_head, group, -1)  # [layer, kv_head, d_head, group, d_model]
    cols = order[..., : max(lengths)]  # [layer, row, K]
    used = torch.arange(cols.shape[-1], device=cols.device) < torch.tensor(lengths, device=cols.device).view(-1, 1, 1)
    scales = gains.gather(-1, cols) * used  # the norm's gain on the prefix, 0 past it
    wanted = whole.gather(-1, cols) * used  # y on the prefix, 0 past it
    for run, prefix, keys in _runs(lengths, reaching, n_kv * group * n_rows):
        run_values = values[run][:, :, keys]  # [layer, kv_head, key, d_head]: a copy of the keys needed
        run_weights = by_key[run][:, :, keys]  # [layer, kv_head, key, group, row]
        shift = None  # [layer, kv_head, key, group]: mean(u) over every coordinate, which a centring norm subtracts
        if centred:
            shift = torch.matmul(run_values, by_head[run].mean(-1))
        added = torch.empty(run_weights.shape, device=near.device)
        for part, rows in _blocks(run.stop - run.start, n_rows, n_kv * group * len(keys) * prefix, budget):
            inside = slice(part.start, min(run.stop - run.start, part.stop))
            layers = slice(run.start + inside.start, run.start + inside.stop)
            scale, y = scales[layers, rows, :prefix], wanted[layers, rows, :prefix][:, None, None, None]
            n_b, n_r = scale.shape[:2]
            index = cols[layers, rows, :prefix].reshape(n_b, 1, 1, 1, -1).expand(-1, n_kv, d_head, group, -1)
            picked = by_head[layers].gather(-1, index).mul_(scale.reshape(n_b, 1, 1, 1, -1))  # [.., group, row x K]
            parts = torch.matmul(run_values[inside], picked.view(n_b, n_kv, d_head, -1))  # G(u) on the prefix
            parts = parts.view(n_b, n_kv, len(keys), group, n_r, prefix)
            if shift is not None:
                parts -= shift[inside, ..., None, None] * scale[:, None, None, None]
            parts.mul_(run_weights[inside, ..., rows, None]).sub_(y)  # e = z − y
            overshoot = parts.abs().add_(parts.mul_(y.sign()))  # |e| + sign(y) e
            added[inside, ..., rows] = overshoot.sum(-1).neg_()
        near[run][:, :, keys] += added


# a run's fixed cost in elements of its work: a run makes about 20 torch calls (~0.3 ms in a profile of SmolLM2's
# routes on 2 cores) and an element (a part on one coordinate) costs ~10 ns over its passes there
RUN_COST = 1 << 15


def _runs(lengths: list[int], reaching: torch.Tensor, per_key: int) -> list[tuple[slice, int, torch.Tensor]]:
    """Runs of consecutive layers whose prefixes :func:`_prefix` computes together, ``[(layers, K, keys)]``: each
    layer with a prefix and keys ``reaching`` ``[layer, key]`` joins the run before it while the run's padded work (its
    layers x the keys any of them needs x its longest prefix x ``per_key`` parts) stays below their separate work plus
    :data:`RUN_COST`; the keys are the indices of the keys the run needs."""
    runs: list[tuple[slice, int, torch.Tensor]] = []
    work = 0  # the separate work of the last run's layers
    for layer, length in enumerate(lengths):
        needed = reaching[layer]
        alone = int(needed.sum()) * length * per_key
        if not alone:
            continue
        if runs and runs[-1][0].stop == layer:
            last, prefix, keys = runs[-1]
            joined = keys | needed
            padded = (layer + 1 - last.start) * int(joined.sum()) * max(prefix, length) * per_key
            if padded <= work + alone + RUN_COST:
                runs[-1], work = (slice(last.start, layer + 1), max(prefix, length), joined), work + alone
                continue
        runs.append((slice(layer, layer + 1), length, needed))
        work = alone
    return [(layers, prefix, keys.nonzero().flatten()) for layers, prefix, keys in runs]


def _formed(result: torch.Tensor, by_key: torch.Tensor, values: torch.Tensor, joined: torch.Tensor,
            whole: torch.Tensor, gains: torch.Tensor, centred: bool, heavy: torch.Tensor, budget: int) -> None:
    """Write into ``result`` ``[layer, kv_head, key, group, row]`` the proximity of each ``heavy`` part, formed in full
    (``d_model`` wide): every head's output at each (layer, key) where a part is heavy, ``budget // (head x
    d_model)`` such keys at once (one product per layer among them: layers have from a few to hundreds of such keys,
    so a batch padded to the most would form several times the parts), each heavy part's own output taken from its
    layer's product as it comes (not the products joined first: most of a key's heads are light)."""
    _, n_kv, n_keys, group, _ = by_key.shape
    d_model = joined.shape[-1] // group
    found = heavy.nonzero()  # [n, 5]: layer, kv_head, key, group, row
    pairs, slot = torch.unique(found[:, 0] * n_keys + found[:, 2], return_inverse=True)  # (layer, key), ascending
    order = slot.argsort(stable=True)  # the parts by (layer, key)
    found, slot = found[order], slot[order]
    step = max(1, budget // (n_kv * group * d_model))
    for first in range(0, len(pairs), step):
        block = pairs[first : first + step]
        lo, hi = torch.searchsorted(slot, torch.tensor([first, first + len(block)], device=slot.device)).tolist()
        l, k, j, g, r = found[lo:hi].unbind(-1)
        local = slot[lo:hi] - first  # each part's pair within the block
        layers, counts = torch.unique_consecutive(block // n_keys, return_counts=True)
        ends = torch.cumsum(counts, 0)
        bounds = [0, *torch.searchsorted(local, ends).tolist()]  # the parts of each layer: consecutive
        u = torch.empty((hi - lo, d_model), device=values.device)
        for layer, start, end, a, b in zip(layers.tolist(), (ends - counts).tolist(), ends.tolist(), bounds, bounds[1:],
                                           strict=False):
            keys = block[start:end] % n_keys
            outputs = torch.matmul(values[layer][:, keys], joined[layer]).view(n_kv, end - start, group, d_model)
            u[a:b] = outputs[k[a:b], local[a:b] - start, g[a:b]]
        if centred:
            u -= u.mean(-1, keepdim=True)
        z = u.mul_(gains[l, r]).mul_(by_key[l, k, j, g, r][:, None])
        result[l, k, j, g, r] = proximity(z, whole[l, r])
