"""Interventions on attention: head ablation, attention corruption and sublayer skipping.

Everything here either is an :class:`~attnscope.capture.attention.Intervention` (it acts inside
the one registered attention function, on the probabilities or on the per-head outputs) or a
context manager that activates forward hooks (:func:`~attnscope.capture.hooks.local_hooks`).
All act in the current thread / async task only, are removed on exit, and compose:

>>> with ablate_heads({3: [4, 7]}, mode="uniform"), skip_sublayers(model, ffn=[5]):   # doctest: +SKIP
...     model.model(**inputs)

Layers and heads are 0-indexed. Attention kinds are ``self`` (encoder-only and decoder-only
models), ``encoder``, ``decoder`` and ``cross`` (encoder-decoders).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
from torch import nn

from ..capture.attention import Intervention, capture, intervene
from ..capture.hooks import local_hooks
from ..capture.recorders import HeadOutputs
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite, find_modules
from ..models.loading import LoadedModel

# A pattern maps (probs [batch, head, q_pos, k_pos], allowed bool [batch or 1, 1, q_pos, k_pos])
# to new probabilities of the same shape whose rows sum to 1 over the allowed keys.
Pattern = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _normalise_over(weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Keep ``weights`` on allowed keys only and make each row sum to 1."""
    kept = weights * allowed
    return kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)


