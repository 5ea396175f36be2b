"""Needle trials on Ray: the trial grid of :func:`~attnscope.experiments.needles.needle_trials` (needle x length x
depth) run by an actor pool, as the corpus jobs run their windows (:mod:`attnscope.corpus.ray_engine`).

The driver builds and checks every prompt (tokenisation only), then each trial is one row of a Ray dataset: the
pickled :class:`~attnscope.experiments.needles.NeedlePrompt` and its index in the grid. Each actor
(:class:`TrialsWorker`) loads the model once, by its name and dtype, and runs
:func:`~attnscope.experiments.needles.run_trial` on the rows it is given; the driver gathers the trials by index, so
they come back in the grid's order, each exactly once (the merged coverage of the indices proves it), and the
retrieval scores are those of the local engine.

Each actor holds the model and one generation: with a Ray started on this machine, actors whose estimated memory
(:func:`worker_memory`) exceeds what is available are refused before Ray starts, with the estimate; left to the
default, the pool is as large as the CPUs, the trials and the memory allow.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..capture.plan import MemoryEstimate, available_memory, check_memory
from .ray_engine import STALL_SECONDS, PartialWorker, actor_resources, fold_on_ray, ray_module, ray_session

if TYPE_CHECKING:
    from ..experiments.needles import NeedlePrompt, NeedleTrial
    from ..models.loading import LoadedModel

PROCESS_BYTES = 512 * 2**20  # a Ray worker process with torch and transformers imported, before the model
MEMORY_HEADROOM = 0.8  # share of the available memory the actors may take (as check_memory's captures)


@dataclass
class TrialsDone:
    """A mergeable partial: finished trials by their index in the grid (disjoint between windows)."""

    trials: dict[int, NeedleTrial]

    def merge(self, other: TrialsDone) -> TrialsDone:
        return TrialsDone({**self.trials, **other.trials})


class TrialsWorker(PartialWorker):
    """Runs the needle trials of its rows (``input_id``: the index in the grid, ``prompt``: the pickled prompt)."""

    def __init__(self, model: str, dtype: str, threads: int, max_new_tokens: int, progress: Any = None) -> None:
        super().__init__(model, dtype, threads, progress)
        self.max_new_tokens = max_new_tokens

    def partial(self, inputs: Any) -> TrialsDone:
        from ..experiments.needles import run_trial

        done = {}
        for index, prompt in zip(inputs["input_id"].tolist(), inputs["prompt"].tolist()):
            done[int(index)] = run_trial(self.loaded, pickle.loads(prompt), max_new_tokens=self.max_new_tokens)
            self.done(1)
        return TrialsDone(done)


def trials_on_ray(loaded: LoadedModel, prompts: Sequence[NeedlePrompt], *, max_new_tokens: int,
                  progress: bool = True, address: str | None = None, num_actors: int | None = None,
                  stall_s: float = STALL_SECONDS, verbose: bool = False,
                  runtime_env: dict[str, Any] | None = None) -> list[NeedleTrial]:
    """:func:`~attnscope.experiments.needles.run_trials` of ``prompts`` in an actor pool (the trials in the prompts'
    order; the options are :class:`~attnscope.corpus.engine_choice.Engine`'s). Refused before Ray starts: a model the
    workers cannot load by its name, and (a Ray started here) more actors than the memory holds."""
    from ..models.loading import resolve_source

    resolve_source(loaded.name)  # each actor loads the model by its name: one it cannot find fails here
    per_worker = worker_memory(loaded, prompts, max_new_tokens)
    memory = per_worker if address is None else None  # another machine's memory is not known here
    if num_actors is not None:
        pool_size(loaded.name, num_actors, len(prompts), memory)
    ray = ray_module()
    with ray_session(ray, address, verbose=verbose, runtime_env=runtime_env) as stderr:
        asked = num_actors or actor_resources(ray.cluster_resources().get("CPU", 1), None)[0]
        actors = pool_size(loaded.name, asked, len(prompts), memory, fit=num_actors is None)
        rows = [{"input_id": [index], "prompt": [pickle.dumps(prompt)]} for index, prompt in enumerate(prompts)]
        dataset = ray.data.from_items(rows, override_num_blocks=len(rows))  # a block a trial: every actor gets some
        folded = fold_on_ray(ray, dataset, TrialsWorker,
                             {"model": loaded.name, "dtype": loaded.dtype, "max_new_tokens": max_new_tokens},
                             n_inputs=len(prompts), num_actors=actors, desc="needle trials (ray)",
                             progress=progress and stderr, stall_s=stall_s, unit="trial")
    done: TrialsDone = folded.value
    return [done.trials[index] for index in range(len(prompts))]


def pool_size(model: str, asked: int, n_trials: int, per_worker: MemoryEstimate | None, *, fit: bool = False) -> int:
    """The actors to start: ``asked``, no more than the trials (an idle actor would hold the model for nothing);
    with ``per_worker`` (a Ray on this machine), checked against the memory, or with ``fit`` (the default pool) cut
    to what the memory holds first.

    >>> pool_size("smollm2", 8, 3, None)
    3
    """
    actors = min(asked, n_trials)
    if per_worker is None:
        return actors
    if fit:
        actors = max(1, min(actors, workers_that_fit(per_worker, available_memory())))
    check_workers_memory(model, actors, per_worker)
    return actors


def worker_memory(loaded: LoadedModel, prompts: Sequence[NeedlePrompt], max_new_tokens: int) -> MemoryEstimate:
    """What one actor needs at its peak, in bytes: ``kept`` its process and the model's weights and buffers,
    ``working`` the generation of the longest trial (decode-step rows only, as a trial keeps)."""
    from ..capture.generate import generation_estimate

    weights = sum(tensor.nbytes for tensor in (*loaded.model.parameters(), *loaded.model.buffers()))
    longest = max(len(prompt.ids) for prompt in prompts)
    generation = generation_estimate(loaded, longest, max_new_tokens, first_row=longest - 1)
    return MemoryEstimate(kept=PROCESS_BYTES + weights, working=generation.total)


def check_workers_memory(model: str, workers: int, per_worker: MemoryEstimate, *,
                         available: int | None = None) -> None:
    """Refuse ``workers`` actors whose estimate exceeds :data:`MEMORY_HEADROOM` of the available memory, with the
    estimate and how many fit (``available`` overrides the system's figure, for tests)."""
    available = available_memory() if available is None else available
    total = MemoryEstimate(kept=workers * per_worker.kept, working=workers * per_worker.working)
    fit = workers_that_fit(per_worker, available)
    advice = (f"ask for at most {fit} (--num-actors {fit})" if fit else
              "even one worker does not fit: free memory, or run the trials here (--engine local)")
    check_memory(total, what=f"{workers} Ray workers, each holding {model} and one trial's generation "
                 f"({per_worker.total / 2**30:.1f} GiB each)", headroom=MEMORY_HEADROOM, available=available,
                 advice=advice)


def workers_that_fit(per_worker: MemoryEstimate, available: int | None) -> int:
    """How many actors of ``per_worker`` the available memory holds (a large number where it is unknown)."""
    if available is None:
        return 2**31
    return int(MEMORY_HEADROOM * available // per_worker.total)
