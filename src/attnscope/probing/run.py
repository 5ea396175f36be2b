"""The three probes end to end: a model and its data in, a result object out.

These are the only probing functions that touch a model (through
:func:`attnscope.probing.alignment.attend_words`, i.e. :func:`attnscope.extract_corpus`); the
scoring in :mod:`.dependencies`, :mod:`.coref` and :mod:`.probes` works on word-level attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..arguments import check_seed, check_seeds
from ..capture.extract import as_loaded
from ..errors import AttnscopeError
from .alignment import MismatchTally, attend_words, word_token_counts
from .chains import MIN_WINDOW, ChainsResult, plan_documents, score_chains
from .coref import CorefItem, CorefResult, locate_items, score_coref, winowhy_items
from .dependencies import DependencyCounts, DependencyResult, count_dependency_heads
from .documents import documents_of, require_entities
from .probes import ProbeResult, evaluate_over_seeds, reinitialised_model
from .treebank import Treebank, shipped_treebank

WINDOW_TOKENS = 512
WINDOW_MARGIN = 8  # tokens kept free: a window's text may split into a few more pieces than inside its document


def probe_dependencies(model: Any, treebank: Treebank | None = None, *, batch_size: int = 16,
                       progress: bool = True, min_arcs: int = 50,
                       select_on: Treebank | None = None) -> DependencyResult:
    """Per relation, head and direction: how often the most-attended word is the arc's other end.

    ``model``: a loaded model or a name for :func:`attnscope.load_model`; ``treebank``: default
    the shipped silver sample. Relations with fewer than ``min_arcs`` arcs stay out of the headline.
    ``select_on``: other data (e.g. the dev split) on which each relation's head is chosen, then
    scored on ``treebank``, with the best head on ``treebank`` beside it as an upper bound (the oracle);
    without it the head is the best on ``treebank`` itself, which the result says.

    Examples:
        >>> result = probe_dependencies("minilm", read_conllu("en_ewt-ud-test.conllu"),
        ...                             select_on=read_conllu("en_ewt-ud-dev.conllu"))    # doctest: +SKIP
        >>> result.headline()["best_head_acc"]["det"]                                     # doctest: +SKIP
        {'head': '2-8', 'acc': 0.77, 'selected_on': 'dev', 'oracle_head': '2-8', 'oracle_head_acc': 0.77, ...}
    """
    loaded = as_loaded(model)
    treebank = treebank or shipped_treebank()
    tally = MismatchTally()
    counts = _dependency_counts(loaded, treebank, batch_size, progress, tally)
    selection = None if select_on is None else _dependency_counts(loaded, select_on, batch_size, progress,
                                                                  MismatchTally())
    return DependencyResult(counts, loaded.name, treebank.annotation, treebank.silver, tally.to_dict(), min_arcs,
                            selection, select_on.source if select_on is not None else "")


def _dependency_counts(loaded: Any, treebank: Treebank, batch_size: int, progress: bool,
                       tally: MismatchTally) -> DependencyCounts:
    """The model's dependency counts over ``treebank``; one clear error when nothing could be scored."""
    counts = count_dependency_heads(attend_words(loaded, treebank.sentences, batch_size=batch_size,
                                                 progress=progress, tally=tally), causal=loaded.causal)
    if not counts.sentences and counts.too_long:  # nothing to tabulate: say why, not empty tables
        raise AttnscopeError(f"{treebank.source}: no dependency arc could be scored: all {counts.too_long} "
                             f"sentence(s) are longer than {loaded.name}'s limit of {loaded.max_length} tokens; give "
                             "shorter sentences, or a model with a longer limit")
    if not sum(int(n.sum()) for n in counts.arcs.values()):
        raise AttnscopeError(f"{treebank.source}: no dependency arc could be scored: all {counts.dropped_arcs} "
                             f"arc(s) have a word that {loaded.name}'s tokenizer gives no word piece (e.g. only "
                             "invisible or control characters); give sentences with words")
    return counts