def uniform_pattern(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """1/n over the n keys each query may see (Kovaleva et al. 2019's "disabled" head)."""
    return _normalise_over(torch.ones_like(probs), allowed)


def beginning_pattern(k: int = 1) -> Pattern:
    """Uniform over the first ``k`` keys each query may see."""
    if k < 1:
        raise AttnscopeError(f"the 'beginning' pattern needs k >= 1, got {k}")

    def pattern(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        rank = allowed.long().cumsum(-1)  # 1 for the first allowed key, 2 for the second, ...
        return _normalise_over(((rank <= k) & allowed).to(probs.dtype).expand_as(probs), allowed)

    return pattern


def end_pattern(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """All weight on the last key each query may see (the final token; for causal attention, itself)."""
    positions = torch.arange(allowed.shape[-1], device=allowed.device)
    last = torch.where(allowed, positions, -1).amax(-1, keepdim=True)  # [batch or 1, 1, q_pos, 1]
    return (positions == last).to(probs.dtype).expand_as(probs).contiguous()


def previous_token_pattern(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """All weight on the key just before the query (the first token attends to itself)."""
    q_len, k_len = probs.shape[-2:]
    offset = k_len - q_len  # queries are the last q_len positions when keys include a cache
    queries = torch.arange(q_len, device=probs.device)[:, None] + offset
    keys = torch.arange(k_len, device=probs.device)[None, :]
    target = (keys == (queries - 1).clamp_min(0)).to(probs.dtype)  # [q_pos, k_pos]
    return _normalise_over(target.expand_as(probs), allowed)


PATTERN_FACTORIES: dict[str, Callable[[int], Pattern]] = {"beginning": beginning_pattern}
PATTERN_FUNCTIONS: dict[str, Pattern] = {"uniform": uniform_pattern, "end": end_pattern,
                                         "previous": previous_token_pattern}
OUTPUT_MODES = ("zero", "mean")


def register_pattern(name: str, pattern: Pattern) -> None:
    """Make ``pattern`` usable by name as a corruption pattern and an ablation mode."""
    if name in OUTPUT_MODES or name in PATTERN_FACTORIES:
        raise AttnscopeError(f"{name!r} is a built-in mode and cannot be replaced")
    PATTERN_FUNCTIONS[name] = pattern


def pattern_names() -> list[str]:
    """Names accepted by :func:`corrupt_attention` (``beginning`` takes ``k``)."""
    return sorted([*PATTERN_FUNCTIONS, *PATTERN_FACTORIES])


def ablation_modes() -> list[str]:
    """Names accepted by :func:`ablate_heads`: ``zero``, ``mean`` and every attention pattern."""
    return [*OUTPUT_MODES, *pattern_names()]


def resolve_pattern(pattern: str | Pattern, k: int = 1) -> Pattern:
    """A pattern function from a name (``beginning`` uses ``k``) or a user function."""
    if callable(pattern):
        return pattern
    if pattern in PATTERN_FACTORIES:
        return PATTERN_FACTORIES[pattern](k)
    if pattern in PATTERN_FUNCTIONS:
        return PATTERN_FUNCTIONS[pattern]
    raise AttnscopeError(f"unknown attention pattern {pattern!r}; choose one of {', '.join(pattern_names())} "
                         "or pass a function (probs, allowed) -> probs")


HeadSpec = Sequence[int] | torch.Tensor | None


def head_mask(heads: HeadSpec, n_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool ``[head]`` or ``[batch, head]`` mask, True = act on that head (None: every head).

    A bool tensor is taken as is (``[batch, head]`` lets each batch row ablate different heads,
    which is how the variants of one layer run in one batch). The mask is made on ``device``."""
    if heads is None:
        return torch.ones(n_heads, dtype=torch.bool, device=device)
    if isinstance(heads, torch.Tensor) and heads.dtype == torch.bool:
        if heads.shape[-1] != n_heads:
            raise AttnscopeError(f"head mask has {heads.shape[-1]} heads, the attention module has {n_heads}")
        return heads.to(device)
    chosen = [int(h) for h in heads]
    if any(not 0 <= h < n_heads for h in chosen):
        raise AttnscopeError(f"heads must be between 0 and {n_heads - 1} (0-indexed), got {chosen}")
    mask = torch.zeros(n_heads, dtype=torch.bool, device=device)
    mask[chosen] = True
    return mask


class HeadAblation(Intervention):
    """Ablate some heads at the chosen sites.

    ``mode``: ``zero`` (the head's output is 0), ``mean`` (the head's mean output over a reference
    set, ``means[(kind, layer)]`` ``[head, d_head]``, see :func:`head_output_means`), or an
    attention pattern name / function (``uniform``, ``previous``, ``beginning``, ``end``, ...)
    that replaces the head's attention probabilities.
    ``kinds``/``layers``: the sites (None: all); ``heads``: see :func:`head_mask`.
    """

    def __init__(self, mode: str | Pattern = "zero", *, layers: Iterable[int] | None = None,
                 heads: HeadSpec = None, kinds: Iterable[str] | None = None,
                 means: Mapping[tuple[str, int], torch.Tensor] | None = None, k: int = 1) -> None:
        self.mode = mode
        self.layers = None if layers is None else frozenset(int(layer) for layer in layers)
        self.kinds = None if kinds is None else frozenset(kinds)
        self.heads = heads
        self.means = means
        self.pattern: Pattern | None = None
        if mode == "mean" and means is None:
            raise AttnscopeError("mean ablation needs reference means (see head_output_means)")
        if mode not in OUTPUT_MODES:
            self.pattern = resolve_pattern(mode, k)

    def applies_to(self, site: AttentionSite) -> bool:
        return (self.layers is None or site.layer in self.layers) and (self.kinds is None or site.kind in self.kinds)

    def _mask(self, n_heads: int, device: torch.device) -> torch.Tensor:
        """``[batch or 1, head]`` bool."""
        mask = head_mask(self.heads, n_heads, device)
        return mask if mask.dim() == 2 else mask[None]

    def modify_probs(self, site: AttentionSite, probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        if self.pattern is None:
            return probs
        mask = self._mask(probs.shape[1], probs.device)[:, :, None, None]  # [batch or 1, head, 1, 1]
        return torch.where(mask, self.pattern(probs, allowed), probs)

    def modify_output(self, site: AttentionSite, output: torch.Tensor) -> torch.Tensor:
        if self.pattern is not None:
            return output
        mask = self._mask(output.shape[2], output.device)[:, None, :, None]  # [batch or 1, 1, head, 1]
        if self.mode == "zero":
            return output.masked_fill(mask, 0.0)
        assert self.means is not None
        key = (site.kind, site.layer)
        if key not in self.means:
            raise AttnscopeError(f"no reference mean for {site.kind} layer {site.layer}")
        mean = self.means[key].to(output.device, output.dtype)[None, None]  # [1, 1, head, d_head]
        return torch.where(mask, mean, output)


class HeadGates(Intervention):
    """Multiply each head's output by a gate (Michel et al. 2019's xi_h): ``gates[kind]`` ``[layer, head]``.

    Gates of 1 leave the model as it is, 0 removes the head; with ``requires_grad`` the gradient of
    a loss with respect to the gates measures each head's importance.
    """

    def __init__(self, gates: Mapping[str, torch.Tensor]) -> None:
        self.gates = gates

    def applies_to(self, site: AttentionSite) -> bool:
        return site.kind in self.gates

    def modify_output(self, site: AttentionSite, output: torch.Tensor) -> torch.Tensor:
        gate = self.gates[site.kind][site.layer].to(output.device, output.dtype)  # [head]
        return output * gate[None, None, :, None]


class ValueZeroing(Intervention):
    """Zero one key position's value vector, in every head, at one site (Mohebbi et al. 2023).

    ``positions`` ``[batch]``: batch row b zeroes the value of key ``positions[b]`` (-1: none), so a
    batch of T copies of one input zeroes every position at once. Zeroing v_j is removing column j
    of the probabilities (``output_i = sum_k p_ik v_k``); the rest of each row is left as it is.
    """

    def __init__(self, layer: int, positions: torch.Tensor, kind: str = "self") -> None:
        self.layer, self.kind = layer, kind
        self.positions = positions.long()

    def applies_to(self, site: AttentionSite) -> bool:
        return site.kind == self.kind and site.layer == self.layer

    def modify_probs(self, site: AttentionSite, probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        if len(self.positions) != probs.shape[0]:
            raise AttnscopeError(f"value zeroing has {len(self.positions)} positions for a batch of {probs.shape[0]}")
        keys = torch.arange(probs.shape[-1], device=probs.device)
        zeroed = keys[None, :] == self.positions.to(probs.device)[:, None]  # [batch, k_pos]
        return probs.masked_fill(zeroed[:, None, None, :], 0.0)


def sink_window_keys(q_len: int, k_len: int, sink: int, window: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """Bool ``[q_pos, k_pos]``: the first ``sink`` keys and the ``window`` most recent ones (the query's own
    included) of each query; the queries are the last ``q_len`` of ``k_len`` positions (a cache's slots)."""
    queries = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # [q_pos, 1]: each query's position
    keys = torch.arange(k_len, device=device)[None, :]  # [1, k_pos]
    return (keys < sink) | ((keys <= queries) & (keys > queries - window))


class SinkWindow(Intervention):
    """Restrict some heads to the first ``sink`` keys plus the ``window`` most recent (StreamingLLM's attention
    sinks and recent window; DuoAttention's streaming heads): ``heads`` ``{layer: [query head, ...]}`` (0-indexed)
    of attention ``kind``.

    The restriction is a mask before the softmax (:meth:`Intervention.key_mask`): a restricted head's weights are
    the softmax over the kept keys, exactly as if the rest were never cached. It adds to the model's own mask, so a
    sliding-window layer keeps its window (a key outside it stays out), and a learned sink (gpt-oss) stays in the
    denominator: it is not a key, and not one of the ``sink`` first keys. Heads of one key/value group are
    restricted per query head. Positions are the call's key slots, so the reference it gives for a KV budget is
    a full cache (or one forward pass) of an unpadded or right-padded batch.
    """

    def __init__(self, heads: Mapping[int, Sequence[int]], sink: int, window: int, kind: str = "self") -> None:
        if sink < 0 or window < 1:
            raise AttnscopeError(f"a sink + window restriction needs sink >= 0 and window >= 1 keys, got sink {sink} "
                                 f"and window {window}")
        self.heads = {int(layer): tuple(int(h) for h in chosen) for layer, chosen in heads.items() if len(chosen)}
        self.sink, self.window, self.kind = sink, window, kind

    def applies_to(self, site: AttentionSite) -> bool:
        return site.kind == self.kind and site.layer in self.heads

    def key_mask(self, site: AttentionSite, n_heads: int, q_len: int, k_len: int,
                 device: torch.device) -> torch.Tensor | None:
        chosen = head_mask(self.heads[site.layer], n_heads, device)[:, None, None]  # [head, 1, 1]
        kept = sink_window_keys(q_len, k_len, self.sink, self.window, device)  # [q_pos, k_pos]
        return (kept | ~chosen)[None]  # [1, head, q_pos, k_pos]: other heads keep every key


def ablate_heads(heads: Mapping[int, Sequence[int] | None], mode: str | Pattern = "zero", *, kind: str = "self",
                 means: Mapping[tuple[str, int], torch.Tensor] | None = None, k: int = 1
                 ) -> AbstractContextManager[None]:
    """Ablate ``heads`` (``{layer: [head, ...]}``, None = all heads of that layer) of attention ``kind``."""
    return intervene(*[HeadAblation(mode, layers=[layer], heads=chosen, kinds=[kind], means=means, k=k)
                       for layer, chosen in heads.items()])


def corrupt_attention(pattern: str | Pattern = "uniform", *, layers: Iterable[int] | None = None,
                      heads: Sequence[int] | None = None, kinds: Iterable[str] | None = None, k: int = 1
                      ) -> AbstractContextManager[None]:
    """Replace attention with ``pattern`` (``uniform``, ``beginning`` (first ``k`` keys), ``end``,
    ``previous`` or a function ``(probs, allowed) -> probs``) at the chosen layers/heads/kinds (None: all)."""
    return intervene(HeadAblation(pattern, layers=layers, heads=heads, kinds=kinds, k=k))


def _zero_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook: the module contributes nothing (a tuple output keeps its other members)."""
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


def sublayer_modules(loaded: LoadedModel, *, attention: Iterable[int] = (), ffn: Iterable[int] = (),
                     cross: Iterable[int] = (), kind: str | None = None) -> list[nn.Module]:
    """The modules whose output is each chosen sublayer's contribution to the residual stream.

    ``attention``/``ffn``: layers of ``kind`` (default: ``self``, or ``encoder`` for
    encoder-decoders); ``cross``: decoder layers whose cross-attention is skipped.
    """
    kind = kind or main_kind(loaded)
    out_proj = {(site.kind, site.layer): site.out_proj for site in loaded.sites.values()}
    ffn_modules = find_modules(loaded.model, loaded.adapter.ffn)
    wanted = ([(out_proj, (kind, layer), "attention") for layer in attention]
              + [(ffn_modules, (kind, layer), "feed-forward") for layer in ffn]
              + [(out_proj, ("cross", layer), "cross-attention") for layer in cross])
    modules = []
    for table, key, what in wanted:
        module = table.get(key)
        if module is None:
            raise AttnscopeError(f"no {what} sublayer for {key[0]} layer {key[1]} (0-indexed) in {loaded.name}")
        modules.append(module)
    return modules


@contextmanager
def skip_sublayers(loaded: LoadedModel, *, attention: Iterable[int] = (), ffn: Iterable[int] = (),
                   cross: Iterable[int] = (), kind: str | None = None) -> Iterator[None]:
    """Remove the chosen sublayers' contributions (their output becomes 0; the residual passes on).

    For post-LayerNorm models (BERT) the LayerNorm after the sublayer still applies to the residual.
    Like :func:`ablate_heads`, it acts in the current thread / async task only (other threads
    running the same model at the same time are not changed) and is removed on exit, even after
    an error.
    """
    with local_hooks(sublayer_modules(loaded, attention=attention, ffn=ffn, cross=cross, kind=kind), _zero_output):
        yield


def main_kind(loaded: LoadedModel) -> str:
    """``encoder`` for encoder-decoders, else ``self``."""
    return "encoder" if loaded.is_encoder_decoder else "self"


def n_heads_per_kind(loaded: LoadedModel) -> dict[str, tuple[int, int]]:
    """``kind -> (n_layers, n_heads)`` from the model's attention modules."""
    shapes: dict[str, tuple[int, int]] = {}
    for module, site in loaded.sites.items():
        layers, _ = shapes.get(site.kind, (0, 0))
        shapes[site.kind] = (max(layers, site.layer + 1), attention_head_count(loaded, module))
    return shapes


def attention_shape(loaded: LoadedModel, kind: str | None = None) -> tuple[str, int, int]:
    """``(kind, n_layers, n_heads)`` of attention ``kind`` (None: the input side's); one line for a
    kind the model does not have."""
    shapes = n_heads_per_kind(loaded)
    kind = kind or main_kind(loaded)
    if kind not in shapes:
        raise AttnscopeError(f"model {loaded.name!r} has no {kind!r} attention; it has {', '.join(shapes)}")
    return (kind, *shapes[kind])


def check_layers_and_heads(loaded: LoadedModel, layers: Iterable[int] | None = None, heads: Iterable[int] | None = None,
                           *, kind: str | None = None, options: tuple[str, str] = ("--layers", "--heads")) -> None:
    """Refuse 0-indexed ``layers`` or ``heads`` (None: all) that attention ``kind`` of ``loaded`` does not
    have, naming the options they came from; call it before any slow work."""
    from ..arguments import check_indices

    _, n_layers, n_heads = attention_shape(loaded, kind)
    check_indices(layers, n_layers, "layer", options[0])
    check_indices(heads, n_heads, "head", options[1])


def attention_head_count(loaded: LoadedModel, module: nn.Module) -> int:
    """Query heads of one attention module (from its attributes, else the config)."""
    for attribute in ("num_attention_heads", "num_heads", "n_heads", "n_head"):
        value = getattr(module, attribute, None)
        if isinstance(value, int):
            return value
    out_proj = loaded.sites[module].out_proj
    head_dim = getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)
    if out_proj is not None and isinstance(head_dim, int):
        weight = cast(torch.Tensor, out_proj.weight)
        return int(weight.shape[0 if loaded.sites[module].conv1d else 1]) // head_dim
    config = loaded.config
    for attribute in ("num_attention_heads", "n_head", "encoder_attention_heads", "num_heads"):
        value = getattr(config, attribute, None)
        if isinstance(value, int):
            return value
    raise AttnscopeError(f"cannot tell how many heads {loaded.sites[module].name} has")


def head_output_means(loaded: LoadedModel, batches: Iterable[Mapping[str, torch.Tensor]],
                      kinds: Iterable[str] | None = None) -> dict[tuple[str, int], torch.Tensor]:
    """Each head's mean output over the real (non-padding) query positions of ``batches``.

    ``batches``: model inputs (with ``attention_mask``; encoder-decoders also
    ``decoder_attention_mask`` or all decoder positions count). Returns ``(kind, layer)`` ->
    ``[head, d_head]``, the reference for ``mode="mean"`` ablation.
    """
    wanted = frozenset(kinds) if kinds is not None else frozenset(s.kind for s in loaded.sites.values())
    sums: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[tuple[str, int], torch.Tensor] = {}
    with torch.inference_mode():
        for inputs in batches:
            recorder = HeadOutputs(wanted)
            with capture(loaded.sites, recorder=recorder):
                loaded.model(**inputs)
            for key, output in recorder.outputs.items():
                real = _query_mask(inputs, key[0], output.shape[:2], output.device).to(output.dtype)  # [batch, q_pos]
                sums[key] = sums.get(key, 0) + torch.einsum("bq,bqhd->hd", real, output.float())
                counts[key] = counts.get(key, 0) + real.sum()
    if not sums:
        raise AttnscopeError("no reference data for mean ablation")
    return {key: sums[key] / counts[key].clamp_min(1) for key in sums}


def _query_mask(inputs: Mapping[str, torch.Tensor], kind: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Bool ``[batch, q_pos]`` on ``device``: real query positions of sites of ``kind``."""
    name = "decoder_attention_mask" if kind in ("decoder", "cross") else "attention_mask"
    mask = inputs.get(name)
    if mask is None or mask.shape != shape:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return mask.bool().to(device)
