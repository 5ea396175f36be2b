"""The bounds the CLI checks on seeds, seed lists and thread counts hold for Python callers too: every library
function a command calls refuses a bad value with the same one-line AttnscopeError before any slow work
(attnscope.arguments holds each bound once)."""

from __future__ import annotations

import pytest

from attnscope import load_model
from attnscope.arguments import MAX_SEED, MAX_SEEDS, MAX_THREADS
from attnscope.capture.generate import generate
from attnscope.cli import apply_threads
from attnscope.corpus.distributed import evaluate_mixing_on_ray
from attnscope.errors import AttnscopeError
from attnscope.experiments.atp import attribution_patching, verify_estimates
from attnscope.experiments.attribution_check import check_attribution
from attnscope.experiments.faithfulness import evaluate_mixing
from attnscope.experiments.metrics import prepare_metric
from attnscope.experiments.patching import PromptPair, activation_patching
from attnscope.experiments.routes_check import check_routes
from attnscope.experiments.sweeps import run_sweep
from attnscope.lab.experiments import evaluate_seed, evaluate_seeds
from attnscope.lab.translator import TrainingSettings, build
from attnscope.probing.run import probe_edges

PAIR = PromptPair("When Mary and John went out, John gave it to", "When Mary and John went out, Mary gave it to",
                  " Mary", " John")
# a model name that does not exist: a function that checked its seed after loading would say so instead
NO_MODEL = "no-such-model"

# each library function a command passes --seed to, called with the seed as its only bad argument
SEEDED = {
    "generate": lambda seed: generate(NO_MODEL, "hi", do_sample=True, seed=seed),
    "activation_patching": lambda seed: activation_patching(NO_MODEL, PAIR, seed=seed),
    "attribution_patching": lambda seed: attribution_patching(NO_MODEL, PAIR, seed=seed),
    "verify_estimates": lambda seed: verify_estimates(NO_MODEL, [PAIR], None, 1, seed=seed),  # type: ignore[arg-type]
    "check_attribution": lambda seed: check_attribution(NO_MODEL, seed=seed),
    "check_routes": lambda seed: check_routes(NO_MODEL, seed=seed),
    "evaluate_mixing": lambda seed: evaluate_mixing([NO_MODEL], seed=seed),
    "evaluate_mixing_on_ray": lambda seed: evaluate_mixing_on_ray([NO_MODEL], 2, seed=seed, engine=None),  # type: ignore[arg-type]
    "probe_edges": lambda seed: probe_edges(NO_MODEL, seed=seed),
    "probe_edges seeds": lambda seed: probe_edges(NO_MODEL, seeds=[0, seed]),
    "toy evaluate_seed": lambda seed: evaluate_seed(seed),
    "toy evaluate_seeds": lambda seed: evaluate_seeds([seed]),
    "toy build": lambda seed: build(seed),
    "TrainingSettings": lambda seed: TrainingSettings(seed=seed),
}


@pytest.mark.parametrize("name", list(SEEDED))
@pytest.mark.parametrize(("seed", "expected"), [(2**63, f"expected a seed of at most {MAX_SEED}, got {2**63}"),
                                                (-1, "expected a seed of at least 0, got -1"),
                                                (1.5, "expected an integer, got 1.5")])
def test_every_seeded_function_refuses_a_bad_seed_in_one_line(name, seed, expected):
    with pytest.raises(AttnscopeError, match=expected) as refused:
        SEEDED[name](seed)
    assert "\n" not in str(refused.value)


def test_run_sweep_refuses_a_bad_seed_before_any_pass(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")))
    task = prepare_metric("loss", loaded, ["a short text", "another one"], batch_size=2)
    with pytest.raises(AttnscopeError, match=f"seed: expected a seed of at most {MAX_SEED}"):
        run_sweep(loaded, task, "heads", seed=MAX_SEED + 1, progress=False)


def test_seed_lists_are_bounded_like_toy_evaluate_seeds():
    for seeds, expected in (([], f"expected 1 to {MAX_SEEDS} seeds, got 0"),
                            (range(MAX_SEEDS + 1), f"expected 1 to {MAX_SEEDS} seeds, got {MAX_SEEDS + 1}")):
        with pytest.raises(AttnscopeError, match=expected):
            evaluate_seeds(seeds)
    with pytest.raises(AttnscopeError, match=f"expected 1 to {MAX_SEEDS} seeds"):
        probe_edges(NO_MODEL, seeds=range(MAX_SEEDS + 1))


@pytest.mark.parametrize(("threads", "expected"), [(0, "expected a thread count of at least 1, got 0"),
                                                   (2**63, f"expected a thread count of at most {MAX_THREADS}"),
                                                   (2.0, "expected an integer, got 2.0")])
def test_apply_threads_refuses_what_threads_refuses(threads, expected):
    import torch

    before = torch.get_num_threads()
    with pytest.raises(AttnscopeError, match=f"threads: {expected}"):
        apply_threads(threads)
    assert torch.get_num_threads() == before
