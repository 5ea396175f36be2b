"""Which engine runs a job, with its options (:class:`Engine`): ``local`` (this process) or ``ray`` (an actor pool,
:mod:`attnscope.corpus.ray_engine`). The corpus jobs take one (:mod:`attnscope.corpus.engines`), and so do needle
trials (:meth:`Engine.run_trials`, :mod:`attnscope.corpus.trials`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import AttnscopeError
from .ray_engine import STALL_SECONDS

if TYPE_CHECKING:
    from ..experiments.needles import NeedlePrompt, NeedleTrial
    from ..models.loading import LoadedModel

ENGINES = ("local", "ray")


@dataclass(frozen=True)
class Engine:
    """Where a corpus job, or a grid of needle trials (:meth:`run_trials`), runs: ``local`` (this process) or ``ray``
    (an actor pool of ``num_actors`` on the cluster at ``address``; a job with no finished batch for ``stall_s``
    seconds fails; ``verbose``: Ray's own log lines too; ``runtime_env``: Ray's runtime environment of the job's
    workers, e.g. ``{"env_vars": {"HF_HOME": "/shared/hf"}}``)."""

    name: str = "local"
    address: str | None = None
    num_actors: int | None = None
    stall_s: float = STALL_SECONDS
    verbose: bool = False
    runtime_env: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise AttnscopeError(f"unknown engine {self.name!r}; choose from {', '.join(ENGINES)}")
        if self.name == "local" and (self.num_actors is not None or self.address is not None):
            raise AttnscopeError("--num-actors (--workers) and --address are options of --engine ray")
        if self.num_actors is not None and self.num_actors < 1:
            raise AttnscopeError("--num-actors (--workers) must be at least 1")
        if self.stall_s <= 0:
            raise AttnscopeError("--stall-timeout must be above 0 seconds")
        if self.name == "local" and self.runtime_env is not None:
            raise AttnscopeError("--runtime-env is an option of --engine ray")

    def run_trials(self, loaded: LoadedModel, prompts: Sequence[NeedlePrompt], *, max_new_tokens: int,
                   progress: bool) -> list[NeedleTrial]:
        """Needle trials where this engine runs them (a :class:`~attnscope.experiments.needles.TrialEngine`): here,
        one after the other, or in an actor pool (:func:`attnscope.corpus.trials.trials_on_ray`)."""
        if self.name == "local":
            from ..experiments.needles import run_trials

            return run_trials(loaded, prompts, max_new_tokens=max_new_tokens, progress=progress)
        from .trials import trials_on_ray

        check_engine_device(self.name, loaded.device)
        return trials_on_ray(loaded, prompts, max_new_tokens=max_new_tokens, progress=progress,
                             address=self.address, num_actors=self.num_actors, stall_s=self.stall_s,
                             verbose=self.verbose, runtime_env=self.runtime_env)


def check_engine_device(engine: str, device: str) -> None:
    """Refuse, before any work, a device this machine lacks (or a misspelt one), and on Ray any but the CPU:
    its actors ask Ray for CPUs only, so a GPU there would be asked for and never given."""
    from ..models.loading import check_device

    check_device(device)
    if engine == "ray" and device != "cpu":
        raise AttnscopeError(f"--device {device}: the Ray engine's actors run on CPUs; leave out --device, or run "
                             "the local engine (--engine local)")
