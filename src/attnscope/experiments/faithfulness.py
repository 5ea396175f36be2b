"""Which context-mixing measure is faithful: rank correlation with input erasure and gradient x input.

For each sentence, each measure's map aggregated through the last layer (rollout) gives every input
token a score at the output position, and two references say how much the output really depends
on that token:

* **erasure**: the token removed from the input and the output measured again, all removals of a
  sentence in one batch;
* **gradient x input**: the first-order change of the output when the token's input embedding is
  zeroed, ``||J_j x_j||`` (``|grad_j . x_j|`` for a scalar output).

The output is what the model is used for: for an encoder, the sentence embedding (mean pooling over
all positions, as sentence-transformers pools MiniLM), erasure effect ``1 - cos``, mixing score the
mean of the rollout's rows; for a causal LM, the log-probability of the sentence's last word (its
first token) given the words before it, erasure effect the drop in log-probability, mixing score
the rollout's last row. Special tokens are not ranked.

Per sentence the score is Spearman's rho over its tokens; per model and measure the mean over
sentences with a 95% percentile bootstrap interval over sentences (``scipy.stats.bootstrap``).
Baselines: ``random`` (independent uniform scores, seeded) and ``uniform`` (rollout of uniform
attention: constant for an encoder, which ranks nothing, so its rho is taken as 0; a position
prior for a causal model).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis.mixing import METHODS
from ..analysis.rollout import attention_rollout
from ..arguments import check_seed
from ..capture.attention import Intervention, intervene
from ..capture.concurrency import concurrent_map, default_workers
from ..capture.extract import as_loaded
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from .mixing import encode_text, input_side, mixing_measures

BASELINES = ("random", "uniform")
EVALUATION_MODELS = ("minilm", "smollm2")
DEFAULT_SENTENCES = 200
FIRST_HELD_OUT = 1000  # evaluation sentences come from the second half of the shipped Brown sample
WORDS = (6, 10)  # sentence length in words (short sentences keep the evaluation within minutes)
END_PUNCTUATION = " .,;:!?\"'`)"
FORWARD_AD = threading.Lock()  # torch's forward-mode level is process-wide: one sentence at a time


def evaluation_sentences(n: int = DEFAULT_SENTENCES) -> list[str]:
    """The first ``n`` sentences of 6-10 words from the second half of the Brown sample (fixed in advance,
    never used to choose anything)."""
    from ..data import brown_sentences

    chosen = [s for s in brown_sentences()[FIRST_HELD_OUT:] if WORDS[0] <= len(s.split()) <= WORDS[1]]
    if n > len(chosen):
        raise AttnscopeError(f"the Brown sample holds {len(chosen)} evaluation sentences, asked for {n}")
    return chosen[:n]


@dataclass(frozen=True)
class Case:
    """One sentence prepared for a model: ``ids`` ``[pos]`` the input, ``ranked`` the positions scored,
    ``target`` the token whose log-probability is the output (causal LMs; -1 for encoders)."""

    text: str
    ids: torch.Tensor
    ranked: np.ndarray
    target: int = -1


def prepare_case(loaded: LoadedModel, sentence: str) -> Case | None:
    """The sentence as the model's input (causal LMs: without its last word, which becomes the target);
    None when fewer than 3 tokens would be ranked."""
    text, target = sentence, -1
    if loaded.causal:
        text, _, last = sentence.rstrip(END_PUNCTUATION).rpartition(" ")
        if not text or not last:
            return None
        target = int(loaded.tokenizer(" " + last, add_special_tokens=False).input_ids[0])
    side, inputs = encode_text(loaded, text)
    ranked = np.flatnonzero(~np.asarray(side.special_mask, dtype=bool))
    return Case(text, inputs["input_ids"][0], ranked, target) if len(ranked) >= 3 else None


def model_output(loaded: LoadedModel, case: Case, inputs: torch.Tensor, *, embedded: bool = False) -> torch.Tensor:
    """The output of ``inputs``: token ids ``[batch, pos]`` (or, ``embedded``, input embeddings ``[batch, pos,
    d_model]``): the mean-pooled sentence embedding ``[batch, d_model]`` of an encoder, or the target's
    log-probability ``[batch]`` for a causal LM."""
    given = {"inputs_embeds" if embedded else "input_ids": inputs}
    batch, length = inputs.shape[:2]
    mask = torch.ones((batch, length), dtype=torch.long, device=inputs.device)
    if loaded.causal:
        logits = loaded.model(**given, attention_mask=mask, use_cache=False, logits_to_keep=1).logits[:, -1]
        return _wide(logits).log_softmax(-1)[:, case.target]
    return _wide(input_side(loaded)(**given, attention_mask=mask).last_hidden_state).mean(1)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """float32 at least (bfloat16 models), float64 kept."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def erasure_scores(loaded: LoadedModel, case: Case) -> np.ndarray:
    """Effect on the output of removing each ranked token (one batch of copies): ``[ranked]``."""
    with torch.inference_mode():
        full = model_output(loaded, case, case.ids[None])
        keep = [torch.cat([case.ids[:j], case.ids[j + 1 :]]) for j in case.ranked]
        erased = model_output(loaded, case, torch.stack(keep))
    if loaded.causal:
        return (full - erased).double().cpu().numpy()
    return (1.0 - torch.nn.functional.cosine_similarity(erased, full, dim=-1)).double().cpu().numpy()


