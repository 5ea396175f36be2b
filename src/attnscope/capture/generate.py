"""Generation with capture: a decoder writes, and every position's attention row is kept as it goes.

transformers' own ``generate`` runs the decoding (greedy or sampling, the model's key/value
cache, its stop tokens); attnscope's attention function sees every call. With the cache on, each
step computes one query row per layer, so what is kept grows with the text, not with the text
squared per step. One last forward pass of the final token completes its row, so the record covers
the whole final text. Interventions (``intervene``, ``ablate_heads``, ``skip_sublayers``) active
around the call apply at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..arguments import check_sampling, check_seed
from ..errors import AttnscopeError
from ..memory import trim_heap
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel, _quiet_transformers
from ..records.generation import GenerationRecord, packed_length, row_offset
from .attention import capture, interventions_active
from .extract import as_loaded, model_info_from, n_config_heads, n_main_layers
from .growing_cache import growing_caches
from .hooks import local_hooks
from .kv_budget import (
    DEFAULT_SCORE,
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    KVBudget,
    budget_from,
    budgeted_cache,
    check_evicts,
)
from .plan import MemoryEstimate, check_memory
from .recorders import (
    AttentionCall,
    Recorder,
    RecorderGroup,
    SiteCapture,
    expand_kv_heads,
    per_head_out_proj,
    value_norms,
)
from .tokens import guess_word_ids, readable_tokens

DEFAULT_CANDIDATES = 10
GENERATE_ADVICE = "generate fewer tokens (max_new_tokens) or use a shorter prompt"
DROP_PROMPT_ROWS_ADVICE = "keep only the steps' rows (prompt_rows=False, --prompt-rows last)"
# The prompt's rows are kept by default while they take at most this much (float32, all layers and
# heads): a SmolLM2 prompt of about 1,000 tokens. Below it, a record converts to a full [layer, head,
# T, T] AttentionRecord for every view and statistic, and memory stays small next to a laptop's; above
# it the prompt's rows grow with its square (8,192 tokens: 34 GiB) while the step view and the
# per-step table never read them (only each step's own row), and `attnscope view`/`extract` capture a
# long prompt's attention on their own, in row chunks.
PROMPT_ROWS_BUDGET = 512 * 2**20
NORM_POSITIONS = 256  # positions whose value norms one product computes at the end of a generation


@dataclass
class StepRows(Recorder):
    """Records every self-attention call of a generation (a capture's recorder).

    The prompt arrives as one ``[head, P, P]`` block per layer, then each step as ``[head, 1, k]``;
    keys are the last ``k`` positions up to the call's last query (a sliding-window cache may hold
    fewer than all). Each call's rows from ``first_row`` on are written, as they arrive, into one array
    made for its ``layers`` and ``n_positions`` positions (a call's rows are one stretch of the
    packed axis) and the call's block is let go: a prompt's rows before ``first_row`` are never kept, so
    at most one layer's prefill block is in memory at a time. One array, not a piece per call: pieces
    joined at the end were held twice, and thousands of small long-lived pieces between each step's
    short-lived tensors fragmented the heap (SmolLM2, 256 tokens after 512: 6.3 GB peak for 305 MB kept).
    ``with_norms``: also keep ``||v W_O||`` of the keys each call adds (their values, whose norms :meth:`value_norms`
    takes at the end); a model that gates
    its heads' output (Qwen3-Next) keeps none, since what a head adds per key then depends on the query.
    """

    first_row: int = 0
    with_norms: bool = False
    layers: tuple[int, ...] = (0,)  # the self-attention sites' layer numbers, ascending (hybrids skip some): row order
    n_positions: int = 1  # the most positions the generation can reach (prompt + max_new_tokens)
    kept: np.ndarray | None = None  # [layer, head, packed] from first_row, made at the first call
    values: dict[int, GrowingTensor] = field(default_factory=dict)  # per layer: every key's value [kv_head, pos, d_head]
    norm_sites: dict[int, tuple[AttentionSite, int]] = field(default_factory=dict)  # per layer: its site, query heads
    sink_masses: dict[int, list[np.ndarray]] = field(default_factory=dict)  # per layer: [head, row], learned sinks
    learned_sinks: bool = False  # some call had learned sinks (gpt-oss): the record keeps sink_masses
    positions: dict[int, int] = field(default_factory=dict)  # per layer: queries seen so far
    first: SiteCapture | None = None
    out_projs: dict[AttentionSite, torch.Tensor] = field(default_factory=dict)  # per site: W_O by head, for norms
    heard_ungated: set[AttentionSite] = field(default_factory=set)  # sites whose output gate read None

    def __post_init__(self) -> None:
        self.hears_gates = self.with_norms  # a generation's per-key norms cannot hold a per-query gate

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def output_gate(self, site: AttentionSite, gate: torch.Tensor | None) -> None:
        """A gated model (Qwen3-Next): per-key norms cannot hold a per-query gate, so none are kept. A site heard
        a second time with no gate ends the listening: the first pass (the prompt) read every site, and whether a
        site has a gate is in the model's weights, so reading each step's again would only cost time."""
        if gate is not None:
            self.with_norms = self.hears_gates = False
            self.values.clear()
        elif site in self.heard_ungated:
            self.hears_gates = False
        else:
            self.heard_ungated.add(site)

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        captured = SiteCapture(attention=call.probs.detach(), n_kv_heads=call.n_kv_heads, d_head=call.d_head,
                               scaling=call.scaling, first_query=call.first_query, sink_mass=call.sink_mass)
        if self.with_norms:  # the earlier keys' values came with earlier calls
            self.keep_new_values(site, call)
        self(site, captured)

    def keep_new_values(self, site: AttentionSite, call: AttentionCall) -> None:
        """Append the values of the keys ``call`` added (grouped, ``[kv_head, new key, d_head]``): their norms are taken
        at the end (:meth:`value_norms`), in a few large products, not in five small operations per layer and step
        (a tenth of a step's time for SmolLM2); a sliding window's cache may later drop them."""
        added = call.first_query + call.query.shape[2]  # one key per query of the call
        self.values.setdefault(site.layer, GrowingTensor(axis=1)).append(call.value[0, :, call.value.shape[2] - added :])
        self.norm_sites[site.layer] = site, call.probs.shape[1]

    def out_proj_of(self, site: AttentionSite, n_heads: int) -> torch.Tensor:
        """``W_O`` split by head, ``[head, d_head, d_model]``, contiguous, made once per site and generation
        (the split is a strided view that a matrix product would copy at every step)."""
        if site not in self.out_projs:
            self.out_projs[site] = per_head_out_proj(site, n_heads, unavailable="norms").contiguous()
        return self.out_projs[site]

    def __call__(self, site: AttentionSite, captured: SiteCapture) -> None:
        """Pack one call's rows (``captured.attention``: ``[1, head, q_row, k_pos]``)."""
        self.first = self.first or captured
        start = self.positions.get(site.layer, 0) + captured.first_query  # the block's first query position
        block = captured.attention[0]  # batch of one: [head, q_pos, k_pos]
        self.positions[site.layer] = start + block.shape[1]
        kept = max(0, self.first_row - start)  # the call's queries before first_row are dropped here
        if kept < block.shape[1]:
            self.write_rows(site.layer, start + kept, block[:, kept:])
            self.sink_masses.setdefault(site.layer, []).append(
                np.zeros((block.shape[0], block.shape[1] - kept), np.float32) if captured.sink_mass is None
                else captured.sink_mass[0, :, kept:].float().cpu().numpy())  # [head, row]
            self.learned_sinks = self.learned_sinks or captured.sink_mass is not None
        if block.shape[1] > 1:  # the prompt's pass: hand each layer's freed blocks back before the next (see trim_heap)
            trim_heap()

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        """How many of a call's first queries have no row kept: the attention function then runs them
        fused and computes the probabilities of the others only (a long prompt's prefill)."""
        return max(0, self.first_row - self.positions.get(site.layer, 0))

    def write_rows(self, layer: int, start: int, block: torch.Tensor) -> None:
        """Write rows ``start..`` (``block``: ``[head, q_pos, k_pos]``) into the kept array at their packed place."""
        if self.kept is None:  # untouched pages cost nothing: a generation that stops early never fills them
            length = packed_length(self.n_positions) - row_offset(self.first_row)
            self.kept = np.empty((len(self.layers), block.shape[0], length), dtype=np.float32)
        if start + block.shape[1] > self.n_positions:
            raise AttnscopeError(f"a generation call reached position {start + block.shape[1] - 1}, past the "
                                 f"{self.n_positions} positions its rows were made for")
        offset = row_offset(start) - row_offset(self.first_row)
        pack_rows(start, block, self.kept[self.row_of(layer), :, offset : offset + packed_length(start + block.shape[1])
                                          - row_offset(start)])

    def row_of(self, layer: int) -> int:
        """Where ``layer``'s rows sit on the kept array's first axis: its rank among the attention layers (a hybrid
        such as Qwen3-Next has attention at some layers only)."""
        return self.layers.index(layer)

    def kept_elements(self, layer: int) -> int:
        """How many numbers of ``layer`` are kept so far (its rows up to the last position it has seen)."""
        if self.kept is None:
            return 0
        return self.kept.shape[1] * max(0, packed_length(self.positions.get(layer, 0)) - row_offset(self.first_row))

    def packed(self, n_positions: int) -> np.ndarray:
        """The rows of positions ``first_row..n_positions-1``, ``[layer, head, packed]`` (see
        :func:`attnscope.records.generation.row_offset`): the kept array itself, or a copy of its start where the
        generation stopped early."""
        assert self.kept is not None
        length = packed_length(n_positions) - row_offset(self.first_row)
        rows = self.kept if length == self.kept.shape[-1] else np.ascontiguousarray(self.kept[..., :length])
        self.kept = None
        return rows

    def sink_mass(self) -> np.ndarray | None:
        """Learned sinks' share of each kept row, ``[layer, head, row]``, or None when no call had them."""
        if not self.learned_sinks:
            return None
        return np.stack([np.concatenate(self.sink_masses[layer], axis=-1) for layer in sorted(self.sink_masses)])

    def value_norms(self) -> np.ndarray | None:
        """``||v_j W_O^h||``, ``[layer, head, position]``, or None when norms were not asked for (or a gate ended
        them); the kept values are let go layer by layer."""
        if not self.values:
            return None
        return np.stack([self.layer_value_norms(layer) for layer in sorted(self.values)])

    def layer_value_norms(self, layer: int) -> np.ndarray:
        """``layer``'s value norms ``[head, position]``, ``NORM_POSITIONS`` positions at a time (each product holds
        ``[head, positions, d_model]``)."""
        site, n_heads = self.norm_sites[layer]
        values = self.values.pop(layer).view()[None]  # [1, kv_head, position, d_head]
        per_head = self.out_proj_of(site, n_heads)
        pieces = [value_norms(expand_kv_heads(values[:, :, start : start + NORM_POSITIONS], n_heads), site, per_head)[0]
                  for start in range(0, values.shape[2], NORM_POSITIONS)]
        return torch.cat(pieces, dim=-1).float().cpu().numpy()


class GrowingTensor:
    """A tensor (float32 unless ``dtype``) that grows along ``axis`` as pieces are appended, in a buffer that grows by half when full:
    :meth:`view` is every piece so far without a copy per append (a list of pieces joined at the end is held twice,
    and joining at every step copies the whole each time)."""

    GROWTH = 1.5

    def __init__(self, axis: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.axis, self.length, self.dtype = axis, 0, dtype
        self.buffer: torch.Tensor | None = None

    def append(self, piece: torch.Tensor) -> None:
        n = piece.shape[self.axis]
        if self.buffer is None or self.length + n > self.buffer.shape[self.axis]:
            shape = list(piece.shape)
            shape[self.axis] = max(16, int(self.GROWTH * (self.length + n)))
            grown = torch.empty(shape, dtype=self.dtype, device=piece.device)
            if self.buffer is not None:
                grown.narrow(self.axis, 0, self.length).copy_(self.view())
            self.buffer = grown
        self.buffer.narrow(self.axis, self.length, n).copy_(piece.detach())
        self.length += n

    def view(self, length: int | None = None) -> torch.Tensor:
        """The first ``length`` entries along the axis (default: all appended)."""
        assert self.buffer is not None, "nothing appended yet"
        return self.buffer.narrow(self.axis, 0, self.length if length is None else length)


class LayerBuffers:
    """One float32 tensor per layer, each growing along ``axis`` like a :class:`GrowingTensor`, kept together in one
    buffer ``[layer, ...]``: :meth:`stacked` is every layer's first entries as one view, where stacking the layers'
    own buffers would copy them all (a route step reads every layer's keys and values together). Growing copies
    every layer's at once, so the old buffer and the new are held together for that moment."""

    def __init__(self, n_layers: int, axis: int) -> None:
        self.n_layers, self.axis = n_layers, axis
        self.lengths = [0] * n_layers
        self.buffer: torch.Tensor | None = None

    def append(self, layer: int, piece: torch.Tensor) -> None:
        n, length = piece.shape[self.axis], self.lengths[layer]
        if self.buffer is None or length + n > self.buffer.shape[self.axis + 1]:
            shape = [self.n_layers, *piece.shape]
            shape[self.axis + 1] = max(16, int(GrowingTensor.GROWTH * (length + n)))
            grown = torch.zeros(shape, dtype=torch.float32, device=piece.device)
            if self.buffer is not None:
                kept = self.buffer.shape[self.axis + 1]
                grown.narrow(self.axis + 1, 0, kept).copy_(self.buffer)
            self.buffer = grown
        self.buffer[layer].narrow(self.axis, length, n).copy_(piece.detach())
        self.lengths[layer] = length + n

    def view(self, layer: int, length: int) -> torch.Tensor:
        """Layer ``layer``'s first ``length`` entries along the axis."""
        assert self.buffer is not None, "nothing appended yet"
        return self.buffer[layer].narrow(self.axis, 0, length)

    def stacked(self, length: int) -> torch.Tensor:
        """Every layer's first ``length`` entries, ``[layer, ...]`` (a view)."""
        assert self.buffer is not None, "nothing appended yet"
        return self.buffer.narrow(self.axis + 1, 0, length)


class GenerationPasses:
    """A generation's forward passes as a recorder hears them (the prompt's, then one per token), each finished once:
    ``ends`` holds each pass's last position; layer 0's call (heard first in every pass) begins a pass, so the passes
    before it are over and ``finish_pass(index)`` runs for each not finished yet, in order, while the text is
    generated; :meth:`finish` catches up at the end (the passes no later one followed)."""

    def __init__(self, finish_pass: Callable[[int], None]) -> None:
        self.finish_pass = finish_pass
        self.ends: list[int] = []  # each pass's last position
        self.finished = 0

    def heard(self, layer: int, n_new: int) -> None:
        """A call of ``layer`` whose pass adds ``n_new`` positions: layer 0's begins a pass."""
        if layer == 0:
            self.finish(len(self.ends))
            self.ends.append((self.ends[-1] if self.ends else -1) + n_new)

    @property
    def current(self) -> int:
        """The index of the pass being heard (0-indexed: the prompt's is 0)."""
        return len(self.ends) - 1

    def finish(self, n_passes: int) -> None:
        """Finish every pass before ``n_passes`` not finished yet."""
        while self.finished < n_passes:
            self.finish_pass(self.finished)
            self.finished += 1


def pack_rows(start: int, block: torch.Tensor, out: np.ndarray) -> None:
    """Write ``block`` ``[head, q, k]`` (queries ``start..start+q-1``, keys ending at the last query) into ``out``,
    rows ``start..start+q-1`` of the packed axis: ``[head, row_offset(start + q) - row_offset(start)]`` float32;
    keys before the block's first key (outside a sliding window's cache) hold 0."""
    n_queries, n_keys = block.shape[1], block.shape[2]
    first_key = start + n_queries - n_keys  # absolute position of the block's key 0
    target = torch.from_numpy(out)  # the same memory
    if n_queries == 1:  # a decoding step: its one row sees every key up to itself, already in packed order
        target[:, :first_key] = 0.0  # keys a sliding window's cache no longer holds
        target[:, first_key:] = block[:, 0]
        return
    if first_key > 0:  # several queries of a sliding-window layer: pad them to every key
        padded = block.new_zeros((block.shape[0], n_queries, start + n_queries))
        padded[:, :, first_key:] = block
        block = padded
    queries = torch.arange(start, start + n_queries, device=block.device)[:, None]
    causal = torch.arange(start + n_queries, device=block.device)[None, :] <= queries  # [q, key]
    target.copy_(block[:, causal])  # row-major over [q, key]: the packed order


def prompt_ids(loaded: LoadedModel, prompt: str, *, chat: bool) -> list[int]:
    """The prompt's token ids: as the tokenizer encodes it, or wrapped in the model's chat template."""
    if not prompt.strip():
        raise AttnscopeError("the prompt is empty")
    tokenizer = loaded.tokenizer
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise AttnscopeError(f"model {loaded.name!r} has no chat template; leave out --chat")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


@dataclass(frozen=True)
class GenerationShape:
    """What a generation's memory depends on: the model's sizes (0-indexed layers, query and key/value heads) and
    the positions it can reach."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    vocab: int
    n_prompt: int
    max_new_tokens: int

    @property
    def n_positions(self) -> int:
        return self.n_prompt + self.max_new_tokens


def generation_shape(loaded: LoadedModel, n_prompt: int, max_new_tokens: int) -> GenerationShape:
    """The :class:`GenerationShape` of ``loaded`` generating ``max_new_tokens`` after ``n_prompt`` tokens (sizes the
    config does not name are guessed from those it does)."""
    config = getattr(loaded.config, "text_config", None) or loaded.config
    heads = n_config_heads(loaded)
    d_model = int(getattr(config, "hidden_size", 0) or 64 * heads)
    d_head = int(getattr(config, "head_dim", 0) or d_model // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    return GenerationShape(n_main_layers(loaded), heads, kv_heads, d_head, d_model,
                           int(getattr(config, "vocab_size", 0) or 0), n_prompt, max_new_tokens)


def check_generation(loaded: LoadedModel, n_prompt: int, max_new_tokens: int, *, first_row: int = 0,
                     recorders: Sequence[GenerationRecorder] = (), candidates: int = DEFAULT_CANDIDATES) -> None:
    """Refuse models that do not generate this way, too long texts, and rows that would not fit
    (``first_row``: the first position whose row is kept), with what the ``recorders`` keep and need."""
    if loaded.is_encoder_decoder or not loaded.causal:
        raise AttnscopeError(f"model {loaded.name!r} is not a decoder-only language model; generate needs one "
                             "(the toy translator has its own step view: attnscope toy translate --html)")
    total = n_prompt + max_new_tokens
    if total > loaded.max_length:
        raise AttnscopeError(f"{n_prompt} prompt tokens + {max_new_tokens} new tokens is more than "
                             f"{loaded.name}'s limit of {loaded.max_length} tokens")
    estimate = generation_estimate(loaded, n_prompt, max_new_tokens, first_row=first_row, recorders=recorders,
                                   candidates=candidates)
    advice = GENERATE_ADVICE if first_row else f"{GENERATE_ADVICE}, or {DROP_PROMPT_ROWS_ADVICE}"
    advice += "".join(f", or {extra.option}" for extra in recorders if extra.option)
    check_memory(estimate, what=f"generating {total} tokens with {loaded.name}", advice=advice)


def generation_estimate(loaded: LoadedModel, n_prompt: int, max_new_tokens: int, *, first_row: int = 0,
                        recorders: Sequence[GenerationRecorder] = (),
                        candidates: int = DEFAULT_CANDIDATES) -> MemoryEstimate:
    """Bytes a generation of ``max_new_tokens`` after ``n_prompt`` tokens needs at its peak besides the model: its
    rows from ``first_row`` on, what the ``recorders`` keep and need, and the top ``candidates`` of every step."""
    layers, heads = n_main_layers(loaded), n_config_heads(loaded)  # decoder-only: the main side is "self"
    # an intervention changes every row, so the prompt runs eagerly whatever rows are kept
    estimate = generation_memory(layers, heads, n_prompt, max_new_tokens, first_row=first_row,
                                 fused_prompt=not interventions_active())
    shape = generation_shape(loaded, n_prompt, max_new_tokens)
    for extra in (*recorders, StepCandidates(candidates)):
        more = extra.memory(shape)
        estimate = MemoryEstimate(kept=estimate.kept + more.kept, working=estimate.working + more.working)
    return estimate


def generation_memory(n_layers: int, n_heads: int, n_prompt: int, max_new_tokens: int, *,
                      first_row: int = 0, fused_prompt: bool = True) -> MemoryEstimate:
    """Bytes a generation needs at its peak, besides the model (float32, as capture computes).

    Kept: the rows of positions ``first_row`` on, for every layer and head, twice (the per-call
    pieces and the record's array while they are joined). Working: the prompt's forward pass, one
    layer at a time: the scores, probabilities and one more copy of the rows it keeps (every prompt
    row, or from ``first_row`` on, the rest running fused: see ``StepRows.rows_not_wanted``; every
    row without ``fused_prompt``, under an intervention), and the causal masks (one per kind of
    layer: global, sliding window).
    """
    kept = n_layers * n_heads * (packed_length(n_prompt + max_new_tokens) - row_offset(first_row)) * 4 * 2
    computed_rows = n_prompt - first_row if first_row and fused_prompt else n_prompt
    working = n_heads * computed_rows * n_prompt * 4 * 3 + n_prompt * n_prompt * 4 * 2
    return MemoryEstimate(kept=kept, working=working)


def keeps_prompt_rows(prompt_rows: bool | None, n_layers: int, n_heads: int, n_prompt: int) -> bool:
    """Whether to keep every prompt position's row: ``prompt_rows`` when given, else (None) while
    they take at most :data:`PROMPT_ROWS_BUDGET`."""
    if prompt_rows is not None:
        return prompt_rows
    return n_layers * n_heads * packed_length(n_prompt) * 4 <= PROMPT_ROWS_BUDGET




# Tokens between two trims of the heap. Every token's, while each step's cache was a new copy of the whole cache
# (transformers' concatenation), was needed to keep those freed copies from piling up (every 32 tokens: a peak 900 MB
# higher at 256 tokens); it cost about 18 ms a step at a thousand tokens. The cache now grows in place
# (growing_cache.py), and what a step frees is small.
TRIM_EVERY = 64


class _Progress:
    """A transformers streamer that advances a progress bar once per generated token, and trims the heap
    (:data:`trim_heap`) every ``TRIM_EVERY`` tokens."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.prompt_seen, self.tokens = bar, False, 0
        self.trim = trim_heap

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(1)
            self.tokens += 1
        self.prompt_seen = True
        if self.tokens % TRIM_EVERY == 0:
            self.trim()

    def end(self) -> None:
        self.bar.close()


def generate(model: LoadedModel | str, prompt: str, *, max_new_tokens: int = 64, chat: bool = False,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, candidates: int = DEFAULT_CANDIDATES, norms: bool = True,
             changes: str = "", progress: bool = False, prompt_rows: bool | None = None,
             recorders: Sequence[GenerationRecorder] = (), kv_budget: KVBudget | float | None = None,
             kv_scores: Any = None, kv_score: str = DEFAULT_SCORE, kv_sink: int = DEFAULT_SINK,
             kv_window: int = DEFAULT_WINDOW) -> GenerationRecord:
    """Generate up to ``max_new_tokens`` after ``prompt`` and keep what every token attended to.

    Greedy by default; ``do_sample`` with ``temperature``/``top_k``/``top_p`` samples (seeded by
    ``seed``). ``chat`` wraps the prompt in the model's chat template. ``candidates``: how many top
    next tokens each step keeps. ``norms``: also keep ``||v W_O||`` per key, for norm-weighted rows.
    A model that gates its heads' output (Qwen3-Next) keeps no norms: its per-key norms would depend on the query.
    ``changes`` labels interventions active around the call (kept in the record for the views).
    ``prompt_rows``: True keeps every prompt position's row (a full ``[layer, head, T, T]`` record
    can be made), False only the rows from the prompt's last position on (each step's row: what the
    step view and the per-step table show; memory grows with the text, not its square); None (the
    default) keeps them while they take at most :data:`PROMPT_ROWS_BUDGET`. ``recorders``: more of what to keep,
    from the same forward passes, each adding arrays to the record (:class:`GenerationRecorder`), e.g.
    ``recorders=[attnscope.attribution.StepAttribution()]``, each step's direct logit attribution
    (``attnscope generate --attribute``; ``StepAttribution(lens=True)`` adds the logit lens, ``--lens``); without any
    nothing costs more. A sequence joined to the record's
    own recorder rather than one ``recorder=`` replacing it: the record always needs its rows (:class:`StepRows`),
    and a capture asks one recorder, so generate hands each call to both
    (:class:`~attnscope.capture.recorders.RecorderGroup`), the protocol unchanged.

    ``kv_budget``: generate with a :class:`~attnscope.capture.kv_budget.BudgetedCache` (full KV heads keep every
    key, streaming ones the first ``kv_sink`` and the ``kv_window`` most recent): a
    :class:`~attnscope.capture.kv_budget.KVBudget`, or a share of full heads (0-1) or bytes (an int above 1) chosen
    from ``kv_scores`` (a ``HeadScores``, its Parquet file or an array ``[layer, kv_head]``; column ``kv_score``).
    The rows stay over every position (0 at evicted keys); ``record.settings["kv_budget"]`` says which heads streamed.

    >>> gen = attnscope.generate("smollm2", "The sea is", max_new_tokens=8)   # doctest: +SKIP
    >>> gen.step_attention(0).shape          # [layer, head, prompt_length + 0]   # doctest: +SKIP
    """
    check_seed(seed, "seed")
    loaded = as_loaded(model)
    if max_new_tokens < 1 or candidates < 1:
        raise AttnscopeError("max_new_tokens and candidates must be at least 1")
    check_sampling(temperature=temperature, top_p=top_p, top_k=top_k)
    ids = prompt_ids(loaded, prompt, chat=chat)
    keep = keeps_prompt_rows(prompt_rows, n_main_layers(loaded), n_config_heads(loaded), len(ids))
    first_row = 0 if keep else len(ids) - 1  # the prompt's last row chose the first generated token
    check_generation(loaded, len(ids), max_new_tokens, first_row=first_row, recorders=recorders, candidates=candidates)
    budget = None if kv_budget is None else generation_budget(loaded, kv_budget, kv_scores, kv_score, kv_sink,
                                                              kv_window, len(ids) + max_new_tokens)
    if budget is not None:
        check_budget_recorders(recorders)
    settings: dict[str, Any] = {"do_sample": do_sample, "max_new_tokens": max_new_tokens, "chat": chat}
    if do_sample:
        settings.update(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if budget is not None:
        settings["kv_budget"] = budget.to_dict()
    layers = tuple(sorted(site.layer for site in loaded.sites.values() if site.kind == "self"))
    rows = StepRows(first_row=first_row, with_norms=norms, layers=layers, n_positions=len(ids) + max_new_tokens)
    recorder = RecorderGroup(rows, *recorders) if recorders else rows
    chosen = StepCandidates(candidates)  # not in the capture: it reads the model's logits, not attention calls
    with (torch.inference_mode(), capture(loaded.sites, recorder=recorder),
          torch.random.fork_rng(devices=[]), _quiet_transformers(), ExitStack() as recording):
        for extra in (*recorders, chosen):
            recording.enter_context(extra.recording(loaded))
        torch.manual_seed(seed)
        bar = tqdm(total=max_new_tokens, desc="generating", unit="token", disable=not progress, leave=False)
        output = _run_generate(loaded, ids, settings, _Progress(bar),
                               None if budget is None else budgeted_cache(loaded, budget))
        sequence = output.sequences[0]
        finishing = _finishing_bar(recorders, progress)
        _complete_last_row(loaded, sequence, output)  # the recorders finish the last step's pass in it
        finishing.update(1)
    if rows.first is None:
        raise AttnscopeError(f"model {loaded.name!r} ran without calling attnscope's attention function")
    with torch.inference_mode(), finishing:
        additions = []
        for extra in recorders:
            finishing.set_postfix_str(extra.label)
            additions.append(extra.finish(loaded, sequence.tolist(), len(ids)))
            finishing.update(1)
        additions.append(chosen.finish(loaded, sequence.tolist(), len(ids)))  # small: not a part of the bar
    return _record(loaded, prompt, len(ids), sequence.tolist(), rows, settings, changes, additions)


@dataclass(frozen=True)
class RecordAdditions:
    """What a :class:`GenerationRecorder` adds to the record: ``arrays`` (names the record's checks know, see
    :class:`~attnscope.records.GenerationRecord`) and ``lens_tokens[step][layer][k]`` (the logit lens's tokens)."""

    arrays: dict[str, np.ndarray]
    lens_tokens: tuple[tuple[tuple[str, ...], ...], ...] = ()


class GenerationRecorder(Recorder):
    """A recorder that :func:`generate` runs beside the record's own rows (:class:`StepRows`) over the same forward
    passes, and that adds arrays to the record (:class:`attnscope.attribution.StepAttribution`: each step's direct
    logit attribution and logit lens).

    The passes: the prompt's (its last position chose the first generated token), one per generated token but the
    last (its last position chose the next token), then one of the last token alone (its own row). Besides the
    :class:`~attnscope.capture.recorders.Recorder` protocol (it sees every call it wants of those passes), it has
    :meth:`recording` and :meth:`finish`.
    """

    @contextmanager
    def recording(self, loaded: LoadedModel) -> Iterator[None]:
        """Active around the passes of one generation: starts afresh (a recorder may serve several generations,
        one after the other) and holds whatever else it needs (forward hooks on the sublayers)."""
        yield

    option = ""  # how to leave it out, said when a generation would not fit ("leave out --routes")
    label = "recorder"  # what it adds, in a word, for the progress bar ("routes")

    def finish(self, loaded: LoadedModel, sequence: list[int], n_prompt: int) -> RecordAdditions:
        """What it adds to the record of ``sequence`` (prompt, then generated ids; ``n_prompt`` prompt tokens)."""
        raise NotImplementedError

    def memory(self, shape: GenerationShape) -> MemoryEstimate:
        """Bytes it keeps and needs at its peak over a generation of ``shape`` (an upper bound, float32)."""
        return MemoryEstimate(kept=0, working=0)


class StepCandidates(GenerationRecorder):
    """Each step's top ``k`` next tokens and the chosen token's probability (softmax of the raw logits, before any
    sampling setting), taken from the model's output as each pass ends; not a capture's recorder (it reads no
    attention call) but counted and run like one. Only ``[step, k]`` is kept: ``generate``'s own logits of every step
    (``output_logits``) were kept to the end, ``[step, vocab]`` float32 (1,024 steps of SmolLM2: 192 MiB; 2,048 steps
    of a Qwen vocabulary: 1.2 GiB). A pass's probabilities wait for the next pass, whose input is the token chosen
    (the last token's is fed by ``_complete_last_row``)."""

    def __init__(self, k: int = DEFAULT_CANDIDATES) -> None:
        self.k = k
        self._start()

    def _start(self) -> None:
        self.top_ids: list[torch.Tensor] = []  # per pass: [k]
        self.top_probs: list[torch.Tensor] = []
        self.chosen_probs: list[torch.Tensor] = []  # per pass followed by another: the chosen token's probability
        self.waiting: torch.Tensor | None = None  # the last pass's probabilities [vocab], until its token is fed

    def wants(self, site: AttentionSite) -> bool:
        return False

    def memory(self, shape: GenerationShape) -> MemoryEstimate:
        """Kept: ids (int64) and probabilities of ``k`` candidates and the chosen one per step. Working: one pass's
        logits, probabilities and the waiting probabilities, ``[vocab]`` float32 each."""
        return MemoryEstimate(kept=shape.max_new_tokens * (self.k * 12 + 4), working=shape.vocab * 4 * 3)

    @contextmanager
    def recording(self, loaded: LoadedModel) -> Iterator[None]:
        self._start()

        def fed(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = args[0] if args else kwargs["input"]  # [1, new]: after the prompt's pass, the token it chose
            if self.waiting is not None:
                self.chosen_probs.append(self.waiting[int(ids[0, 0])].clone())
                self.waiting = None

        def ended(module: Any, inputs: Any, output: Any) -> None:
            logits = output.logits if hasattr(output, "logits") else output[0]  # [1, q_pos, vocab]
            probs = torch.softmax(logits[0, -1].float(), dim=-1)  # the pass's last position chose the next token
            top = probs.topk(min(self.k, probs.shape[-1]))
            self.top_ids.append(top.indices)
            self.top_probs.append(top.values)
            self.waiting = probs

        with ExitStack() as stack:
            stack.enter_context(local_hooks([loaded.model.get_input_embeddings()], fed, pre=True))
            stack.enter_context(local_hooks([loaded.model], ended))
            yield

    def finish(self, loaded: LoadedModel, sequence: list[int], n_prompt: int) -> RecordAdditions:
        """``candidate_ids`` int64 / ``candidate_probs`` float32 ``[step, k]`` and ``chosen_probs`` float32 ``[step]``."""
        n_steps = len(sequence) - n_prompt
        if len(self.chosen_probs) < n_steps:
            raise AttnscopeError(f"the candidates saw {len(self.chosen_probs)} of {n_steps} steps' chosen tokens")
        arrays: dict[str, np.ndarray]  # declared: arrays of several dtypes would join to object
        arrays = {"candidate_ids": torch.stack(self.top_ids[:n_steps]).cpu().numpy().astype(np.int64),
                  "candidate_probs": torch.stack(self.top_probs[:n_steps]).cpu().numpy().astype(np.float32),
                  "chosen_probs": torch.stack(self.chosen_probs[:n_steps]).cpu().numpy().astype(np.float32)}
        self._start()
        return RecordAdditions(arrays)


def _finishing_bar(recorders: Sequence[GenerationRecorder], progress: bool) -> Any:
    """A bar over what runs after the last token: the last token's own pass (in which the recorders finish the last
    step) and each recorder's ``finish`` (e.g. the attribution's logit lens), so that no wait is silent."""
    return tqdm(total=1 + len(recorders), desc="finishing", unit="part", disable=not progress or not recorders,
                leave=False)


def check_budget_recorders(recorders: Sequence[GenerationRecorder]) -> None:
    """Refuse recorders that cannot run under a KV budget: a route walk (``--routes``) reads one band of keys per
    query, where a streaming head's sink + window leaves a gap."""
    if any(getattr(extra, "wants_inputs", False) for extra in recorders):
        raise AttnscopeError("routes need each query to see one unbroken band of keys, and a streaming head's sink + "
                             "window leaves a gap: leave out the routes or the KV budget")


def generation_budget(loaded: LoadedModel, kv_budget: KVBudget | float, kv_scores: Any, score: str, sink: int,
                      window: int, n_tokens: int) -> KVBudget:
    """The :class:`KVBudget` a generation of ``n_tokens`` tokens runs under; refuses, before the model runs, a budget
    outside 0-1 or below sink + window, scores of another model, and a streaming window that covers the whole text
    (nothing would ever be evicted)."""
    budget = budget_from(loaded, kv_budget, kv_scores, score=score, tokens=n_tokens, sink=sink, window=window)
    check_evicts(budget.sink, budget.window, n_tokens)
    return budget


def _run_generate(loaded: LoadedModel, ids: list[int], settings: Mapping[str, Any], streamer: _Progress,
                  cache: Any = None) -> Any:
    """transformers' ``generate`` on one prompt (with ``cache``, a budgeted one, where given), returning the raw
    logits of every step and the cache."""
    given = {} if cache is None else {cache_keyword(loaded.model.forward): cache}
    growing = growing_caches(loaded.model) if cache is None else nullcontext()
    tokenizer = loaded.tokenizer
    input_ids = torch.tensor([ids], device=loaded.input_device)
    sampling = ({key: settings[key] for key in ("temperature", "top_k", "top_p") if settings.get(key) is not None}
                if settings["do_sample"] else {"temperature": None, "top_k": None, "top_p": None})
    with growing:
        return loaded.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=settings["max_new_tokens"],
            do_sample=settings["do_sample"], **sampling, use_cache=True, return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id, streamer=streamer, **given)


def cache_keyword(forward: Callable[..., Any]) -> str:
    """The keyword a model (its ``forward``) and ``generate`` take a cache by: ``cache`` from transformers 5.24
    (``past_key_values`` deprecated), ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _complete_last_row(loaded: LoadedModel, sequence: torch.Tensor, output: Any) -> None:
    """One more cached forward pass: the last token's own row (generate never feeds it back)."""
    keyword, cache = returned_cache(output)
    loaded.model(input_ids=sequence[None, -1:], use_cache=True, logits_to_keep=1, **{keyword: cache})


def returned_cache(output: Any) -> tuple[str, Any]:
    """The cache ``generate()`` returned, and the keyword a forward pass takes it by: ``cache`` in
    transformers 5.24, ``past_key_values`` in earlier 5.x releases (5.17 seen on a GPU machine), which
    pyproject admits too."""
    if hasattr(output, "cache"):
        return "cache", output.cache
    return "past_key_values", output.past_key_values


def _record(loaded: LoadedModel, prompt: str, n_prompt: int, sequence: list[int], rows: StepRows,
            settings: Mapping[str, Any], changes: str, additions: Sequence[RecordAdditions]) -> GenerationRecord:
    assert rows.first is not None
    tokenizer = loaded.tokenizer
    tokens = readable_tokens(tokenizer, sequence)
    special_ids = set(tokenizer.all_special_ids)
    special = [token_id in special_ids for token_id in sequence]
    arrays: dict[str, np.ndarray] = {
        "rows": rows.packed(len(sequence)),
        "token_ids": np.array(sequence, dtype=np.int64),
        "special_mask": np.array(special, dtype=bool),
        "word_ids": np.array(guess_word_ids(tokens, special), dtype=np.int64),
    }
    for name, values in (("value_norms", rows.value_norms()), ("sink_mass", rows.sink_mass())):
        if values is not None:
            arrays[name] = values
    for added in additions:
        arrays.update(added.arrays)
    candidate_tokens = tuple(readable_tokens(tokenizer, step.tolist()) for step in arrays["candidate_ids"])
    return GenerationRecord(model=model_info_from(loaded, rows.first), tokens=tokens, prompt_length=n_prompt,
                            arrays=arrays, candidate_tokens=candidate_tokens, prompt=prompt, settings=dict(settings),
                            changes=changes, first_row=rows.first_row,
                            lens_tokens=next((a.lens_tokens for a in additions if a.lens_tokens), ()))
