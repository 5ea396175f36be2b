"""Needle-in-a-haystack trials and the retrieval score of every head (Wu et al. 2024).

A trial hides a shipped needle (:func:`attnscope.data.needles`: pass keys, invented sentences) in a shipped document
(:func:`attnscope.data.document`: State of the Union addresses, *Moby-Dick* chapters) cut to a length in the model's
tokens, at a depth 0..1 and a sentence boundary, asks its question after the haystack, and lets the model answer
greedily through :func:`attnscope.generate` (decode-step rows only: ``prompt_rows=False``). Each head's most-attended
key at each step gives the retrieval score (:mod:`attnscope.analysis.retrieval` states the rule).

The needle tokens scored are those the answer must copy: the needle from its ``answer`` to its end ("8528848." of
"The secret pass key is 8528848."). Wu et al.'s model repeats the whole needle sentence; here the plain prompt ends
with the sentence's start (``answer_prefix``), which the model therefore never generates, so scoring the whole needle
would cap every head below 1 by the prefix's share. The chat form scores the same span, for comparable scores.

Which trials count: those the model answered, i.e. whose decoded answer contains the needle's ``answer``
(case-insensitive; for a pass key, its seven digits in a row). Wu et al. count trials whose ROUGE against the needle
exceeds 50; a containment test is the same idea for short answers and needs no extra package.

Prompt forms: ``"plain"`` (an instruction, the text, the question and the start of the answer, which a base model
continues) or ``"chat"`` (the text and the question as one user turn in the model's chat template).
:data:`PROMPT_FORMS` holds the form each built-in model answers with; others default to plain.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..analysis.retrieval import RETRIEVAL_THRESHOLD, mean_retrieval_score, retrieval_score, step_top_keys
from ..capture.extract import as_loaded
from ..capture.generate import check_generation, generate, prompt_ids
from ..capture.kv_budget import KVBudget
from ..data import Needle, document, needle
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from ..progress import say_slow_step
from ..records.attention import ModelInfo

PROMPT_FORMS = {"smollm2": "chat"}  # SmolLM2-135M-Instruct restates a plain prompt's question instead of answering
FORMS = ("plain", "chat")
DEFAULT_NEEDLES = ("passkey-1", "sentence-1")
DEFAULT_DOCUMENT = "sotu-1946-harry-s-truman"
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
MAX_NEW_TOKENS = 24  # a sentence needle's answer and a few tokens more
PLAIN_TEMPLATE = ("Read the text and remember what it says.\n\n{context}\n\n"
                  "Answer the question from the text above. {question}\n{answer_prefix}")
CHAT_TEMPLATE = "{context}\n\nAnswer the question from the text above. {question}"
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")  # the whitespace after a sentence; the next one starts at its end


@dataclass(frozen=True)
class NeedlePrompt:
    """One trial's prompt: ``text`` as :func:`attnscope.generate` takes it (``chat``: wrapped in the chat template),
    ``ids`` the tokens it runs (0-indexed positions), ``needle_span`` the needle's tokens ``[start, end)`` in ``ids``,
    ``answer_span`` those of the part the answer copies (from the needle's answer to its end: the span scored).
    ``context_tokens``: the haystack with the needle, in the model's tokens (at most ``length``); ``placed_depth``: where
    the needle starts in it, 0 (first) to 1 (last), at a sentence boundary near ``depth``."""

    needle: Needle
    document: str
    length: int
    depth: float
    form: str
    text: str
    ids: tuple[int, ...]
    needle_span: tuple[int, int]
    answer_span: tuple[int, int]
    context_tokens: int
    placed_depth: float

    @property
    def chat(self) -> bool:
        return self.form == "chat"


def prompt_form(loaded: LoadedModel, form: str | None) -> str:
    """``form`` checked, or (None) the form :data:`PROMPT_FORMS` holds for the model (plain for others)."""
    chosen = form or PROMPT_FORMS.get(loaded.name, "plain")
    if chosen not in FORMS:
        raise AttnscopeError(f"unknown prompt form {chosen!r}; choose one of: {', '.join(FORMS)}")
    return chosen


def needle_prompt(model: LoadedModel | str, needle_item: Needle | str, *, length: int, depth: float,
                  document_name: str = DEFAULT_DOCUMENT, form: str | None = None) -> NeedlePrompt:
    """The prompt of one trial: ``document_name`` cut to ``length`` tokens with the needle in them (the context), the
    needle at the sentence boundary nearest ``depth`` (0: before the first sentence, 1: after the last whole one), then the
    question (see the module's prompt forms). Refuses a depth outside 0..1, a needle as long as the haystack, a
    document too short, a length past the model's window."""
    loaded = as_loaded(model)
    item = needle(needle_item) if isinstance(needle_item, str) else needle_item
    check_decoder(loaded)
    check_trial_shape(loaded, length, depth)
    chosen = prompt_form(loaded, form)
    context, needle_start, context_tokens, placed = hide_needle(loaded.tokenizer, document(document_name), item.text,
                                                               length, depth)
    template = CHAT_TEMPLATE if chosen == "chat" else PLAIN_TEMPLATE
    text = template.format(context=context, question=item.question, answer_prefix=item.answer_prefix)
    ids = prompt_ids(loaded, text, chat=chosen == "chat")
    needle_chars = text.index(context) + needle_start
    needle_end = needle_chars + len(item.text)
    span, answer = token_spans(loaded, text, chosen == "chat", ids,
                               [(needle_chars, needle_end), (needle_chars + item.text.index(item.answer), needle_end)])
    return NeedlePrompt(item, document_name, length, depth, chosen, text, tuple(ids), span, answer, context_tokens,
                        placed)


def check_decoder(loaded: LoadedModel) -> None:
    if loaded.is_encoder_decoder or not loaded.causal:
        raise AttnscopeError(f"model {loaded.name!r} is not a decoder-only language model; needle trials generate "
                             "an answer and need one")


def check_trial_shape(loaded: LoadedModel, length: int, depth: float) -> None:
    """A depth within 0..1 and a haystack length that the model's window holds."""
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise AttnscopeError(f"a needle's depth must be between 0 and 1 (0: the haystack's start), got {depth!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise AttnscopeError(f"a haystack's length must be a positive number of tokens, got {length!r}")
    if length > loaded.max_length:
        raise AttnscopeError(f"a haystack of {length} tokens is more than {loaded.name}'s limit of "
                             f"{loaded.max_length} tokens")


def hide_needle(tokenizer: Any, text: str, needle_text: str, length: int, depth: float) -> tuple[str, int, int, float]:
    """``text`` cut so that it holds at most ``length`` tokens once ``needle_text`` is inserted at the sentence boundary
    nearest ``depth``: returns the context, the needle's first character in it, the context's tokens and the depth
    where the needle landed (its first token over the haystack's tokens)."""
    count = token_counter(tokenizer)
    n_needle = count(" " + needle_text)
    if n_needle >= length:
        raise AttnscopeError(f"the needle is {n_needle} tokens, as long as the haystack of {length} tokens or longer; "
                             "ask for a longer haystack")
    budget = length - n_needle
    offsets = first_token_offsets(tokenizer, text, budget)
    while budget > 0:
        if budget > len(offsets):
            raise AttnscopeError(f"the document has {len(offsets)} tokens, fewer than the {budget} a haystack of "
                                 f"{length} tokens needs; choose a longer document")
        haystack = text[: offsets[budget - 1][1]]
        boundary, placed = sentence_boundary(haystack, depth, [end for _, end in offsets[:budget]])
        context, needle_start = insert_at(haystack, boundary, needle_text)
        n_context = count(context)
        if n_context <= length:
            return context, needle_start, n_context, placed
        budget -= n_context - length  # joining changed a few tokens: cut the haystack by as many more
    raise AttnscopeError(f"no haystack of {length} tokens holds the needle")


CHARS_PER_TOKEN = 16  # more than any English text's average: a prefix this long holds the tokens asked for


def first_token_offsets(tokenizer: Any, text: str, n_tokens: int) -> list[tuple[int, int]]:
    """The character offsets of ``text``'s tokens, at least its first ``n_tokens`` + 1 where it has them: a prefix is
    tokenised first (a whole address is 40,000 tokens, and a trial needs 1,000), the whole text where that falls
    short. The token after the last one used is kept so that a word cut by the prefix is never used."""
    prefix = text[: (n_tokens + 2) * CHARS_PER_TOKEN]
    offsets = tokenizer(prefix, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) > n_tokens + 1 or len(prefix) == len(text):
        return list(offsets)
    return list(tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def sentence_boundary(haystack: str, depth: float, token_ends: Sequence[int]) -> tuple[int, float]:
    """The character where a sentence of ``haystack`` starts nearest ``depth`` of its tokens (``token_ends``: each
    token's last character + 1), and that boundary's depth in tokens. The haystack's end is a boundary only where a
    sentence ends there: a haystack cut mid-sentence keeps its last piece after the needle, so depth 1 is that
    piece's start."""
    ends_a_sentence = SENTENCE_END.search(haystack + " ", len(haystack) - 2 if haystack else 0) is not None
    starts = [0, *(match.end() for match in SENTENCE_END.finditer(haystack)), *([len(haystack)] * ends_a_sentence)]
    n_tokens = len(token_ends)
    token_of = [bisect_right(token_ends, start) for start in starts]  # tokens wholly before each boundary
    best = min(range(len(starts)), key=lambda index: abs(token_of[index] - depth * n_tokens))
    return starts[best], token_of[best] / max(1, n_tokens)


def insert_at(haystack: str, boundary: int, needle_text: str) -> tuple[str, int]:
    """``needle_text`` put at character ``boundary`` (a sentence's start, or the end) with one space to its
    neighbours: the context and the needle's first character."""
    before, after = haystack[:boundary].rstrip(), haystack[boundary:].lstrip()
    head = f"{before} " if before else ""
    return head + needle_text + (f" {after}" if after else ""), len(head)


def token_spans(loaded: LoadedModel, text: str, chat: bool, ids: Sequence[int],
                chars: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """For each character range of ``text`` in ``chars``, the tokens of ``ids`` (the prompt as generate runs it) that
    overlap it: ``[start, end)``. The chat form's characters are those of the template's text, whose tokens must be
    ``ids``."""
    tokenizer = loaded.tokenizer
    full, shift, special = text, 0, True
    if chat:
        full = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        shift, special = full.index(text), False  # the template's own special tokens are in its text
    encoded = tokenizer(full, add_special_tokens=special, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != list(ids):
        raise AttnscopeError(f"{loaded.name}'s tokenizer gives the prompt other tokens with character offsets than "
                             "without; the needle cannot be located")
    spans = []
    for first, last in chars:
        inside = [index for index, (start, end) in enumerate(encoded["offset_mapping"])
                  if end > first + shift and start < last + shift]
        spans.append((inside[0], inside[-1] + 1))
    return spans


@dataclass(frozen=True)
class NeedleTrial:
    """One trial's outcome: its prompt, the decoded ``answer``, whether it ``counted`` (the answer holds the needle's
    answer), seconds it took, each head's retrieval score ``[layer, head]`` for this trial, each step's most-attended
    key ``top_keys`` ``[step, layer, head]`` (what the score was computed from) and the whole sequence's
    ``token_ids`` (prompt, then the answer); ``model_info``: the model's facts, as the generation recorded them."""

    prompt: NeedlePrompt
    answer: str
    counted: bool
    seconds: float
    scores: np.ndarray = field(repr=False)
    top_keys: np.ndarray = field(repr=False)
    token_ids: np.ndarray = field(repr=False)
    model_info: ModelInfo = field(repr=False)

    def summary(self) -> dict[str, Any]:
        """One row of the trials table (the scores left out)."""
        prompt = self.prompt
        return {"needle": prompt.needle.id, "document": prompt.document, "length": prompt.length,
                "context_tokens": prompt.context_tokens, "prompt_tokens": len(prompt.ids), "depth": prompt.depth,
                "placed_depth": round(prompt.placed_depth, 3), "form": prompt.form, "answer": self.answer,
                "counted": self.counted, "seconds": round(self.seconds, 2)}


@dataclass(frozen=True)
class NeedleTrials:
    """The trials of one model and every head's retrieval score over those that counted (``scores``:
    ``[layer, head]``, 0-indexed query heads; NaN where no trial counted)."""

    model: str
    trials: tuple[NeedleTrial, ...]
    scores: np.ndarray = field(repr=False)

    @property
    def info(self) -> ModelInfo:
        """The model's facts (heads, KV heads, windows, sinks), from the first trial's generation."""
        return self.trials[0].model_info

    @property
    def n_counted(self) -> int:
        return sum(trial.counted for trial in self.trials)

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the highest score: ``(layer, head, score)``, best first."""
        order = np.argsort(-np.nan_to_num(self.scores, nan=-1.0), axis=None, kind="stable")[:k]
        return [(int(layer), int(head), float(self.scores[layer, head]))
                for layer, head in zip(*np.unravel_index(order, self.scores.shape))]

    def share_above(self, threshold: float = RETRIEVAL_THRESHOLD) -> float:
        """The share of heads whose score exceeds ``threshold`` (Wu et al.: 0.1)."""
        return float(np.mean(self.scores > threshold))

    def to_frame(self) -> Any:
        """One row per head: ``layer``, ``head`` (0-indexed), ``retrieval``."""
        import pandas as pd

        layers, heads = np.indices(self.scores.shape)
        return pd.DataFrame({"layer": layers.ravel(), "head": heads.ravel(), "retrieval": self.scores.ravel()})

    def trials_frame(self) -> Any:
        """One row per trial (:meth:`NeedleTrial.summary`)."""
        import pandas as pd

        return pd.DataFrame([trial.summary() for trial in self.trials])


def answered(item: Needle, answer: str) -> bool:
    """The counting rule: the answer holds the needle's answer, case and surrounding spaces aside."""
    return " ".join(item.answer.lower().split()) in " ".join(answer.lower().split())


def run_trial(loaded: LoadedModel, prompt: NeedlePrompt, *, max_new_tokens: int = MAX_NEW_TOKENS,
              kv_budget: KVBudget | None = None) -> NeedleTrial:
    """Generate the answer greedily, keeping decode-step rows only, and score every head on it; ``kv_budget``:
    generate with a :class:`~attnscope.capture.kv_budget.BudgetedCache` under it."""
    started = time.perf_counter()
    gen = generate(loaded, prompt.text, chat=prompt.chat, max_new_tokens=max_new_tokens, norms=False,
                   prompt_rows=False, candidates=1, kv_budget=kv_budget)
    if list(gen.token_ids[: gen.prompt_length]) != list(prompt.ids):
        raise AttnscopeError("the generation ran other prompt tokens than the trial located its needle in")
    top_keys = step_top_keys(gen)
    scores = retrieval_score(top_keys, gen.token_ids, gen.prompt_length, prompt.answer_span)
    answer = loaded.tokenizer.decode(gen.token_ids[gen.prompt_length:].tolist(), skip_special_tokens=True)
    return NeedleTrial(prompt, answer, answered(prompt.needle, answer), time.perf_counter() - started, scores,
                       top_keys, gen.token_ids, gen.model)


def trial_prompts(loaded: LoadedModel, *, lengths: Sequence[int] = (1024,),
                  depths: Sequence[float] = DEFAULT_DEPTHS, needles: Sequence[str] = DEFAULT_NEEDLES,
                  document_name: str = DEFAULT_DOCUMENT, form: str | None = None,
                  max_new_tokens: int = MAX_NEW_TOKENS) -> list[NeedlePrompt]:
    """Every (length, depth, needle) trial's prompt, each premise checked (a decoder, the grid's bounds, the window,
    and the memory of the longest generation, with its estimate): tokenisation only, the model does not run."""
    check_decoder(loaded)
    if not lengths or not depths or not needles:
        raise AttnscopeError("needle trials need at least one length, one depth and one needle")
    for length in lengths:
        for depth in depths:
            check_trial_shape(loaded, length, depth)
    prompts = [needle_prompt(loaded, item, length=length, depth=depth, document_name=document_name, form=form)
               for length in lengths for depth in depths for item in needles]
    longest = max(len(prompt.ids) for prompt in prompts)
    check_generation(loaded, longest, max_new_tokens, first_row=longest - 1)
    return prompts


def run_trials(loaded: LoadedModel, prompts: Sequence[NeedlePrompt], *, max_new_tokens: int = MAX_NEW_TOKENS,
               progress: bool = False) -> list[NeedleTrial]:
    """:func:`run_trial` on each of ``prompts``, in order (saying which with ``progress``)."""
    trials = []
    for index, prompt in enumerate(prompts):
        if progress:
            say_slow_step(f"needle trial {index + 1} of {len(prompts)} ({prompt.needle.id}, {prompt.length} tokens, "
                          f"depth {prompt.depth})")
        trials.append(run_trial(loaded, prompt, max_new_tokens=max_new_tokens))
    return trials


class TrialEngine(Protocol):
    """Where needle trials run: :func:`run_trials` on each prompt, the trials returned in the prompts' order.
    :class:`attnscope.corpus.Engine` is one (``Engine("ray", num_actors=2)``: an actor pool, each actor holding the
    model); None, wherever an engine is taken: here, one trial after the other."""

    def run_trials(self, loaded: LoadedModel, prompts: Sequence[NeedlePrompt], *, max_new_tokens: int,
                   progress: bool) -> list[NeedleTrial]: ...


def needle_trials(model: LoadedModel | str, *, lengths: Sequence[int] = (1024,),
                  depths: Sequence[float] = DEFAULT_DEPTHS, needles: Sequence[str] = DEFAULT_NEEDLES,
                  document_name: str = DEFAULT_DOCUMENT, form: str | None = None,
                  max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False,
                  engine: TrialEngine | None = None) -> NeedleTrials:
    """Every (length, depth, needle) trial on ``model`` and each head's retrieval score over the trials it answered.

    Every prompt is built and checked first (:func:`trial_prompts`), so a bad grid is refused before the model runs.
    ``engine``: where the trials run (:class:`TrialEngine`; None: here, in order); the trials and scores are the same.

    >>> trials = needle_trials("qwen0.5b", lengths=[1024])       # doctest: +SKIP
    >>> trials.top(10), trials.share_above(0.1)                  # doctest: +SKIP
    >>> from attnscope.corpus import Engine                      # doctest: +SKIP
    >>> trials = needle_trials("qwen0.5b", engine=Engine("ray", num_actors=2))  # doctest: +SKIP
    """
    loaded = as_loaded(model)
    prompts = trial_prompts(loaded, lengths=lengths, depths=depths, needles=needles, document_name=document_name,
                            form=form, max_new_tokens=max_new_tokens)
    if engine is None:
        trials = run_trials(loaded, prompts, max_new_tokens=max_new_tokens, progress=progress)
    else:
        trials = engine.run_trials(loaded, prompts, max_new_tokens=max_new_tokens, progress=progress)
    scores = mean_retrieval_score([trial.scores for trial in trials], [trial.counted for trial in trials])
    return NeedleTrials(loaded.name, tuple(trials), scores)


# ---- the masking check of the retrieval score (Wu et al.: masking retrieval heads breaks the needle's retrieval) --
