"""What a decoder attended to while it generated: :class:`GenerationRecord`.

A record holds, for every position of the final text (prompt, then generated tokens) from
``first_row`` on, that position's attention row over all earlier positions, for every layer and
head, and for every generated token the model's top candidates. Rows are stored packed: row ``q``
has ``q + 1`` keys and starts at offset ``q * (q + 1) / 2 - first_row * (first_row + 1) / 2`` of the
last axis, so the record grows with the rows kept, never with a padded ``[T, T]`` per step.

A long prompt's rows are usually not kept (``first_row = prompt_length - 1``): they grow with the
prompt squared (8,192 tokens of SmolLM2 would be 34 GiB of float32), while every step's row, the one that
chose each generated token, grows only with the text.

Step ``s`` (0-indexed) chose generated token ``s``, at position ``prompt_length + s``; the
attention that made that choice is the row of the position before it (:meth:`step_attention`).

Layers and heads are 0-indexed. With a sliding-window layer, keys outside the window hold 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .attention import AttentionRecord, ModelInfo
from .attribution import ATTRIBUTION_HEADS
from .checks import GENERATION_FORMAT, check_generation_parts
from .format import read_attnscope_file, write_attnscope_file

TO_RECORD_LIMIT = 2048  # tokens: beyond this a [layer, head, T, T] matrix is rarely what a user wants
NO_PROMPT_ROWS_ADVICE = ("generate(..., prompt_rows=True) or attnscope generate --prompt-rows all keeps them, "
                         "or capture the prompt alone with attnscope.extract / attnscope view")


@dataclass(frozen=True)
class Candidate:
    """One of the model's top next tokens at a step: ``probability`` under its own distribution
    (softmax of the raw logits, before temperature or other sampling settings); ``logit``, the raw
    logit, where the decoding kept it (the step debugger does; a generation record keeps
    probabilities only)."""

    token: str
    token_id: int
    probability: float
    logit: float | None = None


def row_offset(position: int) -> int:
    """Where row ``position`` starts on the packed axis (rows 0..position-1 hold 1..position keys)."""
    return position * (position + 1) // 2


def packed_length(n_positions: int) -> int:
    """Length of the packed axis holding rows 0..n_positions-1."""
    return row_offset(n_positions)


@dataclass(frozen=True, eq=False)
class GenerationRecord:
    """Prompt and generated tokens with every position's attention row and every step's candidates.

    ``arrays``:

    * ``rows`` float32 ``[layer, head, packed]``: row ``q`` (``q >= first_row``) at
      ``[row_offset(q) - row_offset(first_row), row_offset(q + 1) - row_offset(first_row))``;
    * ``value_norms`` float32 ``[layer, head, position]`` (optional): ``||v_j W_O^h||`` of each key
      (Kobayashi et al. 2020), so a norm-weighted row is ``row * value_norms[..., :q + 1]``;
    * ``sink_mass`` float32 ``[layer, head, row]`` (models with learned sinks, gpt-oss): the share of
      each kept row's softmax (positions ``first_row..``) that went to the sink logit; the row sums to 1 minus it;
    * ``token_ids`` int64, ``special_mask`` bool and ``word_ids`` int64 ``[position]`` (as in a record);
    * ``candidate_ids`` int64 and ``candidate_probs`` float32 ``[step, k]``, best first;
    * ``chosen_probs`` float32 ``[step]``: the probability the model gave the token that was chosen;
    * ``attribution_heads`` float32 ``[step, layer, head]`` and ``attribution_logits`` float32 ``[step]``
      (optional: ``generate(..., recorders=[StepAttribution()])``, ``--attribute``; names in
      :mod:`attnscope.records.attribution`): each head's signed direct-logit-attribution term of
      the chosen token's logit, and that logit (the sum of every term: heads, MLPs, embeddings, biases);
      with them ``attribution_top`` int64 ``[step, rank, 2]`` (layer, head) of each step's heads with the
      largest ``|term|``, largest first, and ``attribution_sources`` float32 ``[step, rank, source_pos]``
      their terms split over the source tokens they read (0 past the step's position), and with
      ``StepAttribution(lens=True)`` (``--lens``) the logit lens at each step: ``lens_ids`` int64 /
      ``lens_probs`` float32 ``[step, layer, k]`` (the text of the tokens in ``lens_tokens[step][layer][k]``);
    * ``route_edges`` int64 ``[edge, 8]``, ``route_importance`` float32 ``[edge]`` and ``route_heads`` float32
      ``[edge, head]`` (optional: ``generate(..., recorders=[StepRoutes()])``, ``--routes``): every step's pruned
      information-flow graph, one row per kept edge (step, source layer, position and kind, target layer,
      position and kind, via; the codes in :mod:`attnscope.records.attribution`), its importance and, for an
      attention edge, its per-head split (``attnscope.attribution.step_routes`` reads one step's back).

    ``candidate_tokens`` are the candidates as readable strings ``[step][k]``; ``settings`` the
    decoding settings (greedy or sampling, temperature, ...); ``changes`` names the interventions
    active during generation ("" if none). ``first_row``: the first position whose row is kept
    (at most ``prompt_length - 1``, the row that chose the first generated token); positions before
    it have none.
    """

    model: ModelInfo
    tokens: tuple[str, ...]
    prompt_length: int
    arrays: Mapping[str, np.ndarray]
    candidate_tokens: tuple[tuple[str, ...], ...]
    prompt: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    changes: str = ""
    first_row: int = 0
    lens_tokens: tuple[tuple[tuple[str, ...], ...], ...] = ()

    def __post_init__(self) -> None:
        arrays = {key: np.ascontiguousarray(value) for key, value in self.arrays.items()}
        for value in arrays.values():
            value.flags.writeable = False
        object.__setattr__(self, "arrays", MappingProxyType(arrays))
        n = len(self.tokens)
        if not 0 < self.prompt_length <= n:
            raise ValueError(f"prompt_length {self.prompt_length} must be within 1..{n}")
        if not 0 <= self.first_row < self.prompt_length:
            raise ValueError(f"first_row {self.first_row} must be within 0..{self.prompt_length - 1} "
                             "(the row that chose the first generated token is always kept)")
        rows, length = arrays.get("rows"), packed_length(n) - row_offset(self.first_row)
        if rows is None or rows.ndim != 3 or rows.shape[-1] != length:
            raise ValueError(f"rows must be [layer, head, {length}] for {n} tokens from row {self.first_row}")
        if arrays["candidate_ids"].shape[0] != self.n_steps or len(self.candidate_tokens) != self.n_steps:
            raise ValueError(f"candidates must have one entry per generated token ({self.n_steps})")

    # ---- what it holds --------------------------------------------------------------------
    def top_heads(self, step: int, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` heads that pushed step ``step``'s chosen token up or down most (direct logit
        attribution, signed): ``[(layer, head, term), ...]``, 0-indexed; needs a generation with
        :class:`~attnscope.attribution.StepAttribution`."""
        if ATTRIBUTION_HEADS not in self.arrays:
            raise ValueError("this record has no attribution: generate with recorders=[StepAttribution()] "
                             "(--attribute)")
        heads = self.arrays[ATTRIBUTION_HEADS][step]  # [layer, head]
        order = np.argsort(-np.abs(heads), axis=None)[:k]
        return [(int(layer), int(head), float(heads[layer, head]))
                for layer, head in zip(*np.unravel_index(order, heads.shape))]

    @property
    def n_steps(self) -> int:
        """How many tokens were generated."""
        return len(self.tokens) - self.prompt_length

    @property
    def n_layers(self) -> int:
        return int(self.arrays["rows"].shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.arrays["rows"].shape[1])

    @property
    def token_ids(self) -> np.ndarray:
        return self.arrays["token_ids"]

    @property
    def prompt_tokens(self) -> tuple[str, ...]:
        return self.tokens[: self.prompt_length]

    @property
    def generated_tokens(self) -> tuple[str, ...]:
        return self.tokens[self.prompt_length:]

    @property
    def generated_text(self) -> str:
        return "".join(self.generated_tokens)

    @property
    def has_norms(self) -> bool:
        return "value_norms" in self.arrays

    @property
    def has_prompt_rows(self) -> bool:
        """Whether every position's row is kept (``first_row == 0``), the prompt's included."""
        return self.first_row == 0

    def row_sink_mass(self, position: int) -> np.ndarray | None:
        """Learned sinks' share of ``position``'s row, ``[layer, head]`` (the row sums to 1 minus it);
        None for a model without learned sinks."""
        self.row(position)  # the same refusals
        sink_mass = self.arrays.get("sink_mass")
        return None if sink_mass is None else sink_mass[:, :, position - self.first_row]

    def step_sink_mass(self, step: int) -> np.ndarray | None:
        """Learned sinks' share of the row that chose generated token ``step``, ``[layer, head]``, or None."""
        self._check_step(step)
        return self.row_sink_mass(self.prompt_length + step - 1)

    def row(self, position: int, *, weighted: bool = False) -> np.ndarray:
        """Attention of the token at ``position`` over positions ``0..position``: ``[layer, head, position + 1]``.

        ``weighted``: the norm-weighted row ``alpha_ij * ||v_j W_O^h||`` (Kobayashi et al. 2020).
        Refused for a position before ``first_row`` (its row was not kept).
        """
        if not 0 <= position < len(self.tokens):
            raise AttnscopeError(f"position {position} is outside 0..{len(self.tokens) - 1}")
        if position < self.first_row:
            raise AttnscopeError(f"the rows of positions 0..{self.first_row - 1} (the prompt's) were not kept; "
                                 f"{NO_PROMPT_ROWS_ADVICE}")
        base = row_offset(self.first_row)
        row = self.arrays["rows"][:, :, row_offset(position) - base : row_offset(position + 1) - base]
        if not weighted:
            return row
        if not self.has_norms:
            raise AttnscopeError("this generation was recorded without value norms (generate(..., norms=True))")
        return row * self.arrays["value_norms"][:, :, : position + 1]

    def step_attention(self, step: int, *, weighted: bool = False) -> np.ndarray:
        """What the model attended to when it chose generated token ``step``: the row of the position
        before it, ``[layer, head, prompt_length + step]`` (keys: the prompt and the text so far)."""
        self._check_step(step)
        return self.row(self.prompt_length + step - 1, weighted=weighted)

    def candidates(self, step: int) -> tuple[Candidate, ...]:
        """The model's top next tokens at ``step``, best first."""
        self._check_step(step)
        ids, probs = self.arrays["candidate_ids"][step], self.arrays["candidate_probs"][step]
        return tuple(Candidate(token, int(i), float(p)) for token, i, p in zip(self.candidate_tokens[step], ids, probs))

    def chosen(self, step: int) -> Candidate:
        """The token chosen at ``step`` with the probability the model gave it."""
        self._check_step(step)
        position = self.prompt_length + step
        return Candidate(self.tokens[position], int(self.token_ids[position]), float(self.arrays["chosen_probs"][step]))

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.n_steps:
            raise AttnscopeError(f"step {step} is outside 0..{self.n_steps - 1} (0-indexed generated tokens)")

    def __repr__(self) -> str:
        changed = f", changes={self.changes!r}" if self.changes else ""
        rows = f", rows from position {self.first_row}" if self.first_row else ""
        return (f"GenerationRecord(model={self.model.name!r}, prompt={self.prompt_length} tokens, "
                f"generated={self.n_steps} tokens, layers={self.n_layers}, heads={self.n_heads}{rows}{changed})")

    # ---- conversion ---------------------------------------------------------------------
    def attention_matrix(self) -> np.ndarray:
        """The full lower-triangular attention ``[layer, head, q_pos, k_pos]`` of the final text
        (refused when the prompt's rows were not kept)."""
        self._require_prompt_rows()
        n = len(self.tokens)
        queries, keys = np.tril_indices(n)  # row-major: the packed order
        matrix = np.zeros((self.n_layers, self.n_heads, n, n), dtype=np.float32)
        matrix[:, :, queries, keys] = self.arrays["rows"]
        return matrix

    def to_attention_record(self, *, max_tokens: int = TO_RECORD_LIMIT) -> AttentionRecord:
        """The final text as an :class:`AttentionRecord` (every view, statistic and classifier works
        on it). Refuses beyond ``max_tokens`` (the matrix grows with tokens squared) and when the
        prompt's rows were not kept (``first_row > 0``)."""
        self._require_prompt_rows()
        n = len(self.tokens)
        if n > max_tokens:
            raise AttnscopeError(f"{n} tokens is more than max_tokens={max_tokens} for a full [layer, head, T, T] "
                                 "record; use rows/step_attention, or raise max_tokens")
        matrix = self.attention_matrix()
        arrays: dict[str, np.ndarray] = {
            "input.token_ids": np.asarray(self.token_ids, dtype=np.int64),
            "input.special_mask": np.asarray(self.arrays["special_mask"], dtype=bool),
            "input.sentence_ids": np.zeros(n, dtype=np.int64),
            "input.word_ids": np.asarray(self.arrays["word_ids"], dtype=np.int64),
            "self.attention": matrix,
        }
        if self.has_norms:
            arrays["self.norms"] = matrix * self.arrays["value_norms"][:, :, None, :]
        if "sink_mass" in self.arrays:  # every row is kept here (first_row 0)
            arrays["self.sink_mass"] = self.arrays["sink_mass"]
        return AttentionRecord(model=self.model, tokens=self.tokens, arrays=arrays,
                               text=(self.prompt + self.generated_text,))

    def _require_prompt_rows(self) -> None:
        if not self.has_prompt_rows:
            raise AttnscopeError(f"this generation kept no rows before position {self.first_row} (the prompt's), "
                                 f"so it has no full [layer, head, T, T] matrix; {NO_PROMPT_ROWS_ADVICE}")

    @property
    def method(self) -> str:
        """How the tokens were chosen, e.g. ``greedy`` or ``sampling (temperature 0.8, seed 1)``, and under which KV
        budget (its streamed heads named ``L<layer>H<kv head>``, 0-indexed)."""
        settings = self.settings
        chat = ", chat template" if settings.get("chat") else ""
        chat += kv_budget_phrase(settings.get("kv_budget"))
        if not settings.get("do_sample"):
            return f"greedy{chat}"
        named = [f"{name.replace('_', '-')} {settings[name]}" for name in ("temperature", "top_k", "top_p", "seed")
                 if settings.get(name) is not None]
        return f"sampling ({', '.join(named)}){chat}"

    # ---- save / load --------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """One ``.safetensors`` file: the arrays, with the tokens and settings as JSON in its header."""
        return write_attnscope_file(path, self.arrays, self._metadata())

    def _metadata(self) -> dict[str, Any]:
        return {"format": GENERATION_FORMAT, "model": self.model.to_json(), "tokens": list(self.tokens),
                "prompt_length": self.prompt_length, "candidate_tokens": [list(c) for c in self.candidate_tokens],
                "prompt": self.prompt, "settings": dict(self.settings), "changes": self.changes,
                "first_row": self.first_row, **({"lens_tokens": self.lens_tokens} if self.lens_tokens else {})}

    @classmethod
    def load(cls, path: str | Path) -> GenerationRecord:
        """Read a file written by :meth:`save` (one clear error line for anything else)."""
        header, arrays = read_attnscope_file(path, "generation record")
        meta = check_generation_parts(header, arrays, path)  # one AttnscopeError line naming the fault
        return cls(model=ModelInfo(**meta["model"]), tokens=tuple(meta["tokens"]), prompt_length=meta["prompt_length"],
                   arrays=arrays, candidate_tokens=tuple(tuple(c) for c in meta["candidate_tokens"]),
                   prompt=meta["prompt"], settings=meta["settings"], changes=meta["changes"],
                   first_row=meta.get("first_row", 0),  # files from before first_row kept every row
                   lens_tokens=tuple(tuple(tuple(layer) for layer in step) for step in meta.get("lens_tokens", ())))


NAMED_STREAMED_HEADS = 8  # more streamed heads than this are counted, not named, in a record's method


def kv_budget_phrase(budget: Mapping[str, Any] | None) -> str:
    """``", KV budget: 50% of KV heads full, the others sink 4 + window 64 (streamed: L0H1, L2H0)"`` (past
    :data:`NAMED_STREAMED_HEADS`, ``(67 KV heads streamed)``; windows per head: ``windows 60-61``) from a record's
    ``settings["kv_budget"]`` (:meth:`attnscope.capture.kv_budget.KVBudget.to_dict`), or "" without one."""
    if not budget:
        return ""
    heads = budget["streamed"]
    streamed = f"streamed: {', '.join(f'L{layer}H{head}' for layer, head in heads) or 'none'}" \
        if len(heads) <= NAMED_STREAMED_HEADS else f"{len(heads)} KV heads streamed"
    windows = sorted({window for *_, window in budget.get("recent", [])}) or [budget["window"]]
    window = f"window {windows[0]}" if len(windows) == 1 else f"windows {windows[0]}-{windows[-1]}"
    return (f", KV budget: {budget['share']:.0%} of KV heads full, the others sink {budget['sink']} + {window} "
            f"({streamed})")