def probe_coref(model: Any, items: list[CorefItem] | None = None, *, batch_size: int = 16,
                progress: bool = True) -> CorefResult:
    """Per head, how often a pronoun attends more to its antecedent than to the wrong candidate.

    ``items``: default the 273 Winograd items from BIG-bench ``winowhy``.
    """
    loaded = as_loaded(model)
    located, left_out = locate_items(items if items is not None else winowhy_items())
    aligned = attend_words(loaded, located, batch_size=batch_size, progress=progress)
    return score_coref(aligned, left_out, loaded.name)


def probe_chains(model: Any, treebank: Treebank, *, window: int = WINDOW_TOKENS, singletons: bool = False,
                 batch_size: int = 2, progress: bool = True, select_on: Treebank | None = None) -> ChainsResult:
    """Coreference heads on gold chains (CorefUD ``Entity=``, e.g. GUM): see :mod:`attnscope.probing.chains`.

    Documents are read in windows of ``window`` tokens (at most the model's limit) overlapping by
    half; ``singletons``: singleton mentions are candidates too. ``select_on``: other documents with
    gold chains (e.g. the dev split) on which the head is chosen, then scored on ``treebank``, with
    the best head on ``treebank`` beside it (the oracle, an upper bound).

    >>> result = probe_chains("minilm", read_conllu("en_gum-ud-test.conllu"),
    ...                       select_on=read_conllu("en_gum-ud-dev.conllu"))         # doctest: +SKIP
    >>> result.headline()["best_head_acc"], result.headline()["oracle_head_acc"]   # doctest: +SKIP
    """
    require_entities(treebank)
    if select_on is not None:
        require_entities(select_on)
    loaded = as_loaded(model)
    tokenizer = loaded.tokenizer
    specials = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    tokens = min(window, loaded.max_length)
    budget = tokens - specials - WINDOW_MARGIN
    if budget < MIN_WINDOW:
        raise AttnscopeError(f"--window {window} is too small: a window of {loaded.name} needs at least "
                             f"{specials + WINDOW_MARGIN + MIN_WINDOW} tokens ({specials} special, a margin of "
                             f"{WINDOW_MARGIN} and {MIN_WINDOW} of text)")
    settings = {"window_tokens": tokens, "overlap_tokens": budget // 2,
                "candidates": "all earlier mentions, singletons included" if singletons
                else "earlier mentions of chains with two or more mentions (as CoNLL-2012)",
                "causal": loaded.causal}

    def scored(documents_from: Treebank) -> ChainsResult:
        documents = documents_of(documents_from)
        counts = [word_token_counts(tokenizer, document.text, document.spans) for document in documents]
        texts, left_out = plan_documents(documents, counts, budget, singletons)
        aligned = attend_words(loaded, texts, batch_size=batch_size, progress=progress, rows=lambda item: item.rows())
        return score_chains(aligned, left_out, loaded.name, documents_from.source, len(documents),
                            {**settings, "windows": len(texts)})

    result = scored(treebank)
    return result if select_on is None else result.with_selection(scored(select_on))


def probe_edges(model: Any, treebank: Treebank | None = None, *, batch_size: int = 16, progress: bool = True,
                reinit: bool = True, test_share: float = 0.2, seed: int = 0,
                seeds: Sequence[int] | None = None) -> ProbeResult:
    """The edge, relation and parser probes with their baselines (see :mod:`attnscope.probing.probes`).

    ``reinit=False`` skips the re-initialised-weights baseline (it runs the corpus a second time; its
    weights come from the first seed). ``seeds``: one split and pair sample per seed, each figure
    reported as its mean and range over them (default: ``seed`` alone). The model runs once.
    """
    seeds = check_seeds(seeds) if seeds else (check_seed(seed, "seed"),)
    loaded = as_loaded(model)
    treebank = treebank or shipped_treebank()
    sentences = list(attend_words(loaded, treebank.sentences, batch_size=batch_size, progress=progress))
    baseline = None
    if reinit:
        random_model = reinitialised_model(loaded, seeds[0])
        baseline = list(attend_words(random_model, treebank.sentences, batch_size=batch_size, progress=progress))
    per_seed, sizes = evaluate_over_seeds(sentences, baseline, seeds, test_share)
    return ProbeResult.over_seeds(per_seed, sizes, loaded.name, treebank.annotation, treebank.silver, seeds)
