"""Needle trials on Ray (issue 48, item 4: ``--engine ray`` for the trial grid; item 6: its bad input).

Reference: the local engine's trials of the same grid, one after the other in this process: the Ray engine's
answers, counting, top keys, tokens and retrieval scores equal them exactly, in the grid's order (a local Ray with
2 CPUs and 2 actors, as tests/test_analysis_ray.py starts it). Bad input (Ray missing, ``--workers`` below 1, an
engine that does not exist, more workers than the memory holds) is one line and exit 2, before the model runs
or Ray starts.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from attnscope import HeadScoreSettings, head_scores
from attnscope.capture.plan import MemoryEstimate
from attnscope.corpus import Engine
from attnscope.corpus.trials import check_workers_memory, pool_size, trials_on_ray, worker_memory
from attnscope.errors import AttnscopeError
from attnscope.experiments.needles import needle_trials, run_trials, trial_prompts

from .test_cli_errors import assert_one_error_line, exit_code, must_not_run

GRID = {"needles": ("passkey-1", "sentence-1"), "lengths": (160,), "depths": (0.5,), "max_new_tokens": 14}
SMOLLM2_PARAMETERS = 134_515_008  # SmolLM2-135M's parameter count (embeddings tied), as its model card rounds to 135M
GIB = 2**30


# ---- equal results ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_trials_on_ray_equal_the_local_trials_in_the_grids_order(smollm2, local_ray):
    """SmolLM2 answers the pass key and not the sentence at 160 tokens: one trial counts, so the score is a real one,
    and the two trials' answers differ, so a swapped order shows."""
    local = needle_trials(smollm2, **GRID)
    on_ray = needle_trials(smollm2, **GRID, engine=Engine("ray", num_actors=2))
    assert [trial.counted for trial in local.trials] == [True, False] and np.nanmax(local.scores) > 0.5
    for expected, got in zip(local.trials, on_ray.trials, strict=True):
        assert got.prompt == expected.prompt and got.answer == expected.answer and got.counted == expected.counted
        np.testing.assert_array_equal(got.top_keys, expected.top_keys)  # [step, layer, head]
        np.testing.assert_array_equal(got.token_ids, expected.token_ids)
        np.testing.assert_array_equal(got.scores, expected.scores)
        assert got.model_info == expected.model_info
    np.testing.assert_array_equal(on_ray.scores, local.scores)  # [layer, head]


class CountingEngine:
    """A trial engine that runs the trials here and counts them (what head_scores hands its engine)."""

    def __init__(self) -> None:
        self.runs: list[int] = []

    def run_trials(self, loaded, prompts, *, max_new_tokens, progress):
        self.runs.append(len(prompts))
        return run_trials(loaded, prompts, max_new_tokens=max_new_tokens, progress=progress)


def test_head_scores_run_the_needle_trials_on_the_engine_given_and_only_them(tiny_model_dir):
    from attnscope import load_model

    loaded = load_model(str(tiny_model_dir("llama")))
    settings = HeadScoreSettings(needles=("passkey-1",), needle_lengths=(120,), needle_depths=(0.2, 0.8),
                                 needle_new_tokens=4, period=8, sequences=1)
    engine = CountingEngine()
    found = head_scores(loaded, ["retrieval", "induction"], settings, engine=engine)
    assert engine.runs == [2]  # the two trials of the grid, once; the induction task runs here
    local = head_scores(loaded, ["retrieval", "induction"], settings)
    for name in ("retrieval", "induction"):
        np.testing.assert_array_equal(found.scores[name], local.scores[name])
    assert found.settings == local.settings  # where the trials ran is not a setting of the scores


# ---- memory: each worker holds the model --------------------------------------------------------------------------
def test_a_workers_estimate_holds_the_models_weights_and_the_longest_trials_generation(smollm2):
    from attnscope.capture.generate import generation_estimate

    prompts = trial_prompts(smollm2, **GRID)
    estimate = worker_memory(smollm2, prompts, 14)
    from attnscope.corpus.trials import PROCESS_BYTES

    weights = estimate.kept - PROCESS_BYTES
    assert weights == pytest.approx(SMOLLM2_PARAMETERS * 4, rel=0.02)  # float32, buffers aside
    longest = max(len(prompt.ids) for prompt in prompts)
    assert estimate.working == generation_estimate(smollm2, longest, 14, first_row=longest - 1).total