def grad_x_input_scores(loaded: LoadedModel, case: Case) -> np.ndarray:
    """First-order change of the output when each ranked token's input embedding is zeroed: ``[ranked]``.

    A scalar output takes one backward pass (``|grad_j . x_j|``); a vector output one forward-mode pass
    over a batch of copies, copy j carrying the tangent ``x_j`` at position j (``||J_j x_j||``). The
    empty intervention keeps attention in attnscope's eager function, which forward mode can differentiate.
    """
    embedding = loaded.model.get_input_embeddings()
    with torch.no_grad():
        embeds = embedding(case.ids[None])  # [1, pos, d_model], in the model's dtype (its gradient too)
    if loaded.causal:
        embeds.requires_grad_(True)
        (grad,) = torch.autograd.grad(model_output(loaded, case, embeds, embedded=True).sum(), embeds)  # no weight gradients
        return (_wide(grad[0]) * _wide(embeds[0].detach())).sum(-1).abs()[case.ranked].double().cpu().numpy()
    from torch.autograd import forward_ad

    copies = embeds.repeat(len(case.ranked), 1, 1)  # [copy, pos, d_model]
    tangent = torch.zeros_like(copies)
    tangent[torch.arange(len(case.ranked)), torch.as_tensor(case.ranked)] = embeds[0, case.ranked]
    with FORWARD_AD, torch.no_grad(), forward_ad.dual_level(), intervene(Intervention()):
        output = model_output(loaded, case, forward_ad.make_dual(copies, tangent), embedded=True)
        change = forward_ad.unpack_dual(output).tangent  # [copy, d_model]
    return change.norm(dim=-1).double().cpu().numpy()


def uniform_scores(case: Case, causal: bool, n_layers: int) -> np.ndarray:
    """The uniform-attention baseline: rollout of attention spread evenly over the keys each query sees."""
    n = len(case.ids)
    allowed = np.tril(np.ones((n, n))) if causal else np.ones((n, n))
    uniform = allowed / allowed.sum(-1, keepdims=True)
    rolled = attention_rollout(np.repeat(uniform[None], n_layers, axis=0)).matrix[-1]
    return (rolled[-1] if causal else rolled.mean(0))[case.ranked]


def spearman(scores: np.ndarray, reference: np.ndarray) -> float:
    """Spearman's rho; 0 when either side is constant (no ranking to compare)."""
    from scipy.stats import spearmanr

    if any(np.allclose(side, side[0], rtol=1e-9, atol=0.0) for side in (scores, reference)):
        return 0.0
    return float(spearmanr(scores, reference).statistic)


def sentence_correlations(loaded: LoadedModel, case: Case, seed: int,
                          methods: Sequence[str] = METHODS) -> dict[str, tuple[float, float]]:
    """``{method or baseline: (rho with erasure, rho with gradient x input)}`` for one sentence
    (``seed``: of its random baseline)."""
    erasure, gradient = erasure_scores(loaded, case), grad_x_input_scores(loaded, case)
    measures = mixing_measures(loaded, case.text, methods)
    scores = {name: mix.output_shares()[case.ranked] for name, mix in measures.items()}
    scores["random"] = np.random.default_rng(seed).random(len(case.ranked))
    scores["uniform"] = uniform_scores(case, loaded.causal, next(iter(measures.values())).n_layers)
    return {name: (spearman(s, erasure), spearman(s, gradient)) for name, s in scores.items()}


