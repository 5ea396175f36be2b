"""Is a route faithful? A check on the attribution check's tasks (``attnscope routes --evaluate``).

An information-flow route (:mod:`attnscope.attribution.routes`) marks the heads and the input tokens through which
information reached one prediction. Per prompt of the tasks of ``attnscope patch --evaluate`` (:mod:`.tasks`:
``brown``, Brown sentences' next words; ``ioi``, indirect-object prompts; the target is the token that follows),
the route of the prediction at the last position is read as scores (:mod:`attnscope.attribution.route_scores`)
and held against what really happens when a part is taken away:

1. **Heads**: each head's route score (``route``: its shares of the kept attention edges; ``route_flow``: the
   prediction's mass passing through it, unpruned) against its total effect alone, the drop of the target logit
   with that head mean-ablated (the attribution check's patching, :func:`.attribution_check.prompt_effects`);
   Spearman's rho over every head and the overlap of the top-20 heads (ties, such as the many heads a pruned route
   gives 0, are broken by head order, as in the attribution check); direct logit attribution (``dla``) beside them.
2. **Tokens**: each input token's route score (``route``, ``route_flow``: the mass reaching its layer-0 node)
   against erasure, the drop of the target's log-probability with the token removed (:func:`.faithfulness.
   erasure_scores`); Spearman's rho over the prompt's tokens (special tokens not ranked); beside them, from the
   context-mixing registry, the last layer's attention (head mean, the last row: ``attention``), attention rollout
   (Abnar & Zuidema 2020: ``rollout``) and ALTI's rollout (Ferrando et al. 2022: ``alti``). The mixing measures
   tokenize the prompt's text again; a prompt whose text does not give back its ids (a tokenizer whose special
   tokens its decoding keeps) is left out of the token comparison and counted.

Route scores are sizes (never negative) while a head or a token may push the target down: each rho is also given
over absolute values (``spearman_magnitude``: |score| against |effect|), which asks whether a route finds what
matters either way. A side whose scores are all equal ranks nothing: its rho is 0. Means over prompts with percentile bootstrap 95%
intervals. The route follows the model's own prediction at the last position, whatever the target; the effects
are measured on the target. Layers and heads are 0-indexed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..arguments import check_seed
from ..attribution.route_scores import route_scores
from ..attribution.routes import TAU, check_route_model, check_tau
from ..capture.extract import as_loaded
from ..models.loading import LoadedModel
from .attribution_check import (
    TASKS,
    TOP_OVERLAP,
    Means,
    _interval,
    check_tasks,
    prompt_effects,
    task_means,
    top_overlap,
)
from .faithfulness import Case, erasure_scores, spearman
from .mixing import encode_text, mixing_measures
from .tasks import NextToken

DEFAULT_PROMPTS = 8  # as the attribution check: patching every head alone is the cost
QUICK_PROMPTS = 4
HEAD_SCORES = {"route": "route (kept edges)", "route_flow": "route flow (unpruned)",
               "dla": "direct logit attribution"}
TOKEN_SCORES = {"route": "route (kept edges)", "route_flow": "route flow (unpruned)",
                "attention": "last layer's attention", "rollout": "attention rollout", "alti": "ALTI rollout"}


@dataclass(frozen=True)
class PromptScores:
    """One prompt's numbers. ``heads[name]`` ``[layer, head]`` (:data:`HEAD_SCORES`) and the reference
    ``patching`` ``[layer, head]``; ``tokens[name]`` ``[ranked]`` (:data:`TOKEN_SCORES`) and the reference
    ``erasure`` ``[ranked]``, both None when the prompt is left out of the token comparison; ``n_edges``: the
    route's kept edges."""

    text: str
    heads: dict[str, np.ndarray]
    patching: np.ndarray
    tokens: dict[str, np.ndarray] | None
    erasure: np.ndarray | None
    n_edges: int

    def head_rho(self, magnitude: bool = False) -> dict[str, float]:
        """Spearman's rho of each head score with patching (``magnitude``: of their absolute values)."""
        size = np.abs if magnitude else np.asarray
        return {name: spearman(size(np.ravel(s)), size(np.ravel(self.patching))) for name, s in self.heads.items()}

    def head_overlap(self) -> dict[str, float]:
        return {name: top_overlap(s, self.patching) for name, s in self.heads.items()}

    def token_rho(self, magnitude: bool = False) -> dict[str, float] | None:
        """Spearman's rho of each token score with erasure (``magnitude``: of their absolute values); None when the
        prompt is left out of the token comparison."""
        if self.tokens is None or self.erasure is None:
            return None
        size = np.abs if magnitude else np.asarray
        return {name: spearman(size(s), size(self.erasure)) for name, s in self.tokens.items()}


def ranked_positions(loaded: LoadedModel, ids: Sequence[int]) -> np.ndarray:
    """The positions whose tokens are ranked: every one but the tokenizer's special tokens."""
    special = set(loaded.tokenizer.all_special_ids)
    return np.array([p for p, token in enumerate(ids) if token not in special], dtype=int)


def token_measures(loaded: LoadedModel, prompt: NextToken, ranked: np.ndarray) -> dict[str, np.ndarray] | None:
    """The mixing registry's scores of the ranked tokens (``attention``, ``rollout``, ``alti``), or None when the
    prompt's text does not tokenize back to its ids."""
    if list(encode_text(loaded, prompt.text)[0].input_ids) != list(prompt.ids):
        return None
    measures = mixing_measures(loaded, prompt.text, ("attention", "alti"))
    attention = measures["attention"]
    return {"attention": attention.layers[-1][-1][ranked], "rollout": attention.output_shares()[ranked],
            "alti": measures["alti"].output_shares()[ranked]}


