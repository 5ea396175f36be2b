"""Activation patching (Meng et al. 2022; Wang et al. 2022): which heads carry what makes the clean
prompt's answer, measured by copying their output from a clean run into a corrupted one.

For a pair of prompts of the same token length (``"The Eiffel Tower is in"`` / ``"The Colosseum is
in"``), a target token (``" Paris"``) and optionally another (``" Rome"``), the metric at the last
position (``logit_diff`` = logit(target) − logit(other), ``logit``, or ``prob`` of the target) is
measured on the clean run, the corrupted run, and the corrupted run with one piece of the clean
run patched in:

* each head's per-head output (before the output projection) at every position, through an
  :class:`~attnscope.capture.attention.Intervention` (:class:`PatchHeads`);
* optionally each MLP's output at every position, and the residual stream after each layer at
  one position at a time (forward hooks, thread-local).

The share recovered is ``(patched − corrupted) / (clean − corrupted)``: 0 = as corrupted, 1 = as
clean. Over several pairs: means with percentile bootstrap 95% intervals over pairs
(``scipy.stats.bootstrap``).

Runs: one clean and one corrupted forward pass per pair; the corrupted one keeps each block's
input (as ablation sweeps do), so the patches of layer L run blocks L.. only, several patches side
by side in one batch, and the LM head runs on the last position only (``method="cached"``). Where
the adapter does not allow running from a middle layer (Gemma 3), whole forward passes run, still
batched (``"batched"``); ``"naive"`` is one full forward pass per head patch (for checking; MLP and
residual patches then run as in ``"batched"``).
Layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np
import torch
from torch import nn

from ..arguments import check_seed
from ..attribution.dla import last_logits_only, token_id
from ..attribution.terms import blocks_by_layer, unembedding
from ..capture.attention import Intervention, capture, intervene
from ..capture.extract import as_loaded
from ..capture.generate import prompt_ids
from ..capture.hooks import local_hooks
from ..capture.recorders import HeadOutputs
from ..capture.tokens import readable_tokens
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite, find_modules
from ..models.loading import LoadedModel
from .interventions import attention_shape
from .sweeps import TOKEN_BUDGET, block_inputs, final_modules, run_blocks_from

METRICS = ("logit_diff", "logit", "prob")
METHODS = ("cached", "batched", "naive")
CONFIDENCE = 0.95
BOOTSTRAP_VALUES = 20_000_000  # resampled values held at once (float64: 160 MB)


@dataclass(frozen=True)
class PromptPair:
    """A clean and a corrupted prompt of the same token length, the target token (an id or a one-token
    text such as ``" Paris"``) and optionally the token it competes with (for ``logit_diff``)."""

    clean: str
    corrupt: str
    target: int | str
    other: int | str | None = None


@dataclass(frozen=True)
class EncodedPair:
    clean: torch.Tensor  # [1, pos]
    corrupt: torch.Tensor  # [1, pos]
    target: int
    other: int | None
    tokens: tuple[str, ...]  # the clean prompt's


def prepare_pairs(loaded: LoadedModel, pairs: Sequence[PromptPair], metric: str | None = None
                  ) -> tuple[list[EncodedPair], str]:
    """Encode and check every pair before any forward pass: one line naming the pair for an empty
    prompt, prompts of different token lengths, or a target / other that is not one token. Returns the
    encoded pairs and the metric (default: ``logit_diff`` when every pair has another token, else ``logit``)."""
    unembedding(loaded)
    if not pairs:
        raise AttnscopeError("no prompt pairs to patch")
    if metric is not None and metric not in METRICS:
        raise AttnscopeError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    chosen = metric or ("logit_diff" if all(pair.other is not None for pair in pairs) else "logit")
    encoded = []
    for number, pair in enumerate(pairs, 1):
        where = f"pair {number}: " if len(pairs) > 1 else ""
        try:
            encoded.append(_encode(loaded, pair, chosen))
        except AttnscopeError as error:
            raise AttnscopeError(f"{where}{error}") from None
    return encoded, chosen


def _encode(loaded: LoadedModel, pair: PromptPair, metric: str) -> EncodedPair:
    clean, corrupt = prompt_ids(loaded, pair.clean, chat=False), prompt_ids(loaded, pair.corrupt, chat=False)
    if len(clean) != len(corrupt):
        raise AttnscopeError(f"the clean prompt is {len(clean)} tokens and the corrupted one {len(corrupt)}; patching "
                             "needs prompts of the same token length")
    loaded.check_length(len(clean), "the clean prompt")
    if metric == "logit_diff" and pair.other is None:
        raise AttnscopeError("the logit_diff metric needs the other token (--other, or \"other\" in the file)")
    target = token_id(loaded, pair.target)
    other = None if pair.other is None else token_id(loaded, pair.other, "other")
    device = loaded.input_device
    return EncodedPair(torch.tensor([clean], device=device), torch.tensor([corrupt], device=device), target, other,
                    readable_tokens(loaded.tokenizer, clean))


class PatchHeads(Intervention):
    """Copy head outputs from a clean run: in batch row b, head h of layer l takes ``clean[l][0, :, h]`` where
    ``masks[l][b, h]`` (``clean[l]``: ``[1, q_pos, head, d_head]``; ``masks[l]``: bool ``[batch, head]``)."""

    def __init__(self, clean: Mapping[int, torch.Tensor], masks: Mapping[int, torch.Tensor], kind: str = "self") -> None:
        self.clean, self.masks, self.kind = clean, masks, kind

    def applies_to(self, site: AttentionSite) -> bool:
        return site.kind == self.kind and site.layer in self.masks

    def modify_output(self, site: AttentionSite, output: torch.Tensor) -> torch.Tensor:
        mask = self.masks[site.layer].to(output.device)[:, None, :, None]  # [batch, 1, head, 1]
        return torch.where(mask, self.clean[site.layer].to(output.device, output.dtype), output)


def _replace_rows(layer_of: Mapping[nn.Module, int], table: Mapping[int, torch.Tensor],
                  masks: Mapping[int, torch.Tensor]) -> Callable[..., Any]:
    """A forward hook giving batch rows where ``masks[layer]`` (bool ``[batch, pos]``) the clean output
    ``table[layer]`` (``[1, pos, d_model]``) instead of the module's (``layer_of``: each hooked module's layer)."""
    def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        layer = layer_of[module]
        if layer not in masks:
            return None
        tensor = output[0] if isinstance(output, tuple) else output
        mask = masks[layer].to(tensor.device)[:, :, None]
        patched = torch.where(mask, table[layer].to(tensor.device, tensor.dtype), tensor)
        return (patched, *output[1:]) if isinstance(output, tuple) else patched
    return hook


@dataclass(frozen=True, eq=False)
class PatchingResult:
    """Activation patching over pairs: raw metric values and the share recovered (0 = corrupted, 1 = clean).

    ``clean``/``corrupt`` ``[pair]``: the metric of the two runs. ``heads``/``heads_metric``
    ``[pair, layer, head]``: share recovered / metric with that head's output patched.
    ``mlps`` ``[pair, layer]`` and ``residual`` ``[pair, layer, position]`` (NaN-padded to the
    longest pair; the residual after that layer at that position patched) when asked for, else None.
    ``intervals[name]``: ``(mean, low, high)`` over pairs of ``heads``/``mlps``/``residual`` (bounds NaN
    with fewer than 2 pairs). ``tokens``: each pair's clean tokens, each decoded on its own
    (:func:`~attnscope.capture.tokens.readable_tokens`: WordPiece pieces as they are, ``##berries``; a byte-level
    piece of a character split over tokens shows as ``"�"``), so joining them need not give the prompt back.
    """

    model: str
    metric: str
    method: str
    tokens: tuple[tuple[str, ...], ...]
    targets: tuple[str, ...]
    others: tuple[str | None, ...]
    clean: np.ndarray
    corrupt: np.ndarray
    heads: np.ndarray
    heads_metric: np.ndarray
    mlps: np.ndarray | None = None
    residual: np.ndarray | None = None
    intervals: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    seconds: float = 0.0
    parts: ClassVar[tuple[str, ...]] = ("heads", "mlps", "residual")  # the arrays to_dict writes, where measured

    @property
    def n_pairs(self) -> int:
        return int(self.clean.shape[0])

    def top_heads(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` heads recovering the most on average: ``[(layer, head, mean share), ...]``."""
        mean = np.nan_to_num(self.intervals["heads"][0], nan=-np.inf)
        order = np.argsort(-mean, axis=None)[:k]
        return [(int(layer), int(head), float(self.intervals["heads"][0][layer, head]))
                for layer, head in zip(*np.unravel_index(order, mean.shape))]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN as None)."""
        def plain(value: Any) -> Any:
            if isinstance(value, np.ndarray):
                return [plain(v) for v in value] if value.ndim else plain(value.item())
            if isinstance(value, float):
                return None if not np.isfinite(value) else round(value, 7)
            return value

        data: dict[str, Any] = {"model": self.model, "metric": self.metric, "method": self.method,
                                "n_pairs": self.n_pairs, "seconds": round(self.seconds, 3),
                                "indexing": "layers, heads and positions are 0-indexed",
                                "recovered": "(patched - corrupted) / (clean - corrupted): 0 = corrupted, 1 = clean",
                                "pairs": [{"tokens": list(t), "target": g, "other": o, "clean": plain(float(c)),
                                           "corrupt": plain(float(r))} for t, g, o, c, r in
                                          zip(self.tokens, self.targets, self.others, self.clean, self.corrupt)]}
        for name in self.parts:
            if name in self.intervals:
                mean, low, high = self.intervals[name]
                data[name] = {"mean": plain(mean), "ci_low": plain(low), "ci_high": plain(high),
                              "per_pair": plain(getattr(self, name))}
        return data


def activation_patching(model: LoadedModel | str, pairs: Sequence[PromptPair] | PromptPair, *,
                        metric: str | None = None, mlps: bool = False, residual: bool = False,
                        method: str | None = None, n_resamples: int = 1000, seed: int = 0,
                        progress: bool = False, heads: Sequence[tuple[int, int]] | None = None) -> PatchingResult:
    """Patch every head (and with ``mlps``/``residual`` every MLP / every layer's residual at every
    position) from each pair's clean run into its corrupted run; see the module docstring.

    ``metric``: ``logit_diff`` (needs each pair's ``other``), ``logit`` or ``prob`` (default:
    ``logit_diff`` when every pair has ``other``). ``method``: ``cached`` (default where the adapter
    allows it), ``batched`` or ``naive``. ``n_resamples``: bootstrap resamples (0: no intervals). ``heads``:
    patch only these ``(layer, head)`` (the others' values are NaN; checking estimates of a few heads).
    """
    check_seed(seed, "seed")
    loaded = as_loaded(model)
    pairs = [pairs] if isinstance(pairs, PromptPair) else list(pairs)
    encoded, metric = prepare_pairs(loaded, pairs, metric)
    method = method or ("cached" if _cacheable(loaded) else "batched")
    if method not in METHODS:
        raise AttnscopeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "cached" and not _cacheable(loaded):
        raise AttnscopeError(f"the adapter for {loaded.config.model_type!r} does not say which modules follow the last "
                             "block, so patched runs cannot start from a middle layer; use method='batched'")
    start = time.perf_counter()
    only = None if heads is None else frozenset(heads)
    runs = [_patch_pair(loaded, pair, metric, method, mlps=mlps, residual=residual, only=only) for pair in
            _progress(encoded, progress)]
    seconds = time.perf_counter() - start
    return _result(loaded, encoded, runs, metric, method, seconds, n_resamples, seed)


def _progress(items: list[EncodedPair], enabled: bool) -> Iterator[EncodedPair]:
    from tqdm.auto import tqdm

    yield from tqdm(items, desc="patching", unit="pair", disable=not enabled, leave=False)


def _cacheable(loaded: LoadedModel) -> bool:
    return loaded.adapter.final is not None and bool(blocks_by_layer(loaded))


def metric_value(logits: torch.Tensor, metric: str, target: int, other: int | None) -> torch.Tensor:
    """``[rows, vocab]`` last-position logits -> the metric ``[rows]`` (float32, differentiable)."""
    logits = logits.float()
    if metric == "prob":
        return torch.softmax(logits, dim=-1)[:, target]
    values = logits[:, target]
    if metric == "logit_diff":
        assert other is not None
        values = values - logits[:, other]
    return values


# ---- one pair --------------------------------------------------------------------------------------------
@dataclass
class PatchRunner:
    """Runs the corrupted prompt with patches: from a cached block input (``cached``) or whole."""

    loaded: LoadedModel
    pair: EncodedPair
    metric: str
    cached: bool
    kept: Any = None
    blocks: list[nn.Module] = field(default_factory=list)
    finals: list[nn.Module] = field(default_factory=list)

    def score(self, logits: torch.Tensor) -> np.ndarray:
        """``[rows, vocab]`` last-position logits -> the metric ``[rows]``."""
        values = metric_value(logits, self.metric, self.pair.target, self.pair.other)
        return cast(np.ndarray, values.detach().double().cpu().numpy())

    def whole(self, ids: torch.Tensor, rows: int = 1) -> np.ndarray:
        """The metric of full forward passes of ``ids`` repeated ``rows`` times."""
        out = self.loaded.model(input_ids=ids.repeat(rows, 1), use_cache=False, **last_logits_only(self.loaded))
        return self.score(out.logits[:, -1])

    def from_layer(self, first: int, rows: int, hooks: AbstractContextManager[Any] | None = None) -> np.ndarray:
        """The metric of ``rows`` copies of the corrupted run, from block ``first`` on (``cached``), or whole."""
        with hooks or nullcontext():
            if not self.cached:
                return self.whole(self.pair.corrupt, rows)
            hidden = run_blocks_from(self.blocks, self.kept, first, 1, rows)[:, -1:]
            for module in self.finals:
                hidden = module(hidden)
            return self.score(hidden[:, -1])


def _patch_pair(loaded: LoadedModel, pair: EncodedPair, metric: str, method: str, *, mlps: bool,
                residual: bool, only: frozenset[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The clean, corrupted and patched metrics of one pair."""
    kind, n_layers, n_heads = attention_shape(loaded, "self")
    blocks = blocks_by_layer(loaded)
    ffn = {layer: module for (k, layer), module in find_modules(loaded.model, loaded.adapter.ffn).items() if k == kind}
    runner = PatchRunner(loaded, pair, metric, cached=method == "cached", blocks=blocks,
                     finals=final_modules(loaded) if method == "cached" else [])
    clean_heads = HeadOutputs((kind,))
    clean_ffn: dict[int, torch.Tensor] = {}
    clean_blocks: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        with capture(loaded.sites, recorder=clean_heads), _keeping(ffn if mlps else {}, clean_ffn), \
                _keeping(dict(enumerate(blocks)) if residual else {}, clean_blocks):
            clean = float(runner.whole(pair.clean)[0])
        with block_inputs(blocks) if runner.cached else nullcontext() as kept:
            corrupt = float(runner.whole(pair.corrupt)[0])
        runner.kept = kept
        out: dict[str, Any] = {"clean": clean, "corrupt": corrupt}
        out["heads"] = patch_each_head(runner, clean_heads.of_kind(kind), n_layers, n_heads, method, only)
        if mlps:
            out["mlps"] = _patch_modules(runner, ffn, clean_ffn, n_layers, each_position=False)
        if residual:
            out["residual"] = _patch_modules(runner, dict(enumerate(blocks)), clean_blocks, n_layers,
                                             each_position=True)
    return out


def _keeping(modules: Mapping[int, nn.Module], table: dict[int, torch.Tensor]) -> AbstractContextManager[Any]:
    """Hooks keeping each module's output (``[1, pos, d_model]``) in ``table`` by layer."""
    if not modules:
        return nullcontext()
    layer_of = {module: layer for layer, module in modules.items()}

    def keep(module: nn.Module, inputs: Any, output: Any) -> None:
        table[layer_of[module]] = (output[0] if isinstance(output, tuple) else output).detach()

    return local_hooks(list(modules.values()), keep)


def _chunks(n: int, per_row_tokens: int) -> Iterator[range]:
    size = max(1, TOKEN_BUDGET // max(1, per_row_tokens))
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def patch_each_head(runner: PatchRunner, clean: Mapping[int, torch.Tensor], n_layers: int, n_heads: int,
                 method: str, only: frozenset[tuple[int, int]] | None = None) -> np.ndarray:
    """``[layer, head]`` metric with each head's output patched from the clean run (only the ``only`` heads where
    given; NaN for the others)."""
    values = np.zeros((n_layers, n_heads)) if only is None else np.full((n_layers, n_heads), np.nan)
    n_tokens = int(runner.pair.corrupt.shape[1])
    wanted = [[head for head in range(n_heads) if only is None or (layer, head) in only] for layer in range(n_layers)]
    if method == "naive":
        for layer in range(n_layers):
            for head in wanted[layer]:
                mask = torch.zeros((1, n_heads), dtype=torch.bool)
                mask[0, head] = True
                with intervene(PatchHeads(clean, {layer: mask})):
                    values[layer, head] = runner.whole(runner.pair.corrupt)[0]
        return values
    if method == "cached":  # the patches of one layer side by side, from that layer's cached input
        for layer in range(n_layers):
            for rows in _chunks(len(wanted[layer]), n_tokens):
                heads = [wanted[layer][row] for row in rows]
                mask = torch.zeros((len(heads), n_heads), dtype=torch.bool)
                mask[torch.arange(len(heads)), torch.tensor(heads)] = True
                values[layer, heads] = runner.from_layer(layer, len(heads), intervene(PatchHeads(clean, {layer: mask})))
        return values
    cells = [(layer, head) for layer in range(n_layers) for head in wanted[layer]]  # batched whole passes
    for rows in _chunks(len(cells), n_tokens):
        masks = {layer: torch.zeros((len(rows), n_heads), dtype=torch.bool) for layer in range(n_layers)}
        for slot, index in enumerate(rows):
            layer, head = cells[index]
            masks[layer][slot, head] = True
        result = runner.from_layer(0, len(rows), intervene(PatchHeads(clean, masks)))
        for slot, index in enumerate(rows):
            values[cells[index]] = result[slot]
    return values


def _patch_modules(runner: PatchRunner, modules: Mapping[int, nn.Module], clean: Mapping[int, torch.Tensor],
                   n_layers: int, *, each_position: bool) -> np.ndarray:
    """Patch each module's output from the clean run: ``[layer]`` (MLPs, every position at once) or, with
    ``each_position``, ``[layer, position]`` (one position per batch row; the residual after each block)."""
    n_tokens = int(runner.pair.corrupt.shape[1])
    layer_of = {module: layer for layer, module in modules.items()}
    hooked = list(modules.values())
    if not each_position:  # row r patches layer r's MLP; all from block 0
        masks = {layer: torch.zeros((n_layers, n_tokens), dtype=torch.bool) for layer in modules}
        for layer in modules:
            masks[layer][layer] = True
        return runner.from_layer(0, n_layers, local_hooks(hooked, _replace_rows(layer_of, clean, masks)))
    values = np.zeros((n_layers, n_tokens))
    for layer in modules:  # row p patches position p of this block's output; from this block on
        for positions in _chunks(n_tokens, n_tokens):
            mask = torch.zeros((len(positions), n_tokens), dtype=torch.bool)
            mask[torch.arange(len(positions)), torch.tensor(list(positions))] = True
            values[layer, positions.start:positions.stop] = runner.from_layer(
                layer, len(positions), local_hooks(hooked, _replace_rows(layer_of, clean, {layer: mask})))
    return values


# ---- over pairs --------------------------------------------------------------------------------------------
def _recovered(values: np.ndarray, clean: float, corrupt: float) -> np.ndarray:
    gap = clean - corrupt
    if gap == 0:
        return np.full_like(values, np.nan)
    return (values - corrupt) / gap


def padded(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Each pair's ``[layer, position, ...]`` -> ``[pair, layer, position, ...]`` with NaN after each pair's last
    position."""
    longest = max(a.shape[1] for a in arrays)
    out = np.full((len(arrays), arrays[0].shape[0], longest, *arrays[0].shape[2:]), np.nan)
    for index, array in enumerate(arrays):
        out[index, :, : array.shape[1]] = array
    return out


def mean_interval(values: np.ndarray, n_resamples: int = 1000, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over the first axis (pairs, NaN ignored) and its percentile bootstrap 95% interval
    (``scipy.stats.bootstrap``, seeded); the bounds are NaN with fewer than 2 pairs or no resamples."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN cell (a pair shorter than the position)
        mean = np.nanmean(values, axis=0)
    nan = np.full_like(mean, np.nan)
    if values.shape[0] < 2 or n_resamples < 1:
        return mean, nan, nan.copy()
    from scipy.stats import bootstrap

    # resampled copies of a large part (per position and head) in batches, so that they stay near BOOTSTRAP_VALUES
    batch = None if values.size * n_resamples <= BOOTSTRAP_VALUES else max(1, BOOTSTRAP_VALUES // values.size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cells that never vary give degenerate (NaN or equal) bounds
        interval = bootstrap((values,), np.nanmean, axis=0, vectorized=True, n_resamples=n_resamples,
                             confidence_level=CONFIDENCE, method="percentile", batch=batch,
                             rng=np.random.default_rng(seed)).confidence_interval
    return mean, np.asarray(interval.low), np.asarray(interval.high)


def _result(loaded: LoadedModel, encoded: Sequence[EncodedPair], runs: Sequence[dict[str, Any]], metric: str,
            method: str, seconds: float, n_resamples: int, seed: int) -> PatchingResult:
    clean = np.array([run["clean"] for run in runs])
    corrupt = np.array([run["corrupt"] for run in runs])
    parts: tuple[str, ...] = ("heads", "mlps", "residual")
    shares = {name: [_recovered(run[name], run["clean"], run["corrupt"]) for run in runs]
              for name in parts if name in runs[0]}
    stacked = {name: padded(values) if name == "residual" else np.stack(values) for name, values in shares.items()}
    intervals = {name: mean_interval(values, n_resamples, seed) for name, values in stacked.items()}
    def text(token: int) -> str:
        return readable_tokens(loaded.tokenizer, [token])[0]

    return PatchingResult(loaded.name, metric, method, tuple(pair.tokens for pair in encoded),
                          tuple(text(pair.target) for pair in encoded),
                          tuple(None if pair.other is None else text(pair.other) for pair in encoded),
                          clean, corrupt, stacked["heads"], np.stack([run["heads"] for run in runs]),
                          stacked.get("mlps"), stacked.get("residual"), intervals, seconds)
