"""Is direct logit attribution faithful? A check on small built-in tasks (``attnscope patch --evaluate``).

Direct logit attribution (DLA) reads a head's term off one forward pass: what its output adds to
the target's logit *directly*, through the residual stream to the LM head. What a head does
through later layers (moving information that a later head or MLP turns into the answer) is not
in its term. Two tests of whether DLA names the heads that matter, per prompt, with the target
logit as the metric:

1. **Ablation**: for k in (1, 5, 20), mean-ablate the k heads with the largest positive DLA terms
   (those that pushed the target up most) and, as the baseline, k heads drawn at random
   (:data:`RANDOM_DRAWS` draws, seeded); the drop of the target logit should be larger for the DLA heads.
2. **Patching agrees**: each head alone mean-ablated (activation patching of that head's output
   with its task mean) gives its total effect, ``logit − logit with the head mean-ablated``;
   Spearman's rank correlation between the heads' DLA terms and these effects (all heads), and the
   overlap of the top-20 heads by each.

**Mean ablation** replaces a head's output (per head, before the output projection) at every position
by its mean over every position of every prompt of the task. Means over prompts come with
percentile bootstrap 95% intervals (``scipy.stats.bootstrap``). Tasks (:mod:`.tasks`): ``brown``,
Brown sentences' next words; ``ioi``, indirect-object prompts from templates.
Layers and heads are 0-indexed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..arguments import check_seed
from ..attribution.dla import direct_logit_attribution
from ..attribution.terms import blocks_by_layer, unembedding
from ..capture.attention import intervene
from ..capture.extract import as_loaded
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from .head_masking import head_sets
from .interventions import attention_shape, head_output_means
from .patching import EncodedPair, PatchHeads, PatchRunner, mean_interval, patch_each_head
from .sweeps import block_inputs, final_modules
from .tasks import NextToken, brown_next_tokens, ioi_next_tokens

KS = (1, 5, 20)
RANDOM_DRAWS = 10
TOP_OVERLAP = 20  # heads compared by each ranking in the overlap
# per task. Patching every head alone is the cost: SmolLM2, a 19-token prompt, 465 block runs of 9 rows, 15 s
# to minutes per prompt on two cores (the latter shared with other jobs); 8 prompts per task keep the check
# to a few minutes alone, and its intervals say how little 8 prompts pin down
DEFAULT_PROMPTS = 8
QUICK_PROMPTS = 4
TASKS: dict[str, Callable[[LoadedModel, int], list[NextToken]]] = {"brown": brown_next_tokens, "ioi": ioi_next_tokens}

Means = dict[int, torch.Tensor]  # layer -> [1, 1, head, d_head]: each head's mean output


@dataclass(frozen=True)
class PromptEffects:
    """One prompt's numbers. ``dla`` ``[layer, head]``: each head's DLA term of the target logit; ``single``
    ``[layer, head]``: the target logit's drop with that head alone mean-ablated; ``logit``: the target
    logit of the intact run; ``ablated[name]``: the drop with a set of heads mean-ablated together
    (``top k``: the k largest DLA terms; ``random k #d``: draw d of k random heads); ``sets[name]``:
    those heads as ``[(layer, head), ...]``."""

    dla: np.ndarray
    single: np.ndarray
    logit: float
    ablated: dict[str, float]
    sets: dict[str, list[tuple[int, int]]]


def task_means(loaded: LoadedModel, prompts: Sequence[NextToken]) -> Means:
    """Each self-attention head's output averaged over every position of every prompt, ``{layer: [1, 1, head, d_head]}``."""
    batches = [{"input_ids": torch.tensor([prompt.ids], device=loaded.input_device)} for prompt in prompts]
    means = head_output_means(loaded, batches, kinds=("self",))
    return {layer: mean[None, None] for (_, layer), mean in means.items()}


def ablation_masks(sets: Sequence[Sequence[tuple[int, int]]], n_layers: int, n_heads: int) -> dict[int, torch.Tensor]:
    """Batch row r mean-ablates the heads of ``sets[r]``: ``{layer: bool [row, head]}``."""
    masks = {layer: torch.zeros((len(sets), n_heads), dtype=torch.bool) for layer in range(n_layers)}
    for row, heads in enumerate(sets):
        for layer, head in heads:
            masks[layer][row, head] = True
    return masks


def prompt_effects(loaded: LoadedModel, prompt: NextToken, means: Means, ks: Sequence[int], draws: int,
                   rng: np.random.Generator) -> PromptEffects:
    """DLA, each head's effect alone and the ablations of one prompt. Runs: one DLA pass, one intact pass
    keeping each block's input, every head patched with its mean from its own layer on (a layer's heads
    side by side), and every ablated set side by side from the first block."""
    _, n_layers, n_heads = attention_shape(loaded, "self")
    dla = direct_logit_attribution(loaded, list(prompt.ids), target=prompt.target).heads
    ids = torch.tensor([prompt.ids], device=loaded.input_device)
    cached = loaded.adapter.final is not None
    blocks = blocks_by_layer(loaded)
    runner = PatchRunner(loaded, EncodedPair(ids, ids, prompt.target, None, ()), "logit", cached=cached,
                         blocks=blocks, finals=final_modules(loaded) if cached else [])
    sets = head_sets(dla, ks, draws, rng)
    with torch.inference_mode():
        with block_inputs(blocks) if cached else nullcontext() as kept:
            logit = float(runner.whole(ids)[0])
        runner.kept = kept
        single = logit - patch_each_head(runner, means, n_layers, n_heads, "cached" if cached else "batched")
        masks = ablation_masks(list(sets.values()), n_layers, n_heads)
        ablated = logit - runner.from_layer(0, len(sets), intervene(PatchHeads(means, masks)))
    return PromptEffects(dla, single, logit, dict(zip(sets, ablated.tolist())), sets)


@dataclass(frozen=True, eq=False)
class AttributionCheck:
    """The check's per-prompt numbers of each task (``effects[task]``) and ``ks``, ``draws``; :meth:`summary`
    gives the means and intervals (what ``to_dict`` writes)."""

    model: str
    ks: tuple[int, ...]
    draws: int
    effects: dict[str, list[PromptEffects]]
    seconds: float = 0.0
    n_resamples: int = 1000
    seed: int = 0
    texts: dict[str, list[str]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {task: summarise_task(effects, self.ks, self.draws, self.n_resamples, self.seed)
                for task, effects in self.effects.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, each task's summary and its per-prompt numbers."""
        return {"model": self.model, "ks": list(self.ks), "random_draws": self.draws, "seconds": round(self.seconds, 1),
                "metric": "the target token's logit at the prompt's last position",
                "mean_ablation": "a head's output (before the output projection) at every position replaced by its "
                                 "mean over every position of every prompt of the task",
                "drop": "intact logit - logit with the heads mean-ablated (larger = the heads mattered more)",
                "top_k": "the k heads with the largest positive DLA terms (pushed the target up most)",
                "patching": "each head alone mean-ablated: its total effect, direct and through later layers",
                "intervals": "percentile bootstrap 95% over prompts", "indexing": "layers and heads are 0-indexed",
                "tasks": self.summary(),
                "per_prompt": {task: [{"text": text, "logit": round(e.logit, 5),
                                       "ablated": {name: round(v, 5) for name, v in e.ablated.items()}}
                                      for text, e in zip(self.texts.get(task, [""] * len(effects)), effects)]
                               for task, effects in self.effects.items()}}


def _interval(values: np.ndarray, n_resamples: int, seed: int) -> list[float | None]:
    """``[mean, low, high]`` over the first axis (bounds None with fewer than 2 values)."""
    mean, low, high = mean_interval(np.asarray(values, dtype=float), n_resamples, seed)
    return [None if not np.isfinite(v) else round(float(v), 5) for v in (mean, low, high)]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two arrays (flattened)."""
    from scipy.stats import spearmanr

    return float(spearmanr(np.ravel(a), np.ravel(b)).statistic)


def top_overlap(a: np.ndarray, b: np.ndarray, k: int = TOP_OVERLAP) -> float:
    """The share of the ``k`` largest entries of ``a`` that are among the ``k`` largest of ``b``."""
    k = min(k, a.size)
    top = lambda values: set(np.argsort(-np.ravel(values), kind="stable")[:k].tolist())
    return len(top(a) & top(b)) / k


def summarise_task(effects: Sequence[PromptEffects], ks: Sequence[int], draws: int, n_resamples: int = 1000,
                   seed: int = 0) -> dict[str, Any]:
    """Means over prompts with bootstrap intervals: per k the drop for the top-k DLA heads, for random heads
    (each prompt's mean over its draws) and their difference; Spearman and top-20 overlap of DLA and
    patching; and the heads where the two rankings disagree most."""
    ablation = {}
    for k in ks:
        top = np.array([e.ablated[f"top {k}"] for e in effects])
        random = np.array([np.mean([e.ablated[f"random {k} #{d}"] for d in range(draws)]) for e in effects])
        ablation[str(k)] = {"top_dla": _interval(top, n_resamples, seed), "random": _interval(random, n_resamples, seed),
                            "difference": _interval(top - random, n_resamples, seed),
                            "share_of_prompts_top_beats_random": round(float(np.mean(top > random)), 4)}
    dla = np.stack([e.dla for e in effects])  # [prompt, layer, head]
    single = np.stack([e.single for e in effects])
    return {"n_prompts": len(effects), "logit": _interval(np.array([e.logit for e in effects]), n_resamples, seed),
            "ablation": ablation,
            "spearman": _interval(np.array([spearman(d, s) for d, s in zip(dla, single)]), n_resamples, seed),
            f"top{TOP_OVERLAP}_overlap": _interval(np.array([top_overlap(d, s) for d, s in zip(dla, single)]),
                                                   n_resamples, seed),
            "heads": disagreements(dla.mean(axis=0), single.mean(axis=0)),
            "mean_dla": dla.mean(axis=0).round(5).tolist(), "mean_patching": single.mean(axis=0).round(5).tolist()}


def disagreements(dla: np.ndarray, single: np.ndarray, n: int = 5) -> dict[str, list[dict[str, Any]]]:
    """The heads each ranking puts first (means over prompts, ``[layer, head]``), with the other's view of them:
    ``by_patching`` (largest effects alone) and ``by_dla`` (largest DLA terms), each ``{layer, head, dla,
    patching, dla_rank, patching_rank}`` (ranks 0 = first)."""
    rank = lambda values: np.argsort(np.argsort(-np.ravel(values), kind="stable"), kind="stable")
    dla_rank, patch_rank = rank(dla), rank(single)
    n_heads = dla.shape[1]

    def described(index: int) -> dict[str, Any]:
        return {"layer": index // n_heads, "head": index % n_heads, "dla": round(float(dla.flat[index]), 4),
                "patching": round(float(single.flat[index]), 4), "dla_rank": int(dla_rank[index]),
                "patching_rank": int(patch_rank[index])}

    first = lambda ranks: [described(int(i)) for i in np.argsort(ranks)[:n]]
    return {"by_patching": first(patch_rank), "by_dla": first(dla_rank)}


def check_tasks(tasks: Sequence[str], n_prompts: int = 2) -> list[str]:
    """``tasks`` (names, or one comma-separated string) if each is a built-in task and ``n_prompts`` gives intervals;
    else one error line."""
    names = [task.strip() for task in (tasks.split(",") if isinstance(tasks, str) else tasks) if task.strip()]
    unknown = [task for task in names if task not in TASKS]
    if unknown or not names:
        raise AttnscopeError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TASKS)}")
    if n_prompts < 2:
        raise AttnscopeError("the check needs at least 2 prompts per task (for its intervals)")
    return names


def check_attribution(model: LoadedModel | str, *, tasks: Sequence[str] = tuple(TASKS), n_prompts: int = DEFAULT_PROMPTS,
                      ks: Sequence[int] = KS, draws: int = RANDOM_DRAWS, n_resamples: int = 1000, seed: int = 0,
                      progress: bool = False) -> AttributionCheck:
    """Run the check (see the module docstring) on ``n_prompts`` prompts of each task."""
    check_seed(seed, "seed")
    loaded = as_loaded(model)
    unembedding(loaded)
    check_tasks(tasks, n_prompts)
    _, n_layers, n_heads = attention_shape(loaded, "self")
    too_many = [k for k in ks if not 1 <= k < n_layers * n_heads]
    if too_many or draws < 1:
        raise AttnscopeError(f"k must be within 1..{n_layers * n_heads - 1} (the model has {n_layers * n_heads} heads) "
                             "and there must be at least one random draw")
    prompts = {task: TASKS[task](loaded, n_prompts) for task in tasks}  # a task that does not fit fails here
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    effects = {}
    for task, task_prompts in prompts.items():
        means = task_means(loaded, task_prompts)
        effects[task] = [prompt_effects(loaded, prompt, means, ks, draws, rng)
                         for prompt in _progress(task_prompts, task, progress)]
    return AttributionCheck(loaded.name, tuple(ks), draws, effects, time.perf_counter() - start, n_resamples, seed,
                            {task: [p.text for p in task_prompts] for task, task_prompts in prompts.items()})


def _progress(items: list[NextToken], task: str, enabled: bool) -> Iterator[NextToken]:
    from tqdm.auto import tqdm

    yield from tqdm(items, desc=f"checking attribution ({task})", unit="prompt", disable=not enabled, leave=False)