def prompt_scores(loaded: LoadedModel, prompt: NextToken, means: Means, tau: float = TAU) -> PromptScores:
    """One prompt: the route's scores, DLA, each head alone mean-ablated, erasure and the mixing measures."""
    effects = prompt_effects(loaded, prompt, means, ks=(1,), draws=1, rng=np.random.default_rng(0))
    route = route_scores(loaded, list(prompt.ids), -1, tau)
    heads = {"route": route.heads, "route_flow": route.flow_heads, "dla": effects.dla}
    ranked = ranked_positions(loaded, prompt.ids)
    mixing = token_measures(loaded, prompt, ranked) if len(ranked) >= 3 else None
    if mixing is None:
        return PromptScores(prompt.text, heads, effects.single, None, None, len(route.graph.edges))
    case = Case(prompt.text, torch.tensor(prompt.ids), ranked, prompt.target)
    tokens = {"route": route.tokens[ranked], "route_flow": route.flow_tokens[ranked], **mixing}
    return PromptScores(prompt.text, heads, effects.single, tokens, erasure_scores(loaded, case),
                        len(route.graph.edges))


def summarise_routes(prompts: Sequence[PromptScores], n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Means over prompts ``[mean, low, high]``: per head score its Spearman rho with patching, of the absolute
    values (``spearman_magnitude``) and its top-20 overlap; per token score its Spearman rho with erasure, and of the
    absolute values (over the prompts compared: ``n_token_prompts``); the number of kept edges."""
    interval = lambda rows, name: _interval(np.array([row[name] for row in rows], dtype=float), n_resamples, seed)
    rho, size = [p.head_rho() for p in prompts], [p.head_rho(magnitude=True) for p in prompts]
    overlap = [p.head_overlap() for p in prompts]
    tokens = [row for row in (p.token_rho() for p in prompts) if row is not None]
    token_size = [row for row in (p.token_rho(magnitude=True) for p in prompts) if row is not None]
    return {"n_prompts": len(prompts), "n_token_prompts": len(tokens),
            "edges": interval([{"n": p.n_edges} for p in prompts], "n"),
            "heads": {name: {"spearman": interval(rho, name), "spearman_magnitude": interval(size, name),
                             f"top{TOP_OVERLAP}_overlap": interval(overlap, name)} for name in HEAD_SCORES},
            "tokens": {name: {"spearman": interval(tokens, name), "spearman_magnitude": interval(token_size, name)}
                       for name in TOKEN_SCORES}}


@dataclass(frozen=True, eq=False)
class RoutesCheck:
    """The check's per-prompt numbers of each task (``prompts[task]``); :meth:`to_dict` adds the summaries."""

    model: str
    tau: float
    prompts: dict[str, list[PromptScores]]
    seconds: float = 0.0
    n_resamples: int = 1000
    seed: int = 0

    def summary(self) -> dict[str, Any]:
        return {task: summarise_routes(rows, self.n_resamples, self.seed) for task, rows in self.prompts.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, each task's summary and its per-prompt correlations."""
        rounded = lambda row: None if row is None else {name: round(v, 5) for name, v in row.items()}
        return {"model": self.model, "tau": self.tau, "seconds": round(self.seconds, 1),
                "labels": {"heads": HEAD_SCORES, "tokens": TOKEN_SCORES},
                "heads_reference": "each head alone mean-ablated: the drop of the target logit (its total effect)",
                "tokens_reference": "each token erased: the drop of the target's log-probability",
                "route_position": "the last position: the route of the model's own prediction there",
                "intervals": "percentile bootstrap 95% over prompts", "indexing": "layers and heads are 0-indexed",
                "tasks": self.summary(),
                "per_prompt": {task: [{"text": p.text, "edges": p.n_edges, "heads_spearman": rounded(p.head_rho()),
                                       "heads_spearman_magnitude": rounded(p.head_rho(magnitude=True)),
                                       "tokens_spearman": rounded(p.token_rho()),
                                       "tokens_spearman_magnitude": rounded(p.token_rho(magnitude=True))} for p in rows]
                               for task, rows in self.prompts.items()}}


def check_routes(model: LoadedModel | str, *, tasks: Sequence[str] = tuple(TASKS), n_prompts: int = DEFAULT_PROMPTS,
                 tau: float = TAU, n_resamples: int = 1000, seed: int = 0, progress: bool = False) -> RoutesCheck:
    """Run the check (see the module docstring) on ``n_prompts`` prompts of each task, routes pruned at ``tau``."""
    from tqdm.auto import tqdm

    tau = check_tau(tau)
    check_seed(seed, "seed")
    names = check_tasks(tasks, n_prompts)
    loaded = as_loaded(model)
    check_route_model(loaded)
    prompts = {task: TASKS[task](loaded, n_prompts) for task in names}  # a task that does not fit fails here
    start = time.perf_counter()
    scored = {}
    for task, task_prompts in prompts.items():
        means = task_means(loaded, task_prompts)
        bar = tqdm(task_prompts, desc=f"checking routes ({task})", unit="prompt", disable=not progress, leave=False)
        scored[task] = [prompt_scores(loaded, prompt, means, tau) for prompt in bar]
    return RoutesCheck(loaded.name, tau, scored, time.perf_counter() - start, n_resamples, seed)
