"""Break the toy translator on purpose and watch what its translations lose.

Corruptions and switched-off sublayers use :mod:`attnscope.experiments.interventions` (the one
attention function for patterns; for sublayers, forward hooks that act in the calling thread only
and are always removed, :mod:`attnscope.capture.hooks`). Each experiment is a context manager
factory in ``EXPERIMENTS`` (name-keyed, so the CLI's choices come from it):

* ``uniform``: every source token gets the same cross-attention;
* ``beginning``: only the first 3 source tokens, equally;
* ``end``: only the last source token (``</s>`` for the toy translator);
* ``no-cross-attention``: the cross-attention sublayers add nothing;
* ``decoder-self-attention-only``: no cross-attention and no feed-forward in the decoder;
* ``no-feed-forward``: the decoder's feed-forward sublayers add nothing;
* ``no-layer-norm``: the decoder layers' layer norms pass their input through;
* ``copy-source``: the decoder's first layer receives the source encoding (position by position)
  instead of its own embeddings;
* ``shuffled-source``: the source words are shuffled (seeded) before translation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..analysis.evaluate import mean_and_range
from ..arguments import check_seed, check_seeds
from ..capture.hooks import local_hooks
from ..errors import AttnscopeError
from ..experiments.interventions import Pattern, corrupt_attention, skip_sublayers
from ..models.adapters import find_modules
from ..models.loading import LoadedModel

BEGINNING_TOKENS = 3


def _identity(modules: list[nn.Module]) -> Any:
    """Make ``modules`` pass their input through unchanged (in this thread only)."""
    return local_hooks(modules, lambda _m, inputs, _o: inputs[0])


def _decoder_modules(loaded: LoadedModel, suffix: str) -> list[nn.Module]:
    return [module for name, module in loaded.model.named_modules() if ".decoder.layers." in f".{name}"
            and name.endswith(suffix)]


@contextmanager
def _copy_source(loaded: LoadedModel) -> Iterator[None]:
    """Feed the encoder's output to the first decoder layer in place of the decoder's embeddings."""
    blocks = find_modules(loaded.model, loaded.adapter.blocks)
    encoder_layers = sorted(layer for kind, layer in blocks if kind == "encoder")
    source: dict[str, torch.Tensor] = {}

    def keep(_module: nn.Module, _inputs: Any, output: Any) -> None:
        source["hidden"] = output[0] if isinstance(output, tuple) else output

    def replace(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        encoded = source["hidden"]  # [batch, source_pos, d_model]
        index = torch.arange(hidden.shape[1], device=encoded.device).clamp(max=encoded.shape[1] - 1)
        copied = encoded[:, index].to(hidden.device)  # with device="auto" the encoder may end on another device
        return ((copied, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": copied})

    with (local_hooks([blocks[("encoder", encoder_layers[-1])]], keep),
          local_hooks([blocks[("decoder", 0)]], replace, pre=True)):
        yield


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    apply: Callable[[LoadedModel], Any]  # loaded -> context manager
    shuffle_source: bool = False


def _decoder_layers(loaded: LoadedModel) -> list[int]:
    return sorted({s.layer for s in loaded.sites.values() if s.kind == "cross"})


def _cross(pattern: str | Pattern, k: int = 1) -> Any:
    return corrupt_attention(pattern, kinds=["cross"], k=k)


def _skip(loaded: LoadedModel, *, cross: bool = False, ffn: bool = False) -> Any:
    layers = _decoder_layers(loaded)
    return skip_sublayers(loaded, cross=layers if cross else (), ffn=layers if ffn else (), kind="decoder")


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment("uniform", "cross-attention spread evenly over the source", lambda lm: _cross("uniform")),
        Experiment("beginning", f"cross-attention only on the first {BEGINNING_TOKENS} source tokens",
                   lambda lm: _cross("beginning", BEGINNING_TOKENS)),
        Experiment("end", "cross-attention only on the last source token", lambda lm: _cross("end")),
        Experiment("no-cross-attention", "cross-attention sublayers switched off", lambda lm: _skip(lm, cross=True)),
        Experiment("decoder-self-attention-only", "no cross-attention and no feed-forward in the decoder",
                   lambda lm: _skip(lm, cross=True, ffn=True)),
        Experiment("no-feed-forward", "decoder feed-forward sublayers switched off", lambda lm: _skip(lm, ffn=True)),
        Experiment("no-layer-norm", "decoder layer norms pass their input through",
                   lambda lm: _identity(_decoder_modules(lm, "layer_norm"))),
        Experiment("copy-source", "the decoder starts from the source encoding instead of its embeddings",
                   _copy_source),
        Experiment("shuffled-source", "source words shuffled before translating",
                   lambda lm: _nothing(), shuffle_source=True),
    )
}


def shuffle_words(sentence: str, seed: int = 0) -> str:
    words = sentence.split()
    random.Random(f"{seed}:{sentence}").shuffle(words)
    return " ".join(words)


def translate_with(loaded: LoadedModel, sentences: list[str], experiment: str | None = None,
                   pattern: Pattern | None = None) -> list[str]:
    """Greedy translations under one experiment (by name), a custom cross-attention ``pattern``, or none."""
    from .translator import translate

    if experiment is not None and experiment not in EXPERIMENTS:
        raise AttnscopeError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")
    if not sentences or any(not sentence.strip() for sentence in sentences):
        raise AttnscopeError("every sentence to translate must have text (got an empty one)")
    with ExitStack() as stack:
        if experiment is not None:
            stack.enter_context(EXPERIMENTS[experiment].apply(loaded))
            if EXPERIMENTS[experiment].shuffle_source:
                sentences = [shuffle_words(s) for s in sentences]
        if pattern is not None:
            stack.enter_context(_cross(pattern))
        # no key/value cache: hooks that act per position (copy-source) then see the whole prefix
        return translate(loaded.model, loaded.tokenizer, sentences, use_cache=False)


def evaluate_experiments(loaded: LoadedModel, seed: int = 0) -> dict[str, Any]:
    """Held-out exact match, intact and under every experiment: ``{exact_match, test_pairs, corrupted}``."""
    from .corpus import make_corpus
    from .translator import exact_match

    test = make_corpus(seed).test
    sources, references = [p.english for p in test], [p.german for p in test]
    return {
        "exact_match": round(exact_match(translate_with(loaded, sources), references), 4),
        "test_pairs": len(test),
        "corrupted": {name: round(exact_match(translate_with(loaded, sources, name), references), 4)
                      for name in EXPERIMENTS},
    }


def load_toy_seed(seed: int, progress: bool = True) -> LoadedModel:
    """The toy translator trained with ``seed`` (trained first if not cached; seed 0 is ``toy-translator``)."""
    from ..capture.loading import load_model
    from .translator import build

    return load_model(str(build(seed, progress=progress)))


def evaluate_seed(seed: int, progress: bool = True) -> dict[str, Any]:
    """:func:`evaluate_experiments` for the toy translator trained with ``seed``, on that seed's own held-out
    split (another seed's test pairs may be its training pairs): ``{seed, exact_match, test_pairs, corrupted}``."""
    check_seed(seed, "seed")
    return {"seed": seed, **evaluate_experiments(load_toy_seed(seed, progress), seed)}


def evaluate_seeds(seeds: Sequence[int], progress: bool = True) -> dict[str, Any]:
    """:func:`evaluate_seed` for each of ``seeds`` and :func:`summarise_seeds` over them:
    ``{seeds, per_seed, over_seeds}``."""
    seeds = check_seeds(seeds)
    per_seed = [evaluate_seed(seed, progress) for seed in seeds]
    return {"seeds": seeds, "per_seed": per_seed, "over_seeds": summarise_seeds(per_seed)}


def summarise_seeds(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, min and max over seeds of every exact-match figure: ``{"intact" | experiment: {mean, min, max}}``.

    One training run is one draw: floating point differs between CPUs (and seeds), so a figure is
    only a property of the method when it holds over several runs."""
    columns = {"intact": [figures["exact_match"] for figures in per_seed]}
    for name in EXPERIMENTS:
        columns[name] = [figures["corrupted"][name] for figures in per_seed]
    return {name: mean_and_range(values) for name, values in columns.items()}