def bootstrap_mean(values: np.ndarray, seed: int, n_resamples: int = 1000) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean over sentences."""
    from scipy.stats import bootstrap

    if len(values) < 2 or np.ptp(values) == 0:
        return float(values.mean()), float(values.mean())
    interval = bootstrap((values,), np.mean, n_resamples=n_resamples, confidence_level=0.95, method="percentile",
                         rng=np.random.default_rng(seed)).confidence_interval
    return float(interval.low), float(interval.high)


def summarise(per_sentence: Sequence[dict[str, tuple[float, float]]], seed: int) -> dict[str, dict[str, Any]]:
    """``{method: {"spearman_erasure", "ci", "spearman_grad_x_input"}}`` from per-sentence correlations."""
    table: dict[str, dict[str, Any]] = {}
    for name in per_sentence[0]:
        erasure = np.array([row[name][0] for row in per_sentence])
        gradient = np.array([row[name][1] for row in per_sentence])
        low, high = bootstrap_mean(erasure, seed)
        table[name] = {"spearman_erasure": round(float(erasure.mean()), 4), "ci": [round(low, 4), round(high, 4)],
                       "spearman_grad_x_input": round(float(gradient.mean()), 4)}
    return table


def correlations_by_sentence(loaded: LoadedModel, numbered: Sequence[tuple[int, str]], *, seed: int = 0,
                             methods: Sequence[str] = METHODS, workers: int = 1, progress: bool = False
                             ) -> dict[int, dict[str, tuple[float, float]]]:
    """``{sentence index: sentence_correlations}`` of ``(index, sentence)`` pairs, leaving out sentences
    with fewer than 3 tokens to rank; sentence ``i``'s random baseline is seeded ``seed + i``, so a
    sentence scores the same whichever batch, process or machine computes it (``workers``: sentences
    measured side by side, one intra-op thread each)."""
    from tqdm.auto import tqdm

    cases = [(index, case) for index, case in ((i, prepare_case(loaded, s)) for i, s in numbered) if case is not None]

    def correlate(item: tuple[int, Case]) -> dict[str, tuple[float, float]]:
        return sentence_correlations(loaded, item[1], seed + item[0], methods)

    with concurrent_map(workers) as run_each:
        rows = list(tqdm(run_each(correlate, cases), total=len(cases), unit="sentence",
                         desc=f"mixing faithfulness ({loaded.name})", disable=not progress))
    return {index: row for (index, _), row in zip(cases, rows)}


def summarise_sentences(rows: dict[int, dict[str, tuple[float, float]]], seed: int) -> dict[str, dict[str, Any]]:
    """:func:`summarise` of per-sentence correlations in sentence order (whatever order they arrived in)."""
    if not rows:
        raise AttnscopeError("no sentence has 3 or more tokens to rank")
    return summarise([rows[index] for index in sorted(rows)], seed)


def evaluate_model(model: LoadedModel | str, sentences: Sequence[str], *, seed: int = 0,
                   methods: Sequence[str] = METHODS, progress: bool = True) -> dict[str, dict[str, Any]]:
    """The faithfulness table of one model over ``sentences`` (see the module docstring)."""
    # two sentences at a time, one intra-op thread each: on 2 cores a single pass with two threads
    # stalls at every parallel region whenever another process holds a core (capture.concurrency)
    rows = correlations_by_sentence(as_loaded(model), list(enumerate(sentences)), seed=seed, methods=methods,
                                    workers=default_workers(None, len(sentences) > 1), progress=progress)
    return summarise_sentences(rows, seed)


def evaluate_mixing(models: Sequence[str] = EVALUATION_MODELS, n_sentences: int = DEFAULT_SENTENCES, *,
                    seed: int = 0, progress: bool = True, say: Callable[[str], None] | None = None
                    ) -> dict[str, dict[str, dict[str, Any]]]:
    """``{model: {method: {"spearman_erasure": rho, "ci": [low, high], "spearman_grad_x_input": rho}}}``,
    methods being the five measures and the ``random`` and ``uniform`` baselines."""
    check_seed(seed, "seed")
    sentences = evaluation_sentences(n_sentences)
    results = {}
    for name in models:
        start = time.perf_counter()
        results[name] = evaluate_model(name, sentences, seed=seed, progress=progress)
        if say is not None:
            say(f"{name}: {len(sentences)} sentences in {time.perf_counter() - start:.0f} s")
    return results


def plot_faithfulness(results: dict[str, dict[str, dict[str, Any]]], path: str | Path | None = None) -> Any:
    """Bars of each method's mean Spearman rho with erasure (95% interval as error bars) and, hatched
    beside them, with gradient x input; one panel per model. Saved to ``path`` when given."""
    from ..analysis.figures import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.8), squeeze=False, sharey=True)
    for ax, (model, table) in zip(axes[0], results.items()):
        names = list(table)
        x = np.arange(len(names))
        erasure = np.array([table[n]["spearman_erasure"] for n in names])
        low, high = (np.array([table[n]["ci"][side] for n in names]) for side in (0, 1))
        ax.bar(x - 0.2, erasure, 0.4, yerr=[erasure - low, high - erasure], capsize=3, color="#4c72b0",
               label="with erasure (95% CI)")
        ax.bar(x + 0.2, [table[n]["spearman_grad_x_input"] for n in names], 0.4, color="#dd8452", hatch="//",
               label="with gradient x input")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(x, names, rotation=35, ha="right")
        ax.set_title(model)
    axes[0][0].set_ylabel("mean Spearman rho over sentences")
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