def test_more_workers_than_the_memory_holds_are_refused_with_the_estimate():
    per_worker = MemoryEstimate(kept=3 * GIB, working=GIB // 2)  # about Qwen2.5 0.5B in float32 and a trial
    with pytest.raises(AttnscopeError) as refused:
        check_workers_memory("qwen0.5b", 8, per_worker, available=16 * GIB)
    message = str(refused.value)
    assert "8 Ray workers" in message and "about 28.0 GiB" in message and "16.0 GiB is available" in message
    assert "at most 3 (--num-actors 3)" in message  # 0.8 x 16 GiB holds three workers of 3.5 GiB
    check_workers_memory("qwen0.5b", 3, per_worker, available=16 * GIB)
    with pytest.raises(AttnscopeError, match="even one worker does not fit"):
        check_workers_memory("qwen0.5b", 1, per_worker, available=2 * GIB)


def test_the_pool_has_no_more_actors_than_trials_and_the_default_fits_the_memory(monkeypatch):
    per_worker = MemoryEstimate(kept=3 * GIB, working=GIB // 2)
    assert pool_size("qwen0.5b", 8, 3, None) == 3  # no memory check on a cluster elsewhere
    monkeypatch.setattr("attnscope.corpus.trials.available_memory", lambda: 16 * GIB)
    assert pool_size("qwen0.5b", 16, 30, per_worker, fit=True) == 3
    with pytest.raises(AttnscopeError, match="at most 3"):
        pool_size("qwen0.5b", 16, 30, per_worker)


def test_workers_that_do_not_fit_are_refused_before_ray_starts(smollm2, monkeypatch):
    must_not_run(monkeypatch, "attnscope.corpus.trials.ray_module")
    monkeypatch.setattr("attnscope.corpus.trials.available_memory", lambda: 2 * GIB)
    prompts = trial_prompts(smollm2, **GRID)
    with pytest.raises(AttnscopeError, match=r"2 Ray workers, each holding smollm2 .* at most 1 \(--num-actors 1\)"):
        trials_on_ray(smollm2, prompts, max_new_tokens=14, num_actors=8)


# ---- the command line: one line, exit 2, before the model runs ----------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (["-s", "retrieval", "--engine", "spark"], "invalid choice: 'spark'"),
    (["-s", "retrieval", "--engine", "ray", "--workers", "0"], "expected a positive integer, got 0"),
    (["-s", "retrieval", "--workers", "2"], "--num-actors (--workers) and --address are options of --engine ray"),
    (["-s", "induction", "--engine", "ray"], "--engine ray runs the needle trials of retrieval"),
])
def test_bad_engine_options_are_one_line_before_the_model_loads(args, expected, monkeypatch, capsys):
    must_not_run(monkeypatch, "attnscope.capture.loading.load_model")
    must_not_run(monkeypatch, "attnscope.corpus.ray_engine.ray_module")
    code = exit_code(["head-functions", *args])
    assert_one_error_line(code, capsys.readouterr().err, expected)


def test_the_ray_engine_without_ray_names_the_extra_to_install(monkeypatch, capsys):
    must_not_run(monkeypatch, "attnscope.capture.loading.load_model")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as it does where Ray is not installed
    code = exit_code(["head-functions", "-s", "retrieval", "--engine", "ray"])
    assert_one_error_line(code, capsys.readouterr().err, "the Ray engine needs Ray: pip install 'attnscope[ray]'")


def test_workers_that_do_not_fit_are_refused_before_any_trial_runs(monkeypatch, tmp_path, capsys):
    must_not_run(monkeypatch, "attnscope.corpus.trials.ray_module")
    must_not_run(monkeypatch, "attnscope.experiments.needles.run_trial")
    monkeypatch.setattr("attnscope.corpus.trials.available_memory", lambda: 2 * GIB)
    out = tmp_path / "scores.parquet"
    code = exit_code(["head-functions", "-m", "smollm2", "-s", "retrieval", "--needle-lengths", "160",
                      "--engine", "ray", "--workers", "4", "--save", str(out)])
    assert_one_error_line(code, capsys.readouterr().err, "4 Ray workers, each holding smollm2")
    assert not any(tmp_path.iterdir())


def test_a_model_the_workers_cannot_load_by_its_name_is_refused_before_ray_starts(smollm2, monkeypatch):
    from dataclasses import replace

    must_not_run(monkeypatch, "attnscope.corpus.trials.ray_module")
    prompts = trial_prompts(smollm2, **GRID)
    renamed = replace(smollm2, name="no-such-model")  # e.g. a model built in memory: no actor could load it
    with pytest.raises(AttnscopeError, match="no-such-model"):
        trials_on_ray(renamed, prompts, max_new_tokens=14, num_actors=2)
