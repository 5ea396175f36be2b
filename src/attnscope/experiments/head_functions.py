"""Head-function scores that run a model: the tasks that feed the registered scores of
:mod:`attnscope.analysis.head_functions`, and :func:`head_scores`, which runs the tasks the asked-for scores
need and returns a :class:`~attnscope.analysis.head_functions.HeadScores` table.

Tasks (name -> builder, :func:`register_task` adds one, e.g. needle trials):

* ``repeated_tokens``: :func:`~attnscope.experiments.random_tokens.repeated_random_tokens`, captured whole (the
  sequences are short: ``[layer, head, T, T]`` each);
* ``document``: each long document (shipped names, :func:`attnscope.data.document`, or a text) captured with
  ``CapturePlan(attention=False, locality=...)``: only ``[layer, head, pair]`` is kept, and a layer's scores
  are computed ``chunk`` queries at a time, never the whole query x key matrix;
* ``sentences``: each document averaged to sentence x sentence by a planned capture
  (:func:`~attnscope.experiments.sentences.sentence_record`); receiver scores are the mean over
  documents of each head's kurtosis;
* ``needles``: needle-in-a-haystack trials (:func:`~attnscope.experiments.needles.needle_trials`: every
  needle x haystack length x depth in one document, answered greedily with decode-step rows only); the
  retrieval score is the mean over the trials the model answered (NaN for every head when none was).

Every premise (a causal decoder, lengths within the model's limit, known scores, documents and needles, a share
in ``(0, 1]``, depths in 0..1, the memory of the longest needle trial) is checked before the model runs.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..analysis.head_functions import (
    HeadScores,
    LocalityEvidence,
    RepeatedEvidence,
    RepeatedLayout,
    get_head_function,
)
from ..analysis.sentences import sentence_attention
from ..capture.extract import as_loaded, extract, extract_ids
from ..capture.plan import CapturePlan, QuerySelection
from ..capture.tokens import TruncationWarning
from ..data import document, documents, needle
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from ..progress import say_slow_step
from ..records.attention import ModelInfo
from .needles import (
    DEFAULT_DEPTHS,
    DEFAULT_DOCUMENT,
    DEFAULT_NEEDLES,
    FORMS,
    MAX_NEW_TOKENS,
    TrialEngine,
    needle_trials,
    trial_prompts,
)
from .random_tokens import repeated_random_tokens
from .sentences import sentence_record, text_sentences

DEFAULT_SCORES = ("induction", "previous_token", "duplicate_token", "echo", "locality")
DEFAULT_WINDOWS = (16, 32, 64, 128, 256, 512, 1024)
DOCUMENT_TOKENS = 2048  # documents are cut here unless asked otherwise (or at a shorter model limit)


@dataclass(frozen=True)
class HeadScoreSettings:
    """The tasks' settings. Repeated tokens: ``period`` random tokens repeated ``repeats`` times, ``sequences``
    draws from ``seed``. Documents (shipped names or texts), cut to ``max_tokens`` (None: :data:`DOCUMENT_TOKENS`
    or the model's limit, the smaller): locality for every pair of
    ``sinks`` x ``windows`` over every ``every``-th query, ``chunk`` queries at a time; ``share``: what the
    smallest window must keep. Needle trials (retrieval): every needle of ``needles`` (shipped ids) hidden in
    ``needle_document`` cut to each of ``needle_lengths`` tokens, at each of ``needle_depths``, answered in
    ``needle_form`` (None: the model's own) with at most ``needle_new_tokens`` tokens. Each field's ``help``
    metadata says the same in one line (for the command line)."""

    period: int = 64
    repeats: int = 2
    sequences: int = 4
    seed: int = 0
    documents: tuple[str, ...] = ("sotu-1912-william-h-taft",)
    max_tokens: int | None = None
    sinks: tuple[int, ...] = (4,)
    windows: tuple[int, ...] = DEFAULT_WINDOWS
    share: float = 0.9
    every: int = 1
    chunk: int = 256
    needles: tuple[str, ...] = field(default=DEFAULT_NEEDLES, metadata={
        "help": "shipped needle ids hidden in the haystack (retrieval; attnscope.data.needles lists them)"})
    needle_lengths: tuple[int, ...] = field(default=(1024,), metadata={
        "help": "haystack lengths in the model's tokens, needle included (retrieval)"})
    needle_depths: tuple[float, ...] = field(default=DEFAULT_DEPTHS, metadata={
        "help": "where the needle sits in the haystack, 0 (start) to 1 (end) (retrieval)"})
    needle_document: str = field(default=DEFAULT_DOCUMENT, metadata={
        "help": "the shipped document the haystacks are cut from (retrieval)"})
    needle_form: str | None = field(default=None, metadata={
        "help": "prompt form, plain or chat (default: the one the model answers; retrieval)"})
    needle_new_tokens: int = field(default=MAX_NEW_TOKENS, metadata={
        "help": "the most tokens a needle trial's answer may have (retrieval)"})

    def document_tokens(self, loaded: LoadedModel) -> int:
        """Where documents are cut for ``loaded``."""
        return self.max_tokens if self.max_tokens is not None else min(DOCUMENT_TOKENS, loaded.max_length)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple(itertools.product(self.sinks, self.windows))

    def describe(self) -> dict[str, Any]:
        """JSON-ready settings; a document given as text is named by its length."""
        described = asdict(self)
        described["documents"] = [name if name in documents() else f"text of {len(name)} characters"
                                  for name in self.documents]
        return described


Evidence = tuple[Any, ModelInfo]


@dataclass(frozen=True)
class TaskRun:
    """How a task runs, which its evidence does not depend on: ``progress`` lines, and the ``engine`` of needle
    trials (None: here, in order; see :class:`~attnscope.experiments.needles.TrialEngine`)."""

    progress: bool = False
    engine: TrialEngine | None = None


TASKS: dict[str, Callable[[LoadedModel, HeadScoreSettings, TaskRun], Evidence]] = {}


def register_task(name: str, builder: Callable[[LoadedModel, HeadScoreSettings, TaskRun], Evidence]) -> None:
    """Add the task ``name``: ``builder(loaded, settings, run)`` -> (the evidence its scores compute from,
    the model's facts)."""
    TASKS[name] = builder


def repeated_evidence(loaded: LoadedModel, settings: HeadScoreSettings, run: TaskRun = TaskRun()) -> Evidence:
    """Whole records of the repeated random-token sequences: ``[sequence, layer, head, T, T]``."""
    sequences = repeated_random_tokens(loaded, settings.period, repeats=settings.repeats,
                                       sequences=settings.sequences, seed=settings.seed)
    records = extract_ids(loaded, sequences)
    layout = RepeatedLayout(len(sequences[0]) - settings.period * settings.repeats, settings.period, settings.repeats)
    return RepeatedEvidence(np.stack([record.attention for record in records]), layout), records[0].model


@contextmanager
def cut_quietly() -> Iterator[None]:
    """Documents are cut at ``max_tokens`` by the settings' choice: no warning for each."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncationWarning)
        yield


def document_texts(settings: HeadScoreSettings) -> list[str]:
    """Each document's text: a shipped document's by name, else the string itself."""
    return [document(name) if name in documents() else name for name in settings.documents]


def locality_evidence(loaded: LoadedModel, settings: HeadScoreSettings, run: TaskRun = TaskRun()) -> Evidence:
    """Planned records holding only the locality grid, one per document."""
    plan = CapturePlan(attention=False, locality=settings.pairs, queries=QuerySelection("every", n=settings.every),
                       chunk=settings.chunk)
    with cut_quietly():
        records = [extract(loaded, text, plan=plan, max_length=settings.document_tokens(loaded), progress=run.progress)
                   for text in document_texts(settings)]
    return LocalityEvidence(records, settings.pairs, settings.share), records[0].model


def sentence_evidence(loaded: LoadedModel, settings: HeadScoreSettings, run: TaskRun = TaskRun()) -> Evidence:
    """Sentence attention of each document, from planned records that keep only ``[layer, head, S, S]``."""
    found, records = [], []
    for text in document_texts(settings):
        with cut_quietly():
            sentences = text_sentences(loaded, text, settings.document_tokens(loaded))
            records.append(sentence_record(loaded, text, sentences, chunk=settings.chunk,
                                           max_length=settings.document_tokens(loaded), progress=run.progress))
        found.append(sentence_attention(records[-1], sentences))
    return found, records[0].model


def needle_grid(settings: HeadScoreSettings) -> dict[str, Any]:
    """The settings' needle grid as :func:`~attnscope.experiments.needles.trial_prompts` takes it."""
    return {"lengths": settings.needle_lengths, "depths": settings.needle_depths, "needles": settings.needles,
            "document_name": settings.needle_document, "form": settings.needle_form,
            "max_new_tokens": settings.needle_new_tokens}


def needle_evidence(loaded: LoadedModel, settings: HeadScoreSettings, run: TaskRun = TaskRun()) -> Evidence:
    """The needle trials of the settings' grid, each head scored on each trial (where ``run.engine`` runs them)."""
    trials = needle_trials(loaded, **needle_grid(settings), progress=run.progress, engine=run.engine)
    return trials, trials.info


register_task("repeated_tokens", repeated_evidence)
register_task("document", locality_evidence)
register_task("sentences", sentence_evidence)
register_task("needles", needle_evidence)


def check_bounds(names: Sequence[str], settings: HeadScoreSettings) -> None:
    """The premises of :func:`head_scores` that need no model (known scores and tasks, numbers in range, shipped
    documents), one line each: what a command checks before it loads one."""
    if not names:
        raise AttnscopeError("no head score asked for")
    tasks = {get_head_function(name).task for name in names}
    missing = sorted(tasks - set(TASKS))
    if missing:
        raise AttnscopeError(f"no task {missing[0]!r} is registered (import its module first)")
    if "repeated_tokens" in tasks and (settings.period < 2 or settings.repeats < 2 or settings.sequences < 1):
        raise AttnscopeError(f"repeated random tokens need a period >= 2, repeats >= 2 and sequences >= 1; got "
                             f"{settings.period}, {settings.repeats} and {settings.sequences}")
    if settings.chunk < 1 or (settings.max_tokens is not None and settings.max_tokens < 1):
        raise AttnscopeError("the query chunk and max_tokens must be at least 1")
    if tasks & {"document", "sentences"}:
        _check_document_names(settings)
    if "document" in tasks:
        _check_locality_numbers(settings)
    if "needles" in tasks:
        _check_needle_bounds(settings)


def _check_document_names(settings: HeadScoreSettings) -> None:
    if not settings.documents:
        raise AttnscopeError("locality and receiver scores need at least one document")
    for name in settings.documents:
        if not name.strip():
            raise AttnscopeError("a document is empty")
        if name not in documents() and len(name) < 200 and "\n" not in name and " " not in name.strip():
            document(name)  # a name that is no shipped document: one line listing them


def _check_locality_numbers(settings: HeadScoreSettings) -> None:
    if not 0 < settings.share <= 1:
        raise AttnscopeError(f"the share a window must keep is in (0, 1], got {settings.share}")
    if settings.every < 1:
        raise AttnscopeError(f"every must be at least 1, got {settings.every}")
    if not settings.sinks or not settings.windows:
        raise AttnscopeError("locality needs at least one sink size and one window")
    CapturePlan(attention=False, locality=settings.pairs)  # refuses a negative sink or a window below 1


def _check_needle_bounds(settings: HeadScoreSettings) -> None:
    """The needle grid's premises that need no model; the rest (a needle as long as its haystack, the window, the
    memory) need the tokenizer: :func:`check_settings`."""
    if not settings.needles or not settings.needle_lengths or not settings.needle_depths:
        raise AttnscopeError("needle trials need at least one length, one depth and one needle")
    for depth in settings.needle_depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
            raise AttnscopeError(f"a needle's depth must be between 0 and 1 (0: the haystack's start), got {depth!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in settings.needle_lengths):
        raise AttnscopeError(f"a haystack's length must be a positive number of tokens, got {settings.needle_lengths}")
    if settings.needle_new_tokens < 1:
        raise AttnscopeError(f"a needle trial's answer needs at least 1 token, got {settings.needle_new_tokens}")
    if settings.needle_form is not None and settings.needle_form not in FORMS:
        raise AttnscopeError(f"unknown prompt form {settings.needle_form!r}; choose one of: {', '.join(FORMS)}")
    for needle_id in settings.needles:
        needle(needle_id)  # one line listing the shipped needles
    document(settings.needle_document)  # one line listing the shipped documents


def check_settings(loaded: LoadedModel, names: Sequence[str], settings: HeadScoreSettings) -> None:
    """Every premise of :func:`head_scores`, one line each, before the model runs: :func:`check_bounds`, then
    what the model decides (a decoder, lengths within its limit)."""
    check_bounds(names, settings)
    tasks = {get_head_function(name).task for name in names}
    if loaded.is_encoder_decoder or not loaded.causal:
        raise AttnscopeError(f"head-function scores need a decoder (causal self-attention); {loaded.name} is "
                             f"{'an encoder-decoder' if loaded.is_encoder_decoder else 'an encoder'}")
    tokens = settings.document_tokens(loaded)
    if tasks & {"document", "sentences"} and tokens > loaded.max_length:
        raise AttnscopeError(f"max_tokens {tokens} is above {loaded.name}'s limit of {loaded.max_length} tokens")
    if "repeated_tokens" in tasks:
        n_tokens = settings.period * settings.repeats + (loaded.tokenizer.bos_token_id is not None)
        loaded.check_length(n_tokens, f"a sequence of {settings.repeats} x {settings.period} random tokens")
    if "needles" in tasks:
        trial_prompts(loaded, **needle_grid(settings))  # builds and checks every prompt; the model does not run


def head_scores(model: LoadedModel | str, scores: Sequence[str] = DEFAULT_SCORES,
                settings: HeadScoreSettings | None = None, *, progress: bool = False,
                engine: TrialEngine | None = None) -> HeadScores:
    """The registered head-function ``scores`` of every layer and head of ``model`` (0-indexed), each task they
    need run once; see :mod:`attnscope.analysis.head_functions` for the definitions.

    ``engine``: where the needle trials of ``retrieval`` run (e.g. ``attnscope.corpus.Engine("ray", num_actors=2)``;
    None: here, in order; see :class:`~attnscope.experiments.needles.TrialEngine`). It is an argument, not a setting:
    the settings say what is computed and are kept with the scores, and either engine computes the same scores.

    >>> found = head_scores("smollm2", ["induction", "previous_token"])          # doctest: +SKIP
    >>> found.ranked("induction", 3)                                              # doctest: +SKIP
    """
    loaded = as_loaded(model)
    settings = settings or HeadScoreSettings()
    names = list(dict.fromkeys(scores))
    check_settings(loaded, names, settings)
    functions = [get_head_function(name) for name in names]
    evidence: dict[str, Evidence] = {}
    columns: dict[str, np.ndarray] = {}
    for function in functions:
        if function.task not in evidence:
            if progress:
                say_slow_step(f"head scores of {loaded.name}: the {function.task} task, for "
                              f"{', '.join(f.name for f in functions if f.task == function.task)}")
            evidence[function.task] = TASKS[function.task](loaded, settings, TaskRun(progress, engine))
        found = evidence[function.task][0]
        columns.update(function.compute(found))
    info = next(iter(evidence.values()))[1]
    return HeadScores.of(info, columns, settings.describe())
