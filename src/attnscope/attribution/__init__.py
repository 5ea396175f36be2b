"""Attribution: which heads, reading which earlier tokens, made a decoder choose a token, and why a head attends.

Analyses over what one capture pass recorded, plus the unembedding and the final norm's scale of the same run
(nothing re-implements a model): direct logit attribution and the logit lens of a prompt (``dla``), of every
step of a generation from the generation's own passes (``steps``: :class:`StepAttribution`, a recorder
``generate`` runs beside its own), one attention score split into (query component, key component) pairs
(``qk``: :func:`qk_attribution`), and their linear algebra (``terms``). On its own floor, between capture and
experiments: it reads what capture's recorders keep, and experiments (patching, the faithfulness check) import it.
``routes``: information-flow routes (Ferrando & Voita 2024), the graph of which tokens, through which heads and
layers, reached one prediction, walked top-down from one forward pass (``attnscope.routes``; the function is not
re-exported here, where the name is the module's).

>>> dla = direct_logit_attribution("smollm2", "The capital of France is")   # doctest: +SKIP
>>> gen = attnscope.generate("smollm2", "The sea is", recorders=[StepAttribution()])   # doctest: +SKIP

Layers, heads and positions are 0-indexed. Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .dla import RUNNER_UP as RUNNER_UP
    from .dla import Attribution as Attribution
    from .dla import LogitLens as LogitLens
    from .dla import direct_logit_attribution as direct_logit_attribution
    from .dla import generation_lens as generation_lens
    from .dla import logit_lens as logit_lens
    from .generation_routes import StepRoutes as StepRoutes
    from .generation_routes import step_routes as step_routes
    from .qk import QKAttribution as QKAttribution
    from .qk import qk_attribution as qk_attribution
    from .routes import Routes as Routes
    from .steps import StepAttribution as StepAttribution

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
